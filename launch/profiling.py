"""Where a step's time goes: wall-clock seconds per phase, and torch.profiler traces of chosen steps.

Phases (every step logs each, 0 when a phase did no work):
  rollout            generation by the engine
  reward             scoring the responses, building the rollout buffer and advantages
  logprob_recompute  log-probs recomputed by the trainer (the KL reference, when --kl_coef > 0)
  train              the train step (forward, backward, clipping, AdamW)
  weight_sync        pushing the new weights to the engine
The values become `time_<phase>` metrics (timings file and TensorBoard).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import torch

PHASES = ("rollout", "reward", "logprob_recompute", "train", "weight_sync")


def parse_profile_steps(text: str) -> tuple[int, int] | None:
    """'A:B' -> (A, B), the RL steps A..B inclusive, numbered as in metrics.jsonl; '' -> None."""
    if not text:
        return None
    a, sep, b = text.partition(":")
    if not sep or not a.strip().isdigit() or not b.strip().isdigit():
        raise ValueError(f"expected A:B with whole numbers (e.g. 3:5), got {text!r}")
    first, last = int(a), int(b)
    if not 1 <= first <= last:
        raise ValueError(f"expected A:B with 1 <= A <= B, got {text!r}")
    return first, last


class PhaseTimer:
    """Accumulates wall-clock seconds per phase of one step: `with timer("train"): ...`.

    Each phase is also a torch.profiler range, so traces show the same names.
    """

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if phase not in self.seconds:
            raise KeyError(f"unknown phase {phase!r}; phases are {PHASES}")
        t0 = time.perf_counter()
        try:
            with torch.profiler.record_function(phase):
                yield
        finally:
            self.seconds[phase] += time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        return {f"time_{p}": s for p, s in self.seconds.items()}


def trace_path(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, "profile", f"step_{step:08d}.trace.json")


class StepProfiler:
    """A torch.profiler session around each step in [first, last]; one Chrome trace file per step."""

    def __init__(self, steps: tuple[int, int] | None, output_dir: str):
        self.steps = steps
        self.output_dir = output_dir
        self._prof: torch.profiler.profile | None = None

    def begin(self, step: int) -> None:
        if self.steps is None or not self.steps[0] <= step <= self.steps[1]:
            return
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._prof.__enter__()

    def end(self, step: int) -> None:
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        path = trace_path(self.output_dir, step)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        prof.export_chrome_trace(path)
