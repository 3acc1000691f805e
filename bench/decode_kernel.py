"""The C decode kernel's forwards on the real model (SmolLM2-135M-Instruct), by GEMM rows: its GEMM as it was
and with each change since, side by side, and a prefill on torch against the kernel.

A "B x T" cell is one block step of T tokens for each of B rows (B x T GEMM rows): 1 x 1 a batch-1 decode
step, 1 x 4 a batch-1 speculative verify at k=3, 8 x 4 a batch-8 one, 64 x 1 the default job's step. The
contenders are builds and settings of the same kernel (ops/decode_cpu.py's comparison switches); every
one gives the same logits as the current kernel to float32 rounding, and the three GEMM changes the same
bits. The prefill cells are `model.last_logits` (torch, MKL) against `decode_cpu.prefill` (the kernel) on
top of a cached 20-token system turn. Contenders alternate, repeat after repeat; each cell is its best
step.

The last table sets each cell beside the core's float32 FMA peak, measured here by 12 independent FMA chains
on the kernel's registers (ops/csrc/decode_cpu.c, mf_fma_peak): the time the cell's matmul FLOPs take at
that peak bounds any float32 kernel, and so any speculative verify of that many rows
(docs/speculative-decoding.md uses it for batch 8). MKL's best on a large square GEMM is given beside it.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

import ops
from bench import common
from bench.real_model import NAME
from bench.train_throughput import matmul_peak
from miles_fn import model
from ops import decode_cpu
from state import gguf_import, hf

# (name, environment): each later one adds one change to the one before it
CONTENDERS = [
    ("before: 8-float pairs, 2 KiB prefetch, MKL past 8 rows",
     {"MILES_FN_DECODE_WIDE": "0", "MILES_FN_DECODE_PREFETCH": "2048", "MILES_FN_DECODE_BLOCKED": "0"}),
    ("+ 16 KiB prefetch", {"MILES_FN_DECODE_WIDE": "0", "MILES_FN_DECODE_BLOCKED": "0"}),
    ("+ 16-float pairs (AVX-512)", {"MILES_FN_DECODE_BLOCKED": "0"}),
    ("+ blocked GEMM to 64 rows (now)", {}),
]
SWITCHES = ("MILES_FN_DECODE_WIDE", "MILES_FN_DECODE_PREFETCH", "MILES_FN_DECODE_BLOCKED")
SHAPES = [(1, 1), (1, 4), (2, 4), (8, 1), (8, 2), (1, 24), (8, 4), (32, 1), (64, 1)]
SYSTEM = 20  # cached columns before a prefill block


def use(env: dict[str, str]) -> None:
    """Switch the kernel build and settings in this process (the library is cached per flags)."""
    for k in SWITCHES:
        os.environ.pop(k, None)
    os.environ.update(env)
    decode_cpu._library.cache_clear()


def matmul_flops_per_row(params: Any, cfg: Any) -> int:
    """2 x the weights a token's forward multiplies by: every layer matrix and the output layer (the embedding
    lookup multiplies nothing; tied, its matrix is the output layer, counted once). Attention's own
    products (2 x 2 x context x width a layer, under 1% here) are left out."""
    layers = sum(w.numel() for layer in params["layers"] for w in layer.values() if w.ndim >= 2)
    return 2 * (layers + params.get("lm_head", params["embed"]).numel())


def fma_peak_gflops(steps: int, iters: int = 20_000_000) -> float:
    """One core's float32 FMA peak on the kernel's widest registers."""
    lib, out = decode_cpu._library()[0], (ctypes.c_float * 1)()
    flops = lib.mf_fma_peak(iters, out)
    return flops / common.best_of(lambda: lib.mf_fma_peak(iters, out), steps) / 1e9


def block_step(params: Any, cfg: Any, b: int, t: int) -> Callable[[], Any]:
    cache = model.new_kv_cache(cfg, b, SYSTEM + t)
    cos, sin = ops.rope_tables(SYSTEM + torch.arange(t)[None].expand(b, t), cfg.dim_head, cfg.rope_theta)
    plan = decode_cpu.DecodePlan(params, cfg, cache, torch.ones(b, SYSTEM + t, dtype=torch.bool), cos[:, 0],
                                 sin[:, 0], block=t)
    tok = torch.randint(0, 1000, (b, t), generator=torch.Generator().manual_seed(b * 100 + t))
    return lambda: plan.block_step(tok, torch.zeros(b, dtype=torch.int64), SYSTEM)


def prefill(params: Any, cfg: Any, t: int, kernel: bool) -> Callable[[], Any]:
    cache = model.new_kv_cache(cfg, 1, SYSTEM + t)
    tok = torch.randint(0, 1000, (1, t), generator=torch.Generator().manual_seed(t))
    pos = torch.arange(SYSTEM, SYSTEM + t)[None]
    if kernel:
        return lambda: decode_cpu.prefill(params, cfg, tok, pos, cache, SYSTEM)
    mask = torch.ones(1, t, SYSTEM + t, dtype=torch.bool).tril(SYSTEM)
    return lambda: model.last_logits(params, cfg, tok, pos, mask, cache, SYSTEM)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = common.parse_args("decode_kernel", __doc__.splitlines()[0], argv, lambda p: (
        p.add_argument("--repeats", type=int, default=3),
        p.add_argument("--steps", type=int, default=10, help="timed steps per cell and repeat"),
        p.add_argument("--model_cache_dir", default=gguf_import.DEFAULT_CACHE_DIR)))
    shapes, prefills = SHAPES, [24, 44]
    if args.quick:
        args.repeats, args.steps, shapes, prefills = 1, 1, [(1, 1), (2, 5)], [3]
    if decode_cpu.status():
        raise SystemExit(f"bench.decode_kernel: the C kernel cannot run here: {decode_cpu.status()}")
    torch.set_num_threads(args.threads)
    cfg, params = hf.load_hf(gguf_import.resolve_checkpoint(NAME, args.model_cache_dir))
    saved = {k: os.environ.get(k) for k in SWITCHES}
    secs: dict[tuple[str, str], list[float]] = {}
    try:
        for _ in range(args.repeats):
            for name, env in CONTENDERS:
                use(env)
                for b, t in shapes:
                    secs.setdefault((f"{b} x {t}", name), []).append(common.best_of(block_step(params, cfg, b, t),
                                                                                    args.steps))
            use({})
            for t in prefills:
                for name, kernel in (("torch", False), ("kernel", True)):
                    secs.setdefault((f"prefill 1 x {t}", name), []).append(
                        common.best_of(prefill(params, cfg, t, kernel), args.steps))
        peak = max(fma_peak_gflops(3 if args.quick else args.steps) for _ in range(args.repeats))
        mkl = max(matmul_peak(2048, 3 if args.quick else args.steps) for _ in range(args.repeats)) / 1e9
    finally:
        use({k: v for k, v in saved.items() if v is not None})
    results, rows = [], []
    for b, t in shapes:
        cell = f"{b} x {t}"
        base = min(secs[(cell, CONTENDERS[0][0])])
        ms = [min(secs[(cell, name)]) * 1e3 for name, _ in CONTENDERS]
        results.append({"cell": cell, "gemm_rows": b * t, "ms": dict(zip([n for n, _ in CONTENDERS], ms, strict=True)),
                        "speedup": base * 1e3 / ms[-1]})
        rows.append([cell, b * t, *[round(m, 2) for m in ms], round(base * 1e3 / ms[-1], 2)])
    table = common.print_table(
        f"The C kernel's forward on SmolLM2-135M, ms (best of {args.steps} steps x {args.repeats}), {args.threads} "
        f"thread(s); wide pairs {'built' if decode_cpu._library()[0].mf_wide_pairs() else 'not built'} here",
        ["B x T", "GEMM rows", *[n for n, _ in CONTENDERS], "now / before"], rows)
    prows = []
    for t in prefills:
        cell = f"prefill 1 x {t}"
        tt, tk = min(secs[(cell, "torch")]), min(secs[(cell, "kernel")])
        results.append({"cell": cell, "gemm_rows": t, "ms": {"torch": tt * 1e3, "kernel": tk * 1e3},
                        "speedup": tt / tk})
        prows.append([cell, round(tt * 1e3, 1), round(tk * 1e3, 1), round(tt / tk, 2)])
    table += "\n" + common.print_table(f"A prefill block on a {SYSTEM}-token cache, ms", ["block", "torch (MKL)",
                                                                                     "C kernel", "kernel / torch"],
                                       prows)
    flops, now = matmul_flops_per_row(params, cfg), CONTENDERS[-1][0]
    crows = []
    for b, t in shapes:
        ms, floor = min(secs[(f"{b} x {t}", now)]) * 1e3, flops * b * t / peak / 1e6
        crows.append([f"{b} x {t}", b * t, round(ms, 2), round(floor, 2), round(flops * b * t / ms / 1e6, 1),
                      round(floor / ms, 2)])
    table += "\n" + common.print_table(
        f"Against one core's float32 FMA peak ({peak:.0f} GFLOP/s; MKL on a 2048^3 GEMM: {mkl:.0f}), "
        f"{flops / 1e6:.0f} MFLOP of matmul a token",
        ["B x T", "GEMM rows", "kernel ms", "ms at peak", "kernel GFLOP/s", "share of peak"], crows)
    out = {"machine": common.machine_info(args.threads), "model": NAME, "repeats": args.repeats,
           "peak_gflops": peak, "mkl_gflops": mkl, "matmul_flops_per_row": flops, "results": results, "table": table}
    common.write_json(args.out, out)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
