"""Speculative decoding on the real model: SmolLM2-135M-Instruct as the target, through a real RL run.

The draft is a 1-layer LM of the target's vocabulary (hidden --draft_hidden), first distilled (miles_fn.draft,
soft cross-entropy) on the instruct model's own chat_arith rollouts: the "frozen" draft. Then the job itself
runs, `launch/flags/smollm2_arith.flags` for --rl_steps GRPO steps with `--speculative_algorithm=STANDALONE
--draft_checkpoint=<frozen>`, so its rollouts speculate and its draft trains online after each update
(--draft_train_steps): the final checkpoint holds the drifted policy ("late") and the "online" draft, and the
run's metrics.jsonl gives the acceptance step by step.

Each (policy, batch) cell then times no draft (the job's plain decode: the C kernel), the frozen draft and,
late, the online draft, alternating repeat after repeat, on the same chat_arith prompts and keys, with the
job's sampling (temperature 0.7, the chat template's end token stops a row, --new_tokens at most). Every
contender's tokens must equal plain decoding's. The batch's tail is the time from the first finished sample
to the last: a call cut at the first sample's length (the same prefix: sampling is a function of the keys)
is timed beside the full one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

import ops
from bench import common
from bench.real_model import NAME
from launch import data as launch_data
from miles_fn import draft, model, prng, train
from miles_fn.generate import generate
from miles_fn.optim import OptimConfig
from miles_fn.prefix_cache import PrefixCache
from miles_fn.rollout_buffer import build_rollout_buffer
from miles_fn.sampling import SamplingConfig
from miles_fn.speculative import generate_speculative
from miles_fn.tasks.chat_arith import ChatArithTask
from state import checkpoint, gguf_import, hf

JOB_OPS = ops.OpsConfig(decode_backend="auto")
FLAGFILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "flags",
                        "smollm2_arith.flags")


def questions(task: ChatArithTask, n: int, seed: int) -> list[list[int]]:
    """n chat_arith prompts (a two-digit plus a one-digit number, as the job asks) through the chat template."""
    g = torch.Generator().manual_seed(seed)
    return [task.prompt_ids(int(a), int(b)) for a, b in zip(torch.randint(10, 100, (n,), generator=g),
                                                             torch.randint(0, 10, (n,), generator=g), strict=True)]


def distill(target: Any, cfg: Any, dcfg: Any, d_state: Any, prompts: list[list[int]], key: prng.Key,
            sampling: SamplingConfig, chunk: int, steps: int, lr: float) -> tuple[Any, list[float]]:
    """The draft trained on the target's rollouts of `prompts`, `chunk` at a time, `steps` AdamW steps a chunk
    (what --draft_train_steps does after each RL step); the expected acceptance before each chunk."""
    opt = OptimConfig(lr=lr, max_grad_norm=1.0)
    accept = []
    for c in range(0, len(prompts), chunk):
        p, k = prompts[c : c + chunk], prng.fold_in(key, c)
        gen = generate(target, cfg, p, prng.fold_in(k, 0), sampling, ops_cfg=JOB_OPS)
        buf = build_rollout_buffer(p, gen.tokens, gen.logprobs, [0.0] * len(p), list(range(len(p))))
        d_state, m = draft.draft_update(d_state, target, cfg, dcfg, buf, prng.fold_in(k, 1), opt, steps,
                                        sampling.logprob_temperature)
        accept.append(float(m["draft_expected_accept"]))
    return d_state, accept


def run_job(out_dir: str, draft_dir: str, args: Any) -> None:
    """The smollm2_arith job with speculation and online draft training, for --rl_steps steps."""
    cmd = [sys.executable, "-m", "launch.main", f"--flagfile={FLAGFILE}", f"--num_steps={args.rl_steps}",
           f"--save_every={args.rl_steps}", "--eval_every=0", "--eval_size=32", f"--output_dir={out_dir}",
           f"--model_cache_dir={args.model_cache_dir}", "--speculative_algorithm=STANDALONE",
           f"--speculative_num_steps={args.k}", f"--draft_checkpoint={draft_dir}",
           f"--draft_train_steps={args.draft_steps}", f"--draft_lr={args.draft_lr}",
           f"--num_threads={args.train_threads}", f"--prefix_cache_mb={args.prefix_cache_mb}"]
    if args.quick:  # seconds: a tiny step of the same job
        cmd += ["--prompts_per_step=2", "--group_size=2", f"--max_new_tokens={args.new_tokens}", "--eval_size=2"]
    stamp = os.path.join(out_dir, "bench_cmd.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == {"cmd": cmd[1:], "draft_sha": _tree_sha(draft_dir)}:
                print(f"reusing the finished job in {out_dir}", flush=True)
                return
    shutil.rmtree(out_dir, ignore_errors=True)  # a fresh run, not a resume of an older one
    print("running:", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the RL job failed (rc {done.returncode}): {done.stderr[-3000:]}")
    with open(stamp, "w") as f:
        json.dump({"cmd": cmd[1:], "draft_sha": _tree_sha(draft_dir)}, f)


def _tree_sha(path: str) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            h.update(name.encode() + f.read())
    return h.hexdigest()


def job_metrics(out_dir: str) -> list[dict[str, Any]]:
    rows = []
    for name in ("metrics.jsonl", "timings.jsonl"):
        with open(os.path.join(out_dir, name)) as f:
            for i, line in enumerate(f):
                r = json.loads(line)
                if i < len(rows):
                    rows[i].update(r)
                else:
                    rows.append(r)
    keep = ("step", "spec_accept_length", "draft_expected_accept", "reward_mean", "response_len",
            "time_rollout_tokens_per_s")
    return [{k: r[k] for k in keep if k in r} for r in rows]


def make_contenders(target: Any, cfg: Any, drafts: dict[str, Any], dcfg: Any, groups: list[list[list[int]]],
                    key: prng.Key, sampling: SamplingConfig, prefix_mb: int) -> dict[str, Any]:
    """Plain decoding as the job runs it, and speculation with each draft (name -> (params,
    disable_by_batch_size, k)), each over every group of prompts in turn (a group is one call):
    name -> () -> (token lists, tokens per verify or None). Each contender's run starts with an empty
    prefix cache of prefix_mb MiB, as an engine's calls do after a weight sync; with prefix_mb > 0,
    "no draft, no prefix cache" runs plain decoding without one."""

    def plain(mb: int) -> tuple[list[list[int]], None]:
        pc = PrefixCache(mb << 20)
        return [t for i, g in enumerate(groups) for t in generate(target, cfg, g, prng.fold_in(key, i), sampling,
                                                                  ops_cfg=JOB_OPS, prefix_cache=pc).tokens], None

    def spec(d: Any, disable: int, k: int) -> tuple[list[list[int]], float]:
        toks, verifies, emitted, pc = [], 0, 0, PrefixCache(prefix_mb << 20)
        for i, g in enumerate(groups):
            gen, st = generate_speculative(target, cfg, d, dcfg, g, prng.fold_in(key, i), sampling, k,
                                           ops_cfg=JOB_OPS, disable_by_batch_size=disable, prefix_cache=pc)
            toks += gen.tokens
            verifies, emitted = verifies + st.verifies, emitted + st.emitted
        return toks, emitted / max(verifies, 1)

    off = {"no draft, no prefix cache": lambda: plain(0)} if prefix_mb else {}
    return {"no draft": lambda: plain(prefix_mb), **off, **{name: (lambda d=d: spec(*d)) for name, d in drafts.items()}}


def time_cell(contenders: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Each contender `repeats` times, alternating: median seconds, tokens, tokens per verify, same tokens."""
    secs: dict[str, list[float]] = {n: [] for n in contenders}
    toks: dict[str, Any] = {}
    per_verify: dict[str, float] = {}
    for _ in range(repeats):
        for name, fn in contenders.items():
            sec, (toks[name], tpv) = common.timed(fn)
            secs[name].append(sec)
            if tpv is not None:
                per_verify[name] = tpv
    ref = toks["no draft"]
    return {"seconds": {n: common.median(v) for n, v in secs.items()}, "tokens": sum(len(t) for t in ref),
            "lengths": [len(t) for t in ref], "identical": all(t == ref for t in toks.values()),
            "tokens_per_verify": per_verify}


def cell(target: Any, cfg: Any, drafts: dict[str, Any], dcfg: Any, groups: list[list[list[int]]], key: prng.Key,
         sampling: SamplingConfig, repeats: int, prefix_mb: int) -> dict[str, Any]:
    """One (policy, batch) cell: the whole calls; the prefill (a call that samples one token: what decoding
    adds to is the rest); and, for one group of several rows, the tail after the first row finishes."""
    full = time_cell(make_contenders(target, cfg, drafts, dcfg, groups, key, sampling, prefix_mb), repeats)
    one = dataclasses.replace(sampling, max_new_tokens=1)
    full["prefill"] = time_cell(make_contenders(target, cfg, drafts, dcfg, groups, key, one, prefix_mb),
                                repeats)["seconds"]
    first = min(full["lengths"])
    full["tail"] = {}
    if len(groups) == 1 and first < max(full["lengths"]):  # the same prefix, cut where the first row stops
        cut = dataclasses.replace(sampling, max_new_tokens=first)
        head = time_cell(make_contenders(target, cfg, drafts, dcfg, groups, key, cut, prefix_mb), repeats)["seconds"]
        full["tail"] = {n: max(0.0, full["seconds"][n] - head[n]) for n in full["seconds"]}
    return full


def _ints(csv: str) -> list[int]:
    return [int(x) for x in csv.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = common.parse_args("real_spec_decode", __doc__.splitlines()[0], argv, lambda p: (
        p.add_argument("--batches", default="1,8,32", help="comma-separated rollout batch sizes"),
        p.add_argument("--k", type=int, default=3, help="--speculative_num_steps"),
        p.add_argument("--other_k", default="1,2", help="comma-separated: the online draft's extra contenders late "
                       "in the run, at these draft lengths (the job's draft, trained as the job trains it)"),
        p.add_argument("--repeats", type=int, default=3),
        p.add_argument("--new_tokens", type=int, default=24, help="the job's --max_new_tokens"),
        p.add_argument("--draft_hidden", type=int, default=128),
        p.add_argument("--distill_prompts", type=int, default=128),
        p.add_argument("--distill_steps", type=int, default=30, help="AdamW steps per 32 distillation prompts"),
        p.add_argument("--draft_steps", type=int, default=4, help="the job's --draft_train_steps"),
        p.add_argument("--draft_lr", type=float, default=1e-3),
        p.add_argument("--rl_steps", type=int, default=30, help="GRPO steps of the job (the flagfile's 30)"),
        p.add_argument("--plain_past", type=int, default=2, help="the online draft's extra contender at larger "
                       "batches: --speculative_disable_by_batch_size"),
        p.add_argument("--prefix_cache_mb", type=int, default=256, help="the job's --prefix_cache_mb (0 = off)"),
        p.add_argument("--train_threads", type=int, default=2, help="threads for the untimed phases"),
        p.add_argument("--work_dir", default="/tmp/miles_fn_real_spec"),
        p.add_argument("--model_cache_dir", default=gguf_import.DEFAULT_CACHE_DIR)))
    batches = _ints(args.batches)
    repeats, n_prompts, steps = args.repeats, args.distill_prompts, args.distill_steps
    if args.quick:
        batches, repeats, n_prompts, steps, args.rl_steps, args.new_tokens = [1, 2], 1, 4, 2, 1, 4
        args.plain_past, args.other_k = 1, "1"  # so that batch 2 runs the contender; one other draft length
    torch.set_num_threads(args.train_threads)
    t_setup = time.perf_counter()
    path = gguf_import.resolve_checkpoint(NAME, args.model_cache_dir)
    cfg, early = hf.load_hf(path)
    task = ChatArithTask(launch_data.load_tokenizer(path), 2, 1)  # the job's --task_digits, --task_second_digits
    eos = task.tokenizer.eos_id
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=args.new_tokens, stop_token_ids=(eos,))
    dcfg = draft.random_draft_config(draft.SpeculativeConfig(draft_hidden_size=args.draft_hidden), cfg)
    root = prng.key(0)
    draft_dir = os.path.join(args.work_dir, "frozen_draft")  # reused when distilled with the same settings
    recipe = {"prompts": n_prompts, "steps": steps, "hidden": args.draft_hidden, "new_tokens": args.new_tokens}
    stamp = os.path.join(args.work_dir, "frozen_draft.json")
    if os.path.exists(stamp) and json.load(open(stamp))["recipe"] == recipe:
        frozen_params, distill_accept = hf.load_hf(draft_dir)[1], json.load(open(stamp))["accept"]
    else:
        d0 = train.init_state(model.init_params(dcfg, prng.fold_in(root, 1)), prng.fold_in(root, 2))
        frozen, distill_accept = distill(early, cfg, dcfg, d0, questions(task, n_prompts, 11), prng.fold_in(root, 3),
                                         sampling, 32, steps, 3e-3)
        frozen_params = frozen.params
        os.makedirs(args.work_dir, exist_ok=True)
        hf.save_hf(draft_dir, dcfg, frozen_params)
        with open(stamp, "w") as f:
            json.dump({"recipe": recipe, "accept": distill_accept}, f)
    distill_s = time.perf_counter() - t_setup
    t_job = time.perf_counter()
    out_dir = os.path.join(args.work_dir, "rl")  # reused when the same command and draft ran there to the end
    run_job(out_dir, draft_dir, args)
    job_s = time.perf_counter() - t_job
    state = checkpoint.load(checkpoint.latest(os.path.join(out_dir, "checkpoints"))).tree["state"]
    late, online = state.inner.params, state.draft.params
    k = args.k
    drafts = {"early": {"frozen draft": (frozen_params, 0, k)},
              "late": {"frozen draft": (frozen_params, 0, k), "online draft": (online, 0, k),
                       **{f"online, k={j}": (online, 0, j) for j in _ints(args.other_k) if j != k}}}
    per_step = job_metrics(out_dir)
    torch.set_num_threads(args.threads)

    results, rows = [], []
    prompts_all = questions(task, max(batches + [8]), 23)
    for phase, target in (("early", early), ("late", late)):
        for b in batches:  # batch 1: 8 requests one after another (one sample is too few to time acceptance on)
            groups = [[p] for p in prompts_all[: 2 if args.quick else 8]] if b == 1 else [prompts_all[:b]]
            cands = dict(drafts[phase])
            if phase == "late" and b > args.plain_past:
                cands[f"online, plain past {args.plain_past} rows"] = (online, args.plain_past, k)
            c = cell(target, cfg, cands, dcfg, groups, prng.fold_in(root, 100 + b), sampling, repeats,
                     args.prefix_cache_mb)
            if not c["identical"]:
                raise AssertionError(f"speculative tokens differ from plain decoding ({phase}, batch {b})")
            base, tail = c["seconds"]["no draft"], c["tail"]
            n_rows = len(c["lengths"])
            base_decode = base - c["prefill"]["no draft"]
            for name, sec in c["seconds"].items():
                tpv = c["tokens_per_verify"].get(name)
                decode = sec - c["prefill"][name]
                r = {"phase": phase, "batch": b, "contender": name, "rows": n_rows, "tokens": c["tokens"],
                     "seconds": sec, "tokens_per_s": c["tokens"] / sec, "speedup_vs_no_draft": base / sec,
                     "prefill_seconds": c["prefill"][name],
                     "decode_tokens_per_s": (c["tokens"] - n_rows) / decode if decode > 0 else None,
                     "decode_speedup": base_decode / decode if decode > 0 else None, "tokens_per_verify": tpv,
                     "tail_seconds": tail.get(name),
                     "tail_speedup": tail["no draft"] / tail[name] if tail and tail[name] > 0 else None,
                     "lengths": c["lengths"], "identical_tokens": c["identical"]}
                results.append(r)
                rows.append([phase, b, name, r["tokens_per_s"], r["speedup_vs_no_draft"],
                             "-" if r["decode_speedup"] is None else round(r["decode_speedup"], 2),
                             "-" if tpv is None else round(tpv, 2),
                             "-" if not tail else round(tail[name], 3), c["identical"]])
    table = common.print_table(
        f"Speculative decoding on SmolLM2-135M (k={args.k}), draft h{args.draft_hidden} L1, chat_arith, "
        f"{args.new_tokens} new tokens at most, {args.threads} thread(s)",
        ["policy", "batch", "contender", "tokens/s", "x no draft", "decode x no draft", "tokens/verify", "tail s",
         "same tokens"], rows)
    out = {"machine": common.machine_info(args.threads), "model": NAME, "k": args.k, "draft_hidden": args.draft_hidden,
           "new_tokens": args.new_tokens, "repeats": repeats, "distill_seconds": distill_s, "job_seconds": job_s,
           "distill_expected_accept": distill_accept, "rl_steps": args.rl_steps, "job_per_step": per_step,
           "results": results, "table": table}
    common.write_json(args.out, out)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
