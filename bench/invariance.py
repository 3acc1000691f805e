"""What true on-policy costs: invariant ops against the fast (reference) ops on the default CPU job's shapes.

    python -m bench.invariance [--reps 5] [--threads 2]

Both modes run side by side in one process, interleaved rep by rep, on the same weights,
prompts and keys: a rollout (prefill + KV-cache decode of prompts_per_step x group_size
requests) and a GRPO train step (forward + backward + AdamW) on the resulting batch.
Prints medians and the invariant/fast ratio (goal: <= 1.3x), and the mismatch each mode leaves.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import ops
from miles_fn import model, optim, prng, train
from miles_fn.config import ModelConfig
from miles_fn.generate import generate
from miles_fn.rollout_buffer import build_rollout_buffer
from miles_fn.sampling import SamplingConfig
from miles_fn.tasks.addition import AdditionTask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--tile_rows", type=int, default=64)
    ap.add_argument("--kv_block", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    task = AdditionTask(digits=2)
    cfg = ModelConfig(vocab_size=task.tokenizer.vocab_size, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
                      max_position_embeddings=64)
    params = model.init_params(cfg, prng.key(0), 0.2)
    pairs = task.sample_pairs(prng.key(1), a.prompts)
    prompts = [task.prompt_ids(*p) for p in pairs for _ in range(a.group)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=task.max_answer_tokens,
                              stop_token_ids=(task.tokenizer.eos_id,))
    modes = {"fast": ops.REFERENCE, "invariant": ops.OpsConfig(mode="invariant", tile_rows=a.tile_rows,
                                                                kv_block=a.kv_block)}
    optim_cfg = optim.OptimConfig(lr=1e-4)
    times: dict[str, dict[str, list[float]]] = {m: {"tok_s": [], "train_s": []} for m in modes}
    mismatch: dict[str, float] = {}
    for rep in range(a.reps + 1):  # rep 0 warms up
        for name, oc in modes.items():
            t0 = time.perf_counter()
            gen = generate(params, cfg, prompts, prng.key(2 + rep), sampling, ops_cfg=oc)
            t1 = time.perf_counter()
            rewards = [task.reward(r, pairs[i // a.group]) for i, r in enumerate(gen.tokens)]
            buf = build_rollout_buffer(prompts, gen.tokens, gen.logprobs, rewards,
                                       [i // a.group for i in range(len(prompts))])
            loss_fn = train.make_grpo_loss(cfg, train.PolicyLossConfig(), oc)
            state = train.init_state(params, prng.key(3))
            t2 = time.perf_counter()
            _, metrics = train.train_step(state, buf, prng.key(4), loss_fn, optim_cfg)
            t3 = time.perf_counter()
            if rep:
                times[name]["tok_s"].append(sum(len(t) for t in gen.tokens) / (t1 - t0))
                times[name]["train_s"].append(t3 - t2)
            mismatch[name] = float(metrics["mismatch_max"])

    med = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in times.items()}
    print(f"model hidden={a.hidden} layers={cfg.num_layers}; {len(prompts)} requests x <= {sampling.max_new_tokens} "
          f"new tokens; {a.threads} threads; median of {a.reps} interleaved reps\n")
    print("| measure | fast | invariant | cost (invariant / fast) |")
    print("| --- | --- | --- | --- |")
    f, i = med["fast"], med["invariant"]
    print(f"| rollout tokens/s | {f['tok_s']:.0f} | {i['tok_s']:.0f} | {f['tok_s'] / i['tok_s']:.2f}x |")
    print(f"| train step (s) | {f['train_s']:.3f} | {i['train_s']:.3f} | {i['train_s'] / f['train_s']:.2f}x |")
    print(f"| max train/inference mismatch | {mismatch['fast']:.2e} | {mismatch['invariant']:.1e} | |")


if __name__ == "__main__":
    main()
