"""Speculative decoding: rollout tokens/s with no draft, a frozen draft and an online-trained draft, side by side.

The target is a random-init Qwen2 of hidden 512 x 4 layers (about 15 M parameters, float32: its decode step
reads its weights, ~60 MB, so it is weight-bound at batch 1 on this CPU), trained briefly by SFT on a
synthetic next-token rule ("early" policy), then fine-tuned on a changed rule ("late" policy: the drift an
RL run causes). The draft is a 1-layer hidden-64 LM of the same vocabulary, distilled (miles_fn.draft, soft
cross-entropy) on the early policy's rollouts; "frozen" keeps it, "online" continues the same training on the
late policy's rollouts, as --draft_train_steps does after each RL update. This is a synthetic drift, not the
checkpoints of a real RL run (docs/speculative-decoding.md says what that would take).

Each (policy, batch) cell times the contenders alternating, repeat after repeat, on the same prompts and keys,
and checks that every contender's tokens are the plain engine's (the lossless rule). The plain engine runs as
the job does (decode_backend=auto: its one-token steps in the C kernel where it builds) and on its torch path;
speculation runs as the job does too (the draft's steps and the k+1-token verify in the C kernel's block steps),
and the online draft once more on the torch forward. The CPU is shared, so compare the ratios of interleaved
runs rather than absolute tokens/s.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

import ops
from bench import common
from miles_fn import draft, model, prng, train
from miles_fn.batching import pack_right_padded
from miles_fn.config import ModelConfig
from miles_fn.generate import generate
from miles_fn.optim import OptimConfig
from miles_fn.rollout_buffer import build_rollout_buffer
from miles_fn.sampling import SamplingConfig
from miles_fn.speculative import SpecStats, generate_speculative
from state.train_state import RolloutBuffer

VOCAB = 64
JOB_OPS = ops.OpsConfig(decode_backend="auto")
TORCH_OPS = ops.OpsConfig(decode_backend="torch")


def rule_next(prev: int, late: bool) -> int:
    """The synthetic language: count up by 1; the late policy counts up by 3 after an odd token (half the
    contexts change, as an RL run changes some answers and not others)."""
    return (prev + (3 if late and prev % 2 else 1)) % VOCAB


def sequences(key: prng.Key, n: int, length: int, late: bool, noise: float = 0.1) -> list[list[int]]:
    starts = prng.randint(prng.fold_in(key, 0), (n,), 0, VOCAB).tolist()
    flips = prng.uniform(prng.fold_in(key, 1), (n, length)).tolist()
    rand = prng.randint(prng.fold_in(key, 2), (n, length), 0, VOCAB).tolist()
    out = []
    for i in range(n):
        s = [starts[i]]
        for t in range(1, length):
            s.append(rand[i][t] if flips[i][t] < noise else rule_next(s[-1], late))
        out.append(s)
    return out


def sft_batch(seqs: list[list[int]], prompt_len: int) -> RolloutBuffer:
    tokens, positions, seg, mask = pack_right_padded([s[:prompt_len] for s in seqs], [s[prompt_len:] for s in seqs])
    z = torch.zeros_like(mask)
    n = len(seqs)
    return RolloutBuffer(tokens, positions, seg, mask, z, z, torch.zeros(n), torch.zeros(n, dtype=torch.int64))


def train_target(state: Any, cfg: ModelConfig, steps: int, late: bool, key: prng.Key, batch: int, length: int
                 ) -> Any:
    loss_fn = train.make_sft_loss(cfg)
    opt = OptimConfig(lr=2e-3, max_grad_norm=1.0)
    for s in range(steps):
        k = prng.fold_in(key, s)
        state, _ = train.train_step(state, sft_batch(sequences(k, batch, length, late), 2), k, loss_fn, opt)
    return state


def rollouts(params: Any, cfg: ModelConfig, prompts: list[list[int]], key: prng.Key, sampling: SamplingConfig
             ) -> RolloutBuffer:
    gen = generate(params, cfg, prompts, key, sampling, ops_cfg=JOB_OPS)
    return build_rollout_buffer(prompts, gen.tokens, gen.logprobs, [0.0] * len(prompts), list(range(len(prompts))))


def time_cell(contenders: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Each contender `repeats` times, alternating; median seconds, tokens, spec stats, identical-token check."""
    secs: dict[str, list[float]] = {n: [] for n in contenders}
    toks: dict[str, Any] = {}
    stats: dict[str, SpecStats] = {}
    for _ in range(repeats):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            gen, st = fn()
            secs[name].append(time.perf_counter() - t0)
            toks[name] = gen.tokens
            if st is not None:
                stats[name] = st
    ref = toks["no draft (job: C kernel)"]
    return {"seconds": {n: common.median(v) for n, v in secs.items()}, "tokens": sum(len(t) for t in ref),
            "identical": all(t == ref for t in toks.values()), "stats": stats}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = common.parse_args("spec_decode", __doc__.splitlines()[0], argv, lambda p: (
        p.add_argument("--batches", default="1,8,32", help="comma-separated rollout batch sizes"),
        p.add_argument("--k", type=int, default=3, help="--speculative_num_steps"),
        p.add_argument("--repeats", type=int, default=3),
        p.add_argument("--train_threads", type=int, default=2, help="threads for the (untimed) training phases")))
    quick = args.quick
    hidden, layers = (64, 1) if quick else (512, 4)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden, num_layers=layers,
                      num_heads=max(1, hidden // 64), num_kv_heads=max(1, hidden // 128), max_position_embeddings=256)
    dcfg = draft.random_draft_config(draft.SpeculativeConfig(draft_hidden_size=64, draft_num_layers=1), cfg)
    new_tokens = 8 if quick else 48
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens)
    batches = [1, 2] if quick else [int(b) for b in args.batches.split(",")]
    sft_steps, drift_steps, draft_steps = (2, 2, 2) if quick else (60, 60, 60)
    repeats = 1 if quick else args.repeats

    torch.set_num_threads(args.train_threads)
    t_setup = time.perf_counter()
    root = prng.key(0)
    state = train.init_state(model.init_params(cfg, prng.fold_in(root, 1)), root)
    early = train_target(state, cfg, sft_steps, False, prng.fold_in(root, 2), 16, 40)
    late = train_target(early, cfg, drift_steps, True, prng.fold_in(root, 3), 16, 40)
    prompts_all = [s[:2] for s in sequences(prng.fold_in(root, 4), max(batches), 2, False)]
    train_prompts = [s[:2] for s in sequences(prng.fold_in(root, 5), 32, 2, False)]
    d_opt = OptimConfig(lr=3e-3, max_grad_norm=1.0)
    d0 = train.init_state(model.init_params(dcfg, prng.fold_in(root, 6)), prng.fold_in(root, 7))
    frozen, m0 = draft.draft_update(d0, early.params, cfg, dcfg,
                                    rollouts(early.params, cfg, train_prompts, prng.fold_in(root, 8), sampling),
                                    prng.fold_in(root, 9), d_opt, draft_steps)
    online, m1 = draft.draft_update(frozen, late.params, cfg, dcfg,
                                    rollouts(late.params, cfg, train_prompts, prng.fold_in(root, 10), sampling),
                                    prng.fold_in(root, 11), d_opt, draft_steps)
    setup_s = time.perf_counter() - t_setup
    torch.set_num_threads(args.threads)

    results = []
    rows = []
    for phase, target in (("early", early.params), ("late", late.params)):
        for b in batches:
            prompts, key = prompts_all[:b], prng.fold_in(root, 100 + b)
            contenders = {
                "no draft (job: C kernel)": lambda p=prompts, k=key, t=target: (
                    generate(t, cfg, p, k, sampling, ops_cfg=JOB_OPS), None),
                "no draft (torch)": lambda p=prompts, k=key, t=target: (
                    generate(t, cfg, p, k, sampling, ops_cfg=TORCH_OPS), None),
                "frozen draft": lambda p=prompts, k=key, t=target: generate_speculative(
                    t, cfg, frozen.params, dcfg, p, k, sampling, args.k, ops_cfg=JOB_OPS),
            }
            if phase == "late":
                contenders["online draft"] = lambda p=prompts, k=key, t=target: generate_speculative(
                    t, cfg, online.params, dcfg, p, k, sampling, args.k, ops_cfg=JOB_OPS)
                contenders["online draft (torch)"] = lambda p=prompts, k=key, t=target: generate_speculative(
                    t, cfg, online.params, dcfg, p, k, sampling, args.k, ops_cfg=TORCH_OPS,
                    draft_ops_cfg=TORCH_OPS)
            cell = time_cell(contenders, repeats)
            base = cell["seconds"]["no draft (job: C kernel)"]
            for name, s in cell["seconds"].items():
                st = cell["stats"].get(name)
                r = {"phase": phase, "batch": b, "contender": name, "tokens_per_s": cell["tokens"] / s,
                     "speedup_vs_job": base / s, "tokens_per_verify": st.tokens_per_verify if st else None,
                     "accept_rate": st.accept_rate if st else None, "identical_tokens": cell["identical"]}
                results.append(r)
                rows.append([phase, b, name, r["tokens_per_s"], r["speedup_vs_job"],
                             "-" if st is None else round(st.tokens_per_verify, 2), cell["identical"]])
            if not cell["identical"]:
                raise AssertionError(f"speculative tokens differ from plain decoding ({phase}, batch {b})")
    table = common.print_table(
        f"Speculative decoding (k={args.k}), target h{hidden} L{layers}, draft h64 L1, {new_tokens} new tokens, "
        f"{args.threads} thread(s)",
        ["policy", "batch", "contender", "tokens/s", "x job's plain decode", "tokens/verify", "same tokens"], rows)
    out = {"machine": common.machine_info(args.threads), "k": args.k, "target": {"hidden": hidden, "layers": layers},
           "new_tokens": new_tokens, "repeats": repeats, "setup_seconds": setup_s,
           "draft_distill": {"frozen_expected_accept_before": float(m0["draft_expected_accept"]),
                             "online_expected_accept_before": float(m1["draft_expected_accept"])},
           "results": results, "table": table}
    common.write_json(args.out, out)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
