"""Time of one weight update to launch.rollout_server by each --rollout_weight_sync, side by side.

    python -m bench.weight_sync [--hidden_size 512] [--layers 4] [--repeats 5]

One server, one model; per method the median of --repeats updates (the distributed group is formed
once, before timing, as a run forms it once). After each method the server's samples are checked
against the in-process engine with the same weights, so a method that lost a tensor fails here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from launch.engines.base import make_requests
from launch.engines.embedded import EmbeddedEngine
from launch.engines.remote import ServerProcess, disk_sync, tensor_sync
from launch.engines.sglang_client import SGLangClient
from launch.engines.weight_group import DistributedSync
from miles_fn import model, prng
from miles_fn.config import ModelConfig
from miles_fn.sampling import SamplingConfig
from state import hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden_size", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=1024, hidden_size=args.hidden_size, intermediate_size=3 * args.hidden_size,
                      num_layers=args.layers, max_position_embeddings=64)
    tmp = tempfile.mkdtemp()
    hf.save_hf(os.path.join(tmp, "init"), cfg, model.init_params(cfg, prng.key(0), 0.02))
    proc = ServerProcess(lambda port, first: [sys.executable, "-m", "launch.rollout_server", "--model-path",
                                              os.path.join(tmp, "init"), "--port", str(port), "--watch-parent"],
                         os.path.join(tmp, "log"), 120, cwd=ROOT)
    client = SGLangClient(proc.start(), timeout_s=600)
    reqs = make_requests([[1, 5, 9, 3]] * 4, prng.key(3))
    sampling = SamplingConfig(max_new_tokens=4)
    dist = DistributedSync(cfg, timeout_s=120)
    methods = {"tensor": tensor_sync(cfg), "disk": disk_sync(cfg, os.path.join(tmp, "w")), "distributed": dist}
    os.makedirs(os.path.join(tmp, "w"))
    version = 0
    rows = []
    try:
        dist(client, version, model.init_params(cfg, prng.key(0), 0.02))  # forms the group
        for name, sync in methods.items():
            times = []
            for _ in range(args.repeats):
                version += 1
                params = model.init_params(cfg, prng.key(version), 0.02)
                t = time.perf_counter()
                sync(client, version, params)
                times.append(time.perf_counter() - t)
            assert client.weight_version() == version
            got = client.generate_chunk(reqs, sampling)
            assert got == EmbeddedEngine(cfg, params, version).generate(reqs, sampling), f"{name}: wrong weights"
            rows.append((name, statistics.median(times)))
    finally:
        dist.reset(client)
        client.close()
        proc.stop()
    floats = sum(t.numel() for t in hf.named_tensors(cfg, params).values())
    lines = [f"| --rollout_weight_sync | s per update (median of {args.repeats}) | MB/s |", "| --- | --- | --- |"]
    lines += [f"| {n} | {s:.3f} | {floats * 4 / s / 1e6:.0f} |" for n, s in rows]
    lines.append(f"{floats / 1e6:.1f} M float32 weights, one CPU server on 127.0.0.1; samples checked after each")
    out = "\n".join(lines)
    print(out)
    return out


if __name__ == "__main__":
    main()
