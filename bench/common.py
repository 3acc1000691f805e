"""What every benchmark shares: arguments, machine facts, tables, JSON, and the tiny Qwen2 model."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# The default job's model (launch/flags/cpu_tiny.flags): Qwen2, hidden 128, 2 layers, GQA 4/2 heads.
TINY_QWEN2 = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-6)


def parse_args(name: str, description: str, argv: Sequence[str] | None,
               add: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=description)
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run (numbers meaningless)")
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, f"{name}.json"), help="where the JSON goes")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads, the same for every contender")
    if add is not None:
        add(p)
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    return args


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(threads: int) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_avg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of fn, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (also readable in a terminal); returned so run_all can collect it."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    return text


def write_json(path: str, result: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}", flush=True)


def save_tiny_qwen2(path: str, vocab_size: int, max_positions: int, seed: int = 0) -> str:
    """A random-init transformers Qwen2ForCausalLM (the default job's shape) saved as config + safetensors."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)  # transformers' own init draws from the global generator
    cfg = transformers.Qwen2Config(vocab_size=vocab_size, max_position_embeddings=max_positions, **TINY_QWEN2)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path
