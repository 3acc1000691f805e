"""Packed against padded training throughput, and peak memory against the token budget, in one run.

    python -m bench.packing            # ~1-2 minutes on one CPU thread
    python -m bench.packing --fixed_order   # --true_on_policy's gradient tiles against plain micro-batches

A length-skewed batch (lengths log-uniform from 8 to 512, as RL responses are: many short, a
few long), a tiny Qwen2-style model, and one GRPO gradient pass over the whole batch in
micro-batches of a fixed token budget (train.accumulate_gradients):
  padded  one sample a row, every row as wide as the longest sample (packing.pad)
  packed  first-fit-decreasing into rows of the longest sample's length (packing.pack)
Throughput counts real tokens (not padding) per second; the goal is packed >= 2x padded.

Peak memory (CPU, in a child process): the rise of the peak resident set (VmHWM, reset by writing
5 to /proc/self/clear_refs) over the resident set just before one micro-batch's gradient, with
glibc's mmap threshold pinned at 64 KiB so freed tensors go back to the OS at once. It is RSS, so
it includes allocator overhead. Three ways to the gradient: torch.func.grad, plain autograd, and
plain autograd with --recompute; est is miles_fn.memory's estimate without and with recompute.

--fixed_order: the invariant ops (--true_on_policy) on the skewed batch and on a default-job-like
batch (512 samples of 9 to 12 tokens), one gradient pass: plain micro-batches of a budget against
fixed gradient tiles (launch.memory.gradient_tiles' layout, train.accumulate_gradients with
fixed_order=True), with whether the gradient's bits equal those of the budget that holds the batch.
"""

from __future__ import annotations

import ctypes
import math
import statistics
import subprocess
import sys
import time

import torch

import ops
from miles_fn import memory, model, packing, prng, train
from miles_fn.config import ModelConfig
from state.train_state import RolloutBuffer
from state.tree import tree_leaves

CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
N, MIN_LEN, MAX_LEN = 64, 8, 512
SPEED_BUDGET = 2048
MEMORY_BUDGETS = (512, 1024, 2048, 4096)


def skewed_batch(seed: int = 0) -> RolloutBuffer:
    """N samples, log-uniform lengths in [MIN_LEN, MAX_LEN] (the longest forced to MAX_LEN), prompt of 4 tokens."""
    key = prng.key(seed)
    u = prng.uniform(prng.fold_in(key, 0), (N,), torch.float64)
    lengths = torch.exp(math.log(MIN_LEN) + u * (math.log(MAX_LEN) - math.log(MIN_LEN))).long().clamp(MIN_LEN, MAX_LEN)
    lengths[0] = MAX_LEN
    t = int(lengths.max())
    tokens = (prng.uniform(prng.fold_in(key, 1), (N, t), torch.float64) * (CFG.vocab_size - 1)).long() + 1
    seg = (torch.arange(t)[None, :] < lengths[:, None]).long()
    tokens = tokens * seg
    positions = torch.clamp(torch.cumsum(seg, -1) - 1, min=0)
    cols = torch.arange(t - 1)[None, :]
    mask = ((cols >= 3) & (cols < lengths[:, None] - 1)).float()
    adv = (prng.normal(prng.fold_in(key, 2), (N,), torch.float64).float())[:, None] * mask
    old = -3.0 * prng.uniform(prng.fold_in(key, 3), (N, t - 1), torch.float64).float() * mask
    return RolloutBuffer(tokens, positions, seg, mask, old, adv, torch.zeros(N), torch.arange(N) // 8)


def time_grad(params, micro_batches, loss_fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        train.accumulate_gradients(params, micro_batches, prng.key(0), loss_fn)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_rise(fn) -> int:
    """Bytes the peak RSS rises above the RSS at the start of fn()."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS")
    fn()
    return _status("VmHWM") - base


def speed() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    params = model.init_params(CFG, prng.key(1))
    buf = skewed_batch()
    lengths = packing.sample_lengths(buf.segment_ids)
    real = sum(lengths)
    loss_fn = train.make_grpo_loss(CFG, train.PolicyLossConfig())
    print(f"batch: {N} samples, lengths {min(lengths)}..{max(lengths)} (mean {real / N:.0f}), {real} tokens; "
          f"model hidden {CFG.hidden_size}, {CFG.num_layers} layers, 1 thread; {SPEED_BUDGET} tokens a micro-batch")
    padded = packing.pad(buf, SPEED_BUDGET)
    packed = packing.pack(buf, SPEED_BUDGET)
    time_grad(params, packed[:1], loss_fn, 1)  # warm-up
    rows = []
    for name, mbs in (("padded", padded), ("packed", packed)):
        tokens = sum(mb.tokens.numel() for mb in mbs)
        secs = time_grad(params, mbs, loss_fn, reps=3)
        rows.append((name, len(mbs), tokens, real / tokens, secs, real / secs))
    print("\n| layout | micro-batches | padded tokens | real/padded | seconds/step | real tokens/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, n, tokens, eff, secs, tps in rows:
        print(f"| {name} | {n} | {tokens} | {eff:.2f} | {secs:.3f} | {tps:.0f} |")
    print(f"\npacked / padded throughput: {rows[1][5] / rows[0][5]:.2f}x (goal >= 2x)")


def peak_memory() -> None:
    """Run in a fresh process: glibc's mmap threshold is pinned before anything large is allocated."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: freed tensors leave the RSS at once
    torch.set_num_threads(1)
    params = model.init_params(CFG, prng.key(1))
    buf = skewed_batch()
    remat = ModelConfig(**{**CFG.__dict__, "recompute": True})
    ways = (("torch.func.grad", CFG, False), ("autograd", CFG, True), ("autograd+recompute", remat, True))
    print("\nPeak memory of one packed micro-batch's gradient (CPU: rise of peak RSS, MiB; est = miles_fn.memory):")
    print("| budget (tokens) | rows x width | " + " | ".join(w for w, _, _ in ways) + " | est | est recompute |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for budget in MEMORY_BUDGETS:
        mb = max(packing.pack(buf, budget, MAX_LEN), key=lambda b: b.tokens.numel())
        cells = []
        for _, cfg, use_autograd in ways:
            fn = train.make_grpo_loss(cfg, train.PolicyLossConfig())
            step = lambda fn=fn, a=use_autograd, mb=mb: train.loss_and_grad(params, mb, prng.key(0), fn, a)
            step()  # warm-up at this shape
            cells.append(peak_rise(step) / 2**20)
        width = mb.tokens.shape[1]
        for rc in (False, True):
            cells.append(memory.activation_bytes_per_token(CFG, width, rc) * mb.tokens.numel() / 2**20)
        r, w = mb.tokens.shape
        print(f"| {budget} | {r} x {w} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


def short_batch(n: int = 512, seed: int = 0) -> RolloutBuffer:
    """n samples of 9 to 12 tokens (the default job's 2-digit additions: 7-token prompt, 2-5 token answer)."""
    key = prng.key(seed)
    lengths = 9 + (prng.uniform(prng.fold_in(key, 0), (n,), torch.float64) * 4).long()
    t = 12
    tokens = (prng.uniform(prng.fold_in(key, 1), (n, t), torch.float64) * (CFG.vocab_size - 1)).long() + 1
    seg = (torch.arange(t)[None, :] < lengths[:, None]).long()
    positions = torch.clamp(torch.cumsum(seg, -1) - 1, min=0)
    cols = torch.arange(t - 1)[None, :]
    mask = ((cols >= 6) & (cols < lengths[:, None] - 1)).float()
    adv = (prng.normal(prng.fold_in(key, 2), (n,), torch.float64).float())[:, None] * mask
    old = -3.0 * prng.uniform(prng.fold_in(key, 3), (n, t - 1), torch.float64).float() * mask
    return RolloutBuffer(tokens * seg, positions, seg, mask, old, adv, torch.zeros(n), torch.arange(n) // 8)


def fixed_order(reps: int = 3) -> None:
    """Seconds per gradient pass, plain micro-batches vs fixed tiles, and each against the one-micro-batch gradient."""
    torch.set_num_threads(1)
    params = model.init_params(CFG, prng.key(1))
    loss_fn = train.make_grpo_loss(CFG, train.PolicyLossConfig(), ops.INVARIANT)
    print("\nInvariant ops, one GRPO gradient pass, 1 thread (median of 3); diff = max |g - g_whole| / max |g_whole|"
          " against the whole batch in one plain micro-batch")
    print("| batch | layout | micro-batches | seconds | bitwise = whole | diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, buf in (("skewed 64 x 8..512", skewed_batch()), ("short 512 x 9..12", short_batch())):
        lengths = packing.sample_lengths(buf.segment_ids)
        whole = 2 * sum(lengths)
        layouts = [(f"plain, budget {b}", packing.pack(buf, b), False) for b in (whole, 2048, 1024)]
        layouts += [(f"tiles of {t}, any budget >= {t}", packing.pack(buf, t, max(lengths)), True)
                    for t in (2048, 512)]
        ref = None
        for label, mbs, tiled in layouts:
            times, g = [], None
            for _ in range(reps):
                t0 = time.perf_counter()
                g = train.accumulate_gradients(params, mbs, prng.key(0), loss_fn, fixed_order=tiled)[0]
                times.append(time.perf_counter() - t0)
            leaves = tree_leaves(g)
            ref = leaves if ref is None else ref
            same = all(torch.equal(x, y) for x, y in zip(leaves, ref, strict=True))
            diff = max(float((x - y).abs().max()) / float(y.abs().max()) for x, y in zip(leaves, ref, strict=True))
            print(f"| {name} | {label} | {len(mbs)} | {statistics.median(times):.3f} | {'yes' if same else 'no'} | "
                  f"{diff:.1e} |")
        sys.stdout.flush()


def main() -> None:
    if "--fixed_order" in sys.argv:
        fixed_order()
        return
    if "--memory" in sys.argv:
        peak_memory()
        return
    speed()
    sys.stdout.flush()
    subprocess.run([sys.executable, "-m", "bench.packing", "--memory"], check=True)


if __name__ == "__main__":
    main()
