"""The run's train steps, built from its config, and a guard that snapshots them.

`make_step_fn` is the one place that turns a RunConfig into `step(state, batch, key)`, so
the job and `launch.replay` execute the same function. `StepGuard` runs a step, writes a
snapshot (state/snapshot.py) when asked to or when the step fails (it raised, or its loss
or gradients are not finite), and on failure stops the run with StepFailed naming the snapshot.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch

from launch import memory as launch_memory
from launch import resume
from launch.flags import RunConfig
from miles_fn import lora, prng, train
from miles_fn.config import ModelConfig
from state import snapshot
from state.train_state import TrainState
from state.tree import tree_hash

StepFn = Callable[[TrainState, Any, prng.Key], tuple[TrainState, dict[str, torch.Tensor]]]
PHASES = ("sft", "rl")


class StepFailed(Exception):
    """A step raised or produced non-finite loss/gradients; the message names its snapshot."""


def make_step_fn(cfg: RunConfig, phase: str, mesh: Any = None) -> StepFn:
    """RL: the GRPO loss under the memory flags (micro-batching, recompute); SFT: the plain supervised step.
    Under --lora_rank both differentiate the loss of the merged weights in the adapters (lora.loss_for).
    Under a ("dp",) mesh (torchrun) RL trains data-parallel on sharded state; the SFT warm-up's steps
    run replicated (every rank the whole batch on the gathered state, then keeps its shard): the same
    bits as one process, at the cost of the warm-up's full optimizer state per rank while it runs."""
    if phase == "rl":  # the default is make_grpo_loss under launch.memory; launch.rl picks by the objective flags
        from launch import rl, speculative

        return speculative.wrap_update(cfg, rl.make_update(cfg, mesh))  # --speculative_algorithm: + the draft's
    if phase == "sft":
        loss_fn = train.make_sft_loss(cfg.model, cfg.ops)

        def sft_step(state: TrainState, batch: Any, key: prng.Key) -> tuple[TrainState, dict[str, torch.Tensor]]:
            return train.train_step(state, batch, key, lora.loss_for(loss_fn, state, cfg.lora), cfg.sft_optim)

        if mesh is None:
            return sft_step
        from miles_fn import sharding

        def replicated(state: TrainState, batch: Any, key: prng.Key) -> tuple[TrainState, dict[str, torch.Tensor]]:
            full, metrics = sft_step(sharding.full_state(state), batch, key)
            return sharding.shard_state(full, mesh), metrics

        return replicated
    raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")


def snapshot_path(output_dir: str, phase: str, index: int) -> str:
    return os.path.join(output_dir, "snapshots", f"{phase}_{index:08d}")


class StepGuard:
    """Runs the phases' step functions; snapshots `snapshot_steps` of RL and every failed step."""

    def __init__(self, fns: dict[str, StepFn], output_dir: str, snapshot_steps: tuple[int, ...],
                 flags: dict[str, Any], model_cfg: ModelConfig, passthrough: tuple[type[Exception], ...] = (),
                 is_passthrough: Callable[[BaseException], bool] = lambda e: False):
        self.fns, self.output_dir, self.snapshot_steps = fns, output_dir, snapshot_steps
        self.flags, self.model_cfg, self.passthrough = flags, model_cfg, passthrough
        self.is_passthrough = is_passthrough  # under torchrun: a failed collective (no snapshot can be gathered)

    @classmethod
    def from_config(cls, cfg: RunConfig, flags: dict[str, Any], mesh: Any = None,
                    is_passthrough: Callable[[BaseException], bool] = lambda e: False) -> StepGuard:
        """The job's guard; a bad memory plan is a flag error, reported as such rather than snapshotted.
        Under a mesh every rank saves a snapshot together (its shards through torch.distributed.checkpoint),
        and `launch.replay` loads it in one process."""
        fns = {p: make_step_fn(cfg, p, mesh) for p in PHASES}
        return cls(fns, cfg.output_dir, cfg.repro.snapshot_steps, flags, cfg.model, (launch_memory.MemoryPlanError,),
                   is_passthrough)

    def __call__(
        self, phase: str, index: int, state: TrainState, batch: Any, key: prng.Key
    ) -> tuple[TrainState, dict[str, torch.Tensor]]:
        """Step `index` (1-based) of `phase`; the state is returned by the pure step, never mutated."""
        try:
            new_state, metrics = self.fns[phase](state, batch, key)
        except self.passthrough:
            raise
        except Exception as e:
            if self.is_passthrough(e):
                raise
            err = f"{type(e).__name__}: {e}"
            path = self._save(phase, index, state, batch, key, snapshot.Outcome(None, None, False, None, err), "raised")
            raise StepFailed(f"{phase} step {index} raised {err}\n  snapshot: {path}\n"
                             f"  replay:   python -m launch.replay --snapshot={path}") from e
        finite = bool(metrics["finite"])
        asked = phase == "rl" and index in self.snapshot_steps
        if asked or not finite:
            out = snapshot.Outcome(metrics["loss"], metrics["grad_norm"], finite, tree_hash(_full(new_state)), None)
            path = self._save(phase, index, state, batch, key, out, "requested" if finite else "non-finite")
            if not finite:
                raise StepFailed(
                    f"{phase} step {index}: non-finite loss or gradients (loss={float(metrics['loss'])}, "
                    f"grad_norm={float(metrics['grad_norm'])}); the update was skipped and the run stops.\n"
                    f"  snapshot: {path}\n  replay:   python -m launch.replay --snapshot={path}")
        return new_state, metrics

    def _save(self, phase: str, index: int, state: TrainState, batch: Any, key: prng.Key,
              outcome: snapshot.Outcome, reason: str) -> str:
        path = snapshot_path(self.output_dir, phase, index)
        info = {"phase": phase, "index": index, "reason": reason, "code_version": resume.running_code_version(),
                "model": dataclasses.asdict(self.model_cfg)}
        snapshot.save(path, snapshot.Snapshot(state, batch, key, self.flags, outcome, info))
        return path


def _full(state: Any) -> Any:
    """The state one process holds (sharded params and moments gathered: a collective under torchrun)."""
    from miles_fn import sharding

    if hasattr(state, "opt_state"):
        return sharding.full_state(state)
    return state
