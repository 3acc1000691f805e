"""Real SGLang on a lent GPU: start it, roll out, sync weights, and compare its log-probs to the trainer's.

    python -m bench.sglang_check [--model_path DIR] [--steps 3] [--out result.json]

Without --model_path a small random Qwen2 checkpoint is written (no download; ids in and out, so no
tokenizer). Each step: one batch through SGLang's /generate, the trainer's teacher-forced log-probs
of the same tokens (miles_fn.model on the GPU, float32), the mismatch |engine - trainer| per token,
then perturbed weights pushed with /update_weights_from_disk under the next version. Reports the
mismatch, tokens per second, and the weight version every sample carried. Exits 1 when a step's
samples do not all carry that step's weight version or the mean mismatch exceeds --max_mismatch
(weights that did not arrive show up as both); 0 with a "skip" line when CUDA or sglang is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch

import third_party


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model_path", default="")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--true_on_policy", action="store_true")
    ap.add_argument("--max_mismatch", type=float, default=0.05,
                    help="fail above this mean |engine - trainer| log-prob (SGLang's kernels are not ops.*)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not third_party.cuda_available():
        print("skip: no CUDA device")
        return 0
    if not third_party.available("sglang"):
        print("skip: sglang is not installed (pip install 'miles-fn[gpu]')")
        return 0

    import ops
    from launch.engines.base import make_requests
    from launch.engines.config import RolloutConfig
    from launch.engines.sglang_backend import make_sglang_engine
    from miles_fn import model, prng
    from miles_fn.config import ModelConfig
    from miles_fn.sampling import SamplingConfig
    from state import hf

    work = tempfile.mkdtemp(prefix="sglang_check_")
    if args.model_path:
        cfg, params = hf.load_hf(args.model_path)
    else:
        cfg = ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
                          num_kv_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)
        params = model.init_params(cfg, prng.key(0), 0.05)
    rcfg = RolloutConfig(backend="sglang", max_inflight=16, batch_size=16, true_on_policy=args.true_on_policy,
                         start_timeout_s=600, mem_fraction_static=0.5)
    t0 = time.time()
    engine = make_sglang_engine(rcfg, cfg, params, work, version=0)
    startup = time.time() - t0
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens)
    gpu = params
    ops_cfg = ops.INVARIANT if args.true_on_policy else ops.REFERENCE  # the trainer's kernels of such a run
    rows = []
    try:
        for step in range(args.steps):
            key = prng.fold_in(prng.key(1), step)
            prompts = [prng.randint(prng.fold_in(key, i), (8 + i % 8,), 3, cfg.vocab_size).tolist()
                       for i in range(args.prompts)]
            t = time.time()
            samples = engine.generate(make_requests(prompts, key), sampling)
            dt = time.time() - t
            n_tok = sum(len(s.tokens) for s in samples)
            diffs = []
            dev_params = _to(gpu, "cuda")
            with torch.no_grad():
                for p, s in zip(prompts, samples, strict=True):
                    toks = torch.tensor([p + s.tokens], device="cuda")
                    n = toks.shape[1]
                    lp = model.sequence_logprobs(dev_params, cfg, toks, torch.arange(n, device="cuda")[None],
                                                 torch.ones(1, n, dtype=torch.int64, device="cuda"),
                                                 ops_cfg=ops_cfg)[0, len(p) - 1 :]
                    diffs.append((lp.cpu() - torch.tensor(s.logprobs)).abs())
            d = torch.cat(diffs)
            rows.append({"step": step, "weight_version": sorted({s.weight_version for s in samples}),
                         "tokens": n_tok, "tokens_per_s": n_tok / dt, "logprob_abs_diff_mean": float(d.mean()),
                         "logprob_abs_diff_max": float(d.max())})
            print(json.dumps(rows[-1]), flush=True)
            # A stand-in for a train step: perturb every weight, then sync under the next version.
            gpu = _perturbed(gpu, prng.fold_in(key, 99))
            engine.update_weights(step + 1, gpu)
    finally:
        engine.close()
    result = {"startup_s": startup, "steps": rows, "true_on_policy": args.true_on_policy}
    print(f"startup {startup:.1f} s; mean |engine - trainer| log-prob per step: "
          + ", ".join(f"{r['logprob_abs_diff_mean']:.2e}" for r in rows)
          + "; tokens/s: " + ", ".join(f"{r['tokens_per_s']:.0f}" for r in rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    bad = [r["step"] for r in rows
           if r["weight_version"] != [r["step"]] or r["logprob_abs_diff_mean"] > args.max_mismatch]
    if bad:
        print(f"FAIL: steps {bad} carry another weight version or a mean mismatch above {args.max_mismatch}")
        return 1
    return 0


def _to(params, device):
    from state.tree import tree_map

    return tree_map(lambda x: x.to(device), params)


def _perturbed(params, key):
    from miles_fn import prng
    from state.tree import tree_flatten_with_path, tree_map

    _, leaves, _ = tree_flatten_with_path(params)
    noise = iter([0.01 * prng.normal(prng.fold_in(key, i), tuple(x.shape)) for i, x in enumerate(leaves)])
    return tree_map(lambda x: x + next(noise).to(x.dtype), params)


if __name__ == "__main__":
    sys.exit(main())
