"""Training throughput on the real model's shapes (SmolLM2-135M-Instruct: 30 layers, hidden 576, MLP 1536,
9/3 heads, vocab 49,152): FLOP/s of the policy loss' forward+backward and of the whole train step at an
RL micro-batch of the smollm2_arith job's lengths, as a fraction of the matmul peak measured in the same
run with GEMMs of the model's own shapes (tokens x hidden times hidden x out, for every distinct matrix).

The FLOP accounting, the batch and the timing are bench/train_throughput.py's (best of the repeats on both
sides of the fraction); the weights are random at the model's shapes (throughput does not depend on them).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from bench import common, train_throughput
from miles_fn import model
from miles_fn.config import ModelConfig
from state import gguf_import, hf

NAME = "smollm2-135m-instruct"


def gemm_shapes(cfg: ModelConfig, tokens: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of every distinct weight matmul of a forward over `tokens` tokens, the output layer included."""
    layer = model.param_shapes(cfg)["layers"][0]
    mats = {tuple(s) for s in layer.values() if len(s) == 2} | {(cfg.vocab_size, cfg.hidden_size)}
    return sorted((tokens, k, n) for n, k in mats)  # weights are stored (out, in): x @ W.T


def gemm_peak(shapes: list[tuple[int, int, int]], repeats: int) -> tuple[float, dict[str, float]]:
    """The best FLOP/s of any of the shapes (each best of `repeats`), and each shape's best."""
    per_shape = {}
    for m, k, n in shapes:
        a, w = torch.randn(m, k), torch.randn(n, k)
        a @ w.T
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ w.T
            best = min(best, time.perf_counter() - t0)
        per_shape[f"{m}x{k}x{n}"] = 2 * m * k * n / best
    return max(per_shape.values()), per_shape


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = common.parse_args("real_train", __doc__.splitlines()[0], argv, lambda p: (
        p.add_argument("--rows", type=int, default=8, help="samples in the micro-batch"),
        p.add_argument("--tokens_per_row", type=int, default=64, help="prompt + reply tokens (the job: ~40 + 24)"),
        p.add_argument("--repeats", type=int, default=2),
        p.add_argument("--model_cache_dir", default=gguf_import.DEFAULT_CACHE_DIR),
    ))
    torch.set_num_threads(args.threads)
    rows, t, repeats = args.rows, args.tokens_per_row, args.repeats
    if args.quick:
        rows, t, repeats = 1, 8, 1
    cfg, _ = hf.load_hf(gguf_import.resolve_checkpoint(NAME, args.model_cache_dir))
    shapes = gemm_shapes(cfg, rows * (t - 1))
    peak_before, per_before = gemm_peak(shapes, 3)
    r = train_throughput.measure(cfg, rows, t, repeats)
    peak_after, per_after = gemm_peak(shapes, 3)
    peak = max(peak_before, peak_after)
    per_shape = {s: max(per_before[s], per_after[s]) for s in per_before}
    r["fraction_of_peak"] = r["fwd_bwd_flops_per_s"] / peak
    r["train_step_fraction_of_peak"] = r["model_flops"] / r["train_step_seconds"] / peak
    table = common.print_table(
        f"Training throughput on SmolLM2-135M-Instruct's shapes, float32, {args.threads} thread(s), best of "
        f"{repeats}; matmul peak {peak / 1e9:.1f} GFLOP/s (the model's GEMMs at {rows * (t - 1)} tokens, best of 3)",
        ["batch (rows x tokens)", "fwd+bwd tokens/s", "train step tokens/s", "fwd+bwd GFLOP/s",
         "fwd+bwd fraction of peak", "train step fraction of peak"],
        [[f"{rows} x {t}", r["fwd_bwd_tokens_per_s"], r["train_step_tokens_per_s"], r["fwd_bwd_flops_per_s"] / 1e9,
          f"{100 * r['fraction_of_peak']:.1f}%", f"{100 * r['train_step_fraction_of_peak']:.1f}%"]])
    out = {"benchmark": "real_train", "model": NAME, "machine": common.machine_info(args.threads),
           "quick": args.quick, "matmul_peak_flops_per_s": peak, "gemm_flops_per_s": per_shape,
           "results": [r], "table": table}
    common.write_json(args.out, out)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
