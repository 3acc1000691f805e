"""Metrics sinks: JSONL (one line per step, stable key order), TensorBoard, and a reward plot."""

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


class MetricsWriter:
    def __init__(self, output_dir: str, tensorboard: bool = True, resume: bool = False):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._file = open(self.path, "a" if resume else "w")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: metrics[k] for k in sorted(metrics)}}
        self._file.write(json.dumps(row, allow_nan=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._file.close()
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
