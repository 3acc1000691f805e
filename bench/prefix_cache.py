"""The prefill's turn cuts and the prefix cache on the real model: SmolLM2-135M-Instruct, chat_arith prompts.

Each case runs its contenders alternating, repeat after repeat, on the same prompts and keys, with the
job's sampling (temperature 0.7, the chat template's end token stopping a row): the prefill as it was
before the cuts ("one piece": the same calls with no stop token, which a 1-token call does not need), cut
with no cache, and cut with a cache that starts empty each run (as an engine's calls do after a weight
sync). Prefill cases sample one token a call; "whole calls" decode up to --new_tokens. Every cut contender's
tokens must be the same.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import torch

import ops
from bench import common
from bench.real_model import NAME
from launch import data as launch_data
from miles_fn import prng
from miles_fn.generate import generate
from miles_fn.prefix_cache import PrefixCache
from miles_fn.sampling import SamplingConfig
from miles_fn.tasks.chat_arith import ChatArithTask
from state import gguf_import, hf

JOB_OPS = ops.OpsConfig(decode_backend="auto")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = common.parse_args("prefix_cache", __doc__.splitlines()[0], argv, lambda p: (
        p.add_argument("--prompts", type=int, default=8),
        p.add_argument("--group", type=int, default=8, help="samples per prompt in the batched case"),
        p.add_argument("--repeats", type=int, default=5),
        p.add_argument("--new_tokens", type=int, default=24, help="the job's --max_new_tokens"),
        p.add_argument("--cache_mb", type=int, default=256, help="the job's --prefix_cache_mb"),
        p.add_argument("--model_cache_dir", default=gguf_import.DEFAULT_CACHE_DIR)))
    if args.quick:
        args.prompts, args.group, args.repeats, args.new_tokens = 2, 2, 1, 2
    torch.set_num_threads(args.threads)
    path = gguf_import.resolve_checkpoint(NAME, args.model_cache_dir)
    cfg, params = hf.load_hf(path)
    task = ChatArithTask(launch_data.load_tokenizer(path), 2, 1)  # the job's --task_digits, --task_second_digits
    g = torch.Generator().manual_seed(23)
    prompts = [task.prompt_ids(int(a), int(b)) for a, b in zip(torch.randint(10, 100, (args.prompts,), generator=g),
                                                                torch.randint(0, 10, (args.prompts,), generator=g),
                                                                strict=True)]
    whole = SamplingConfig(temperature=0.7, max_new_tokens=args.new_tokens, stop_token_ids=(task.tokenizer.eos_id,))
    one = dataclasses.replace(whole, max_new_tokens=1)
    before = dataclasses.replace(one, stop_token_ids=())
    mb = args.cache_mb

    def run(calls: list[list[list[int]]], sampling: SamplingConfig, cache_mb: int) -> tuple[list, int]:
        pc = PrefixCache(cache_mb << 20)
        toks = [generate(params, cfg, c, prng.fold_in(prng.key(0), i), sampling, ops_cfg=JOB_OPS,
                         prefix_cache=pc).tokens for i, c in enumerate(calls)]
        return toks, pc.hit_tokens

    singles, batch = [[p] for p in prompts], [prompts]
    grouped = [[p for p in prompts for _ in range(args.group)]]
    three = [("one piece (before)", before, 0), ("cut, no cache", one, 0), ("cut, with the cache", one, mb)]
    cases = [(f"{len(prompts)} prefills of 1 prompt", singles, three),
             (f"1 prefill of {len(prompts)} prompts", batch, three),
             (f"1 prefill of {len(prompts) * args.group} rows", grouped, three),
             (f"{len(prompts)} whole batch-1 calls", singles, [("cut, no cache", whole, 0),
                                                               ("cut, with the cache", whole, mb)])]
    results, rows = [], []
    for case, calls, contenders in cases:
        secs: dict[str, list[float]] = {name: [] for name, _, _ in contenders}
        toks, saved = {}, {}
        for _ in range(args.repeats):
            for name, sampling, cache_mb in contenders:
                sec, (toks[name], saved[name]) = common.timed(lambda c=calls, s=sampling, m=cache_mb: run(c, s, m))
                secs[name].append(sec)
        cut = [t for name, t in toks.items() if name != "one piece (before)"]
        if any(t != cut[0] for t in cut):
            raise AssertionError(f"{case}: the prefix cache changed the tokens")
        base = common.median(secs[contenders[0][0]])
        for name, _, _ in contenders:
            sec = common.median(secs[name])
            results.append({"case": case, "contender": name, "seconds": sec, "speedup": base / sec,
                            "cached_tokens": saved[name], "identical_tokens": True})
            rows.append([case, name, round(sec, 3), round(base / sec, 2), saved[name]])
    table = common.print_table(f"Prefill cuts and the prefix cache on SmolLM2-135M, chat_arith, {args.threads} "
                               f"thread(s), median of {args.repeats}",
                               ["calls", "contender", "seconds", "x first", "prompt tokens from the cache"], rows)
    out = {"machine": common.machine_info(args.threads), "model": NAME, "repeats": args.repeats,
           "prompt_tokens": [len(p) for p in prompts], "results": results, "table": table}
    common.write_json(args.out, out)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
