"""Rollout throughput of the embedded engine and of launch.rollout_server over loopback HTTP, side by side.

    python -m bench.rollout_backends [--requests 256] [--batch_size 64] [--max_new_tokens 8]

Same model, requests and chunks for both (so the samples are bitwise equal, which is checked);
the table gives tokens per second and the HTTP/embedded time ratio (serialisation and transport).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

from launch.engines.base import make_requests
from launch.engines.embedded import EmbeddedEngine
from launch.engines.remote import RemoteEngine, ServerProcess, tensor_sync
from miles_fn import model, prng
from miles_fn.config import ModelConfig
from miles_fn.sampling import SamplingConfig
from state import hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--max_new_tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    cfg = ModelConfig(vocab_size=48, hidden_size=128, intermediate_size=384, max_position_embeddings=64)
    params = model.init_params(cfg, prng.key(0), 0.02)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, stop_token_ids=(2,))
    prompts = [[1] + prng.randint(prng.fold_in(prng.key(1), i), (6,), 3, 48).tolist() for i in range(args.requests)]
    reqs = make_requests(prompts, prng.key(2))
    tmp = tempfile.mkdtemp()
    hf.save_hf(tmp, cfg, params)

    def command(port: int, first: bool) -> list[str]:
        return [sys.executable, "-m", "launch.rollout_server", "--model-path", tmp, "--port", str(port),
                "--num-threads", str(args.threads), "--watch-parent"]

    local = EmbeddedEngine(cfg, params, 0, args.batch_size)
    remote = RemoteEngine(cfg, params, 0, process=ServerProcess(command, os.path.join(tmp, "log"), 120, cwd=ROOT),
                          sync=tensor_sync(cfg), batch_size=args.batch_size, max_inflight=4)
    try:
        times = {"embedded": [], "http": []}
        for _ in range(args.repeats):  # interleaved, so machine load hits both alike
            for name, eng in (("embedded", local), ("http", remote)):
                t = time.perf_counter()
                out = eng.generate(reqs, sampling)
                times[name].append(time.perf_counter() - t)
                if name == "embedded":
                    ref = out
                else:
                    assert out == ref, "HTTP samples differ from the embedded engine's"
        t0 = time.perf_counter()
        remote.update_weights(1, params)
        sync_s = time.perf_counter() - t0
    finally:
        remote.close()
    n_tok = sum(len(s.tokens) for s in ref)
    best = {k: min(v) for k, v in times.items()}
    print(f"| backend | best of {args.repeats} (s) | tokens/s | time / embedded |")
    print("| --- | --- | --- | --- |")
    for k in ("embedded", "http"):
        print(f"| {k} | {best[k]:.3f} | {n_tok / best[k]:.0f} | {best[k] / best['embedded']:.2f} |")
    print(f"{args.requests} requests in chunks of {args.batch_size}, {n_tok} tokens; samples bitwise equal; "
          f"one weight sync over HTTP ({sum(p.numel() for p in hf_tensors(cfg, params))} floats): {sync_s:.3f} s")


def hf_tensors(cfg, params):
    return list(hf.named_tensors(cfg, params).values())


if __name__ == "__main__":
    main()
