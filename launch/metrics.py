"""Metrics sinks: JSONL (one line per step, stable key order), TensorBoard, and a reward plot.

metrics.jsonl holds only what the seed determines, so two runs of the same flags (or a
straight and a resumed run) write it byte for byte alike; wall-clock `time_*` values go
to timings.jsonl (same row format) and both go to TensorBoard.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any


def to_floats(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        out[k] = float(v.item()) if hasattr(v, "item") else float(v)
    return out


TIMING_PREFIX = "time_"


def split_timings(metrics: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """(seed-determined metrics, wall-clock `time_*` timings)."""
    timings = {k: v for k, v in metrics.items() if k.startswith(TIMING_PREFIX)}
    return {k: v for k, v in metrics.items() if k not in timings}, timings


def jsonl_row(step: int, values: dict[str, float]) -> str:
    return json.dumps({"step": step, **{k: values[k] for k in sorted(values)}}, allow_nan=True) + "\n"


class MetricsFileError(Exception):
    """metrics.jsonl cannot be continued (missing, malformed or with steps missing): the message names the file."""


def truncate_jsonl(path: str, step: int, required: bool = False) -> None:
    """Keep the rows of steps <= step (and drop a torn last line), atomically; a resumed run appends after them.

    With `required` (metrics.jsonl) the kept rows must be exactly steps 1..step, the ones the checkpoint
    says were run: a deleted or cut file would otherwise be continued without a word and the run's record
    would silently lack them.
    """
    if not os.path.exists(path):
        if required and step > 0:
            raise MetricsFileError(f"--resume: {path} is missing, but the checkpoint has {step} RL steps done; "
                                   f"restore the file, or start a fresh run in another --output_dir")
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    kept = []
    for n, line in enumerate(lines, 1):
        if not line.endswith("\n"):
            break  # the writer was killed in the middle of this line
        try:
            row_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError) as e:
            raise MetricsFileError(f"--resume: {path} line {n} is not a metrics row ({type(e).__name__}: {e}): "
                                   f"{line[:80]!r}; repair or remove that line") from None
        if row_step > step:
            break
        kept.append(row_step)
    if required and kept != list(range(1, step + 1)):
        missing = sorted(set(range(1, step + 1)) - set(kept))
        raise MetricsFileError(f"--resume: {path} does not hold the rows of steps 1..{step} that the checkpoint has "
                               f"done (missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                               f"found {len(kept)} rows); restore the file, or start a fresh run in another "
                               f"--output_dir")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(lines[: len(kept)])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class MetricsWriter:
    """metrics.jsonl + timings.jsonl + TensorBoard. With resume_step, rows after it are dropped and
    new ones appended (TensorBoard purges its later events too)."""

    def __init__(self, output_dir: str, tensorboard: bool = True, resume_step: int | None = None):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.timings_path = os.path.join(output_dir, "timings.jsonl")
        if resume_step is not None:
            truncate_jsonl(self.path, resume_step, required=True)
            truncate_jsonl(self.timings_path, resume_step)
        mode = "w" if resume_step is None else "a"
        self._file = open(self.path, mode)
        self._timings = open(self.timings_path, mode)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"), purge_step=purge)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        values, timings = split_timings(metrics)
        self._file.write(jsonl_row(step, values))
        self._file.flush()
        if timings:
            self._timings.write(jsonl_row(step, timings))
            self._timings.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._file.close()
        self._timings.close()
        if self._tb is not None:
            self._tb.close()


def read_jsonl(path: str) -> list[dict[str, float]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(metrics_path: str, out_png: str, keys: tuple[str, ...] = ("reward_mean", "eval_success")) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    for k in keys:
        pts = [(r["step"], r[k]) for r in rows if k in r]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if k.startswith("eval") else None, markersize=3, label=k)
    ax.set_xlabel("step")
    ax.set_ylabel("value")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("miles-fn: reward and held-out success")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
