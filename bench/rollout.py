"""Rollout: the embedded engine against transformers' generate() on the same tiny Qwen2 weights.

Float32 on CPU, the same prompts (addition prompts of the default task), the same sampling
(multinomial at temperature 1, no top-k/top-p) and no early stop: both produce exactly
`--new_tokens` tokens per row (no stop token for the engine, min_new_tokens for transformers).
The engine runs as the job does (--decode_backend=auto: each decode step one C call, ops.decode_cpu,
where it builds) and, for the record, with its torch decode path (--decode_backend=torch).
Repeats alternate between the contenders, so that a busy machine slows all alike.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

import ops
from bench import common
from miles_fn import prng
from miles_fn.generate import generate
from miles_fn.sampling import SamplingConfig
from miles_fn.tasks.addition import AdditionTask
from ops import decode_cpu
from state import hf

JOB_OPS = ops.OpsConfig(decode_backend="auto")  # launch.flags' default
TORCH_DECODE = ops.OpsConfig(decode_backend="torch")


def prompts_for(batch: int) -> list[list[int]]:
    task = AdditionTask()
    return [task.prompt_ids(*p) for p in task.sample_pairs(prng.key(7), batch)]


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    lp = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), lp, dtype=torch.int64)
    mask = torch.zeros(len(prompts), lp, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, lp - len(p) :] = torch.tensor(p)
        mask[i, lp - len(p) :] = 1
    return ids, mask


def run_ours(params: Any, cfg: Any, prompts: list[list[int]], new_tokens: int, seed: int,
             ops_cfg: ops.OpsConfig = JOB_OPS) -> int:
    gen = generate(params, cfg, prompts, prng.key(seed), SamplingConfig(temperature=1.0, max_new_tokens=new_tokens),
                   ops_cfg=ops_cfg)
    n = sum(len(t) for t in gen.tokens)
    assert n == len(prompts) * new_tokens, "the engine stopped early"
    return n


def run_transformers(m: Any, prompts: list[list[int]], new_tokens: int, seed: int) -> int:
    ids, mask = left_padded(prompts)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = m.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
    n = (out.shape[1] - ids.shape[1]) * out.shape[0]
    assert n == len(prompts) * new_tokens, "transformers stopped early"
    return n


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = common.parse_args("rollout", __doc__.splitlines()[0], argv, lambda p: (
        p.add_argument("--batches", default="8,32", help="comma-separated batch sizes"),
        p.add_argument("--new_tokens", type=int, default=128),
        p.add_argument("--repeats", type=int, default=5),
    ))
    batches = [int(b) for b in args.batches.split(",")]
    new_tokens, repeats = args.new_tokens, args.repeats
    if args.quick:
        batches, new_tokens, repeats = [2], 8, 1
    torch.set_num_threads(args.threads)
    import transformers

    task = AdditionTask()
    with tempfile.TemporaryDirectory() as tmp:
        path = common.save_tiny_qwen2(tmp, task.tokenizer.vocab_size, max_positions=64 + new_tokens)
        cfg, params = hf.load_hf(path)
        m = transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    results = []
    for b in batches:
        prompts = prompts_for(b)
        run_ours(params, cfg, prompts, 4, 0)  # warm-up: first-call allocations, lazy inits, the kernel's build
        run_ours(params, cfg, prompts, 4, 0, TORCH_DECODE)
        run_transformers(m, prompts, 4, 0)
        ours, ours_torch, theirs = [], [], []
        for r in range(repeats):
            t, n = common.timed(lambda r=r, p=prompts: run_ours(params, cfg, p, new_tokens, r))
            ours.append(n / t)
            t, n = common.timed(lambda r=r, p=prompts: run_ours(params, cfg, p, new_tokens, r, TORCH_DECODE))
            ours_torch.append(n / t)
            t, n = common.timed(lambda r=r, p=prompts: run_transformers(m, p, new_tokens, r))
            theirs.append(n / t)
        results.append({"batch": b, "new_tokens": new_tokens, "repeats": repeats,
                        "miles_fn_tokens_per_s": common.median(ours),
                        "miles_fn_torch_decode_tokens_per_s": common.median(ours_torch),
                        "transformers_tokens_per_s": common.median(theirs),
                        "ratio": common.median(ours) / common.median(theirs),
                        "ratio_torch_decode": common.median(ours_torch) / common.median(theirs),
                        "miles_fn_samples": ours, "miles_fn_torch_decode_samples": ours_torch,
                        "transformers_samples": theirs})
    kernel = decode_cpu.status() or "the C decode kernel"
    table = common.print_table(
        f"Rollout: {new_tokens} new tokens, sampling at temperature 1, float32, {args.threads} thread(s) "
        f"(median of {repeats}); miles-fn decodes with {kernel}",
        ["batch", "miles-fn tokens/s", "transformers generate() tokens/s", "ratio",
         "miles-fn torch decode tokens/s", "ratio (torch decode)"],
        [[r["batch"], r["miles_fn_tokens_per_s"], r["transformers_tokens_per_s"], f"{r['ratio']:.2f}x",
          r["miles_fn_torch_decode_tokens_per_s"], f"{r['ratio_torch_decode']:.2f}x"] for r in results])
    out = {"benchmark": "rollout", "machine": common.machine_info(args.threads), "quick": args.quick,
           "decode_kernel": decode_cpu.status() or "cpu_kernel",
           "transformers": transformers.__version__, "results": results, "table": table}
    common.write_json(args.out, out)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
