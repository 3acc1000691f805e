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


def truncate_jsonl(path: str, step: int) -> None:
    """Keep the rows of steps <= step (and drop a torn last line), atomically; a resumed run appends after them."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        if not line.endswith("\n"):
            break  # the writer was killed in the middle of this line
        if json.loads(line)["step"] > step:
            break
        kept.append(line)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(kept)
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
            truncate_jsonl(self.path, resume_step)
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
