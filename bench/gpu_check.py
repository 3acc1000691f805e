"""One script for a lent GPU: every GPU path against the reference, the invariant property, and timings.

    python -m bench.gpu_check [--hidden 1024 --layers 4 --batch 16 --prompt 96 --new 32]

For each path (torch reference, torch invariant, flash_attn, flash_attn_3, deep_gemm, torch.compile):
  rel_err    ||logits - logits_ref|| / ||logits_ref||, logits_ref = float32 reference kernels
  invariant  max |engine log-prob - trainer log-prob| for the same tokens, where the engine decodes
             with a KV cache in a batch of 1 and of `batch` mixed-length requests and the trainer
             scores the full, right-padded sequences (0 = bitwise invariant)
  fwd_ms     trainer forward on the padded batch;  decode_ms  one KV-cache decode step of the batch
Paths whose package is missing are reported as skipped. Not part of CI; without CUDA it exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

import ops
import third_party
from miles_fn import model, prng
from miles_fn.config import ModelConfig


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, reps: int = 5) -> float:
    fn()
    _sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync()
    return (time.perf_counter() - t) / reps * 1e3


@torch.no_grad()
def greedy_decode(params, cfg, prompts, n_new, oc):
    """The engine's KV-cache path (left padding, prefill, one token per step), greedy, on params' device."""
    dev = params["embed"].device
    b, lp = len(prompts), max(len(p) for p in prompts)
    total = lp + n_new
    tok = torch.zeros(b, lp, dtype=torch.int64, device=dev)
    valid = torch.ones(b, total, dtype=torch.bool, device=dev)
    for i, p in enumerate(prompts):
        tok[i, lp - len(p):] = torch.tensor(p, device=dev)
        valid[i, : lp - len(p)] = False
    pad = (~valid[:, :lp]).sum(-1, keepdim=True)
    pos = torch.clamp(torch.arange(lp, device=dev)[None] - pad, min=0)
    cache = [tuple(t.to(dev) for t in kv) for kv in model.new_kv_cache(cfg, b, total, params["embed"].dtype)]
    causal = torch.tril(torch.ones(lp, lp, dtype=torch.bool, device=dev))
    mask = (causal[None] & valid[:, None, :lp]) | torch.eye(lp, dtype=torch.bool, device=dev)[None]
    logits = model.forward(params, cfg, tok, pos, mask, cache, 0, ops_cfg=oc)[:, -1]
    out, lps = [], []
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    for t in range(n_new):
        nxt = logits.argmax(-1)
        out.append(nxt)
        lps.append(ops.token_logprobs(logits, nxt, 1.0, oc))
        if t == n_new - 1:
            break
        col = lp + t
        logits = model.forward(params, cfg, nxt[:, None], (lens + t)[:, None], valid[:, None, : col + 1], cache, col,
                               ops_cfg=oc)[:, -1]
    return torch.stack(out, 1), torch.stack(lps, 1), (cache, valid, lens, lp)


def trainer_logprobs(params, cfg, prompts, responses, oc):
    dev = params["embed"].device
    seqs = [list(p) + r for p, r in zip(prompts, responses, strict=True)]
    t = max(len(s) for s in seqs)
    tok = torch.zeros(len(seqs), t, dtype=torch.int64, device=dev)
    seg = torch.zeros(len(seqs), t, dtype=torch.int64, device=dev)
    for i, s in enumerate(seqs):
        tok[i, : len(s)] = torch.tensor(s, device=dev)
        seg[i, : len(s)] = 1
    pos = torch.clamp(torch.cumsum(seg, -1) - 1, min=0)
    with torch.no_grad():
        lp = model.sequence_logprobs(params, cfg, tok, pos, seg, 1.0, ops_cfg=oc)
        logits = model.forward(params, cfg, tok, pos, model.causal_segment_mask(seg), ops_cfg=oc)
    return [lp[i, len(p) - 1 : len(p) - 1 + len(r)] for i, (p, r) in enumerate(zip(prompts, responses,
                                                                                        strict=True))], logits, seg


def check(name, params, cfg, prompts, n_new, oc, ref_logits):
    toks, eng, _ = greedy_decode(params, cfg, prompts, n_new, oc)
    alone_tok, alone_lp, _ = greedy_decode(params, cfg, prompts[:1], n_new, oc)
    responses = [r.tolist() for r in toks]
    train_lp, logits, seg = trainer_logprobs(params, cfg, prompts, responses, oc)
    inv = max(float((train_lp[i] - eng[i]).abs().max()) for i in range(len(prompts)))
    if alone_tok[0].tolist() == responses[0]:
        inv = max(inv, float((alone_lp[0] - eng[0]).abs().max()))
    valid = seg.bool()
    rel = float((logits.float() - ref_logits)[valid].norm() / ref_logits[valid].norm())
    dev = params["embed"].device
    seqs = torch.zeros_like(seg)
    fwd_ms = _timed(lambda: model.forward(params, cfg, seqs, torch.cumsum(seg, -1) - 1, model.causal_segment_mask(seg),
                                          ops_cfg=oc))
    step_tok = torch.zeros(len(prompts), 1, dtype=torch.int64, device=dev)
    step_mask = torch.ones(len(prompts), 1, seg.shape[1], dtype=torch.bool, device=dev)
    step_pos = torch.full((len(prompts), 1), seg.shape[1] - 1, device=dev)
    cache = [tuple(t.to(dev) for t in kv) for kv in model.new_kv_cache(cfg, len(prompts), seg.shape[1],
                                                                        params["embed"].dtype)]
    dec_ms = _timed(lambda: model.forward(params, cfg, step_tok, step_pos, step_mask, cache, seg.shape[1] - 1,
                                          ops_cfg=oc))
    print(f"| {name} | {rel:.2e} | {inv:.2e} | {fwd_ms:.2f} | {dec_ms:.2f} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv_heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=96)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--cpu_dry_run", action="store_true", help="run the script's logic on CPU (torch paths only)")
    a = ap.parse_args()
    dev = "cpu" if a.cpu_dry_run else "cuda"
    if not a.cpu_dry_run and not third_party.cuda_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to check")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden, num_layers=a.layers,
                      num_heads=a.heads, num_kv_heads=a.kv_heads, max_position_embeddings=a.prompt + a.new + 8)
    params = model.init_params(cfg, prng.key(0), 0.05)
    params = {k: ([{n: t.to(dev) for n, t in layer.items()} for layer in v] if k == "layers" else v.to(dev))
              for k, v in params.items()}
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(a.prompt // 4, a.prompt + 1, (a.batch,), generator=g).tolist()
    prompts = [torch.randint(1, a.vocab, (n,), generator=g).tolist() for n in lens]
    toks, _, _ = greedy_decode(params, cfg, prompts, a.new, ops.REFERENCE)
    _, ref_logits, _ = trainer_logprobs(params, cfg, prompts, [r.tolist() for r in toks], ops.REFERENCE)
    ref_logits = ref_logits.float()
    where = torch.cuda.get_device_name() if dev == "cuda" else "CPU dry run"
    print(f"{where}; hidden={a.hidden} layers={a.layers} heads={a.heads}/{a.kv_heads}; "
          f"batch {a.batch}, prompts {min(lens)}-{max(lens)} tokens, {a.new} new\n")
    print("| path | rel_err vs reference | invariant (max abs lp diff) | fwd_ms | decode_ms |")
    print("| --- | --- | --- | --- | --- |")
    inv = ops.INVARIANT
    paths = [("torch reference", ops.REFERENCE, None), ("torch invariant", inv, None),
             ("flash_attn (FA2 varlen)", dataclasses.replace(ops.REFERENCE, attention_backend="flash_attn"),
              "flash_attn"),
             ("flash_attn invariant", dataclasses.replace(inv, attention_backend="flash_attn"), "flash_attn"),
             ("flash_attn_3 varlen", dataclasses.replace(ops.REFERENCE, attention_backend="flash_attn_3"),
              "flash_attn_3"),
             ("flash_attn_3 invariant (num_splits=1)", dataclasses.replace(inv, attention_backend="flash_attn_3"),
              "flash_attn_3"),
             ("deep_gemm fp8", dataclasses.replace(ops.REFERENCE, gemm_backend="deep_gemm"), "deep_gemm"),
             ("torch.compile reference", dataclasses.replace(ops.REFERENCE, compile=True),
              "compile" if a.cpu_dry_run else None)]
    for name, oc, pkg in paths:
        if pkg is not None and (a.cpu_dry_run or not third_party.available(pkg)):
            print(f"| {name} | skipped: {pkg!r} not available here | | | |", flush=True)
            continue
        try:
            check(name, params, cfg, prompts, a.new, oc, ref_logits)
        except Exception as e:  # report and continue: one broken path must not hide the others
            print(f"| {name} | error: {type(e).__name__}: {str(e)[:120]} | | | |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
