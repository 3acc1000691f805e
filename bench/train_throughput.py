"""Training throughput against the machine's limit: forward+backward tokens/s and the fraction
of the float32 matmul peak, both measured in the same run.

Model FLOPs (the usual accounting): forward = 2 * (matmul parameters, lm_head included) per token
+ 4 * layers * T * (heads * head_dim) per token for attention scores and values over a row of
T tokens; forward+backward = 3x forward. A row of T tokens is T - 1 computed tokens: the last
predicts nothing and the trainer leaves it out, so counting it would flatter the fraction.
The peak is the best of a few large float32 matmuls (torch.mm, 2048^3) on the same thread
count, taken before and after; the training times
are the best of their repeats too, so that a busy machine biases neither side of the fraction.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from bench import common
from miles_fn import model, optim, prng, train
from miles_fn.config import ModelConfig
from miles_fn.train import PolicyLossConfig
from state.train_state import RolloutBuffer

# (name, model config, rows, tokens per row): the default job's train batch (256 samples of a
# 7-token prompt and a 4-token answer), and a larger model where the matmuls dominate.
SHAPES = (
    ("default job (hidden 128, 2 layers)", ModelConfig(vocab_size=47, max_position_embeddings=64), 256, 11),
    ("hidden 512, 4 layers", ModelConfig(vocab_size=47, hidden_size=512, intermediate_size=1536, num_layers=4,
                                         num_heads=8, num_kv_heads=4, max_position_embeddings=256), 8, 128),
)


def matmul_peak(n: int, repeats: int) -> float:
    """FLOP/s of the best of `repeats` float32 n x n x n matmuls."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / common.best_of(lambda: torch.mm(a, b), repeats)


def matmul_params(cfg: ModelConfig) -> int:
    layer = model.param_shapes(cfg)["layers"][0]
    per_layer = sum(s[0] * s[1] for name, s in layer.items() if len(s) == 2)
    return cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size  # + lm_head (tied or not)


def train_flops(cfg: ModelConfig, rows: int, t: int) -> float:
    fwd_per_token = 2 * matmul_params(cfg) + 4 * cfg.num_layers * (t - 1) * cfg.num_heads * cfg.dim_head
    return 3.0 * fwd_per_token * rows * (t - 1)


def batch(cfg: ModelConfig, rows: int, t: int) -> RolloutBuffer:
    k = prng.key(1)
    tokens = prng.randint(k, (rows, t), 3, cfg.vocab_size)
    ones = torch.ones(rows, t, dtype=torch.int64)
    mask = torch.ones(rows, t - 1)
    adv = prng.normal(prng.fold_in(k, 1), (rows, 1)).expand(rows, t - 1).contiguous()
    return RolloutBuffer(tokens, torch.arange(t).expand(rows, t).contiguous(), ones, mask,
                         torch.full((rows, t - 1), -3.0), adv, torch.zeros(rows), torch.arange(rows))


def measure(cfg: ModelConfig, rows: int, t: int, repeats: int) -> dict[str, float]:
    params = model.init_params(cfg, prng.key(0))
    state = train.init_state(params, prng.key(0))
    buf = batch(cfg, rows, t)
    loss_fn = train.make_grpo_loss(cfg, PolicyLossConfig())
    ocfg = optim.OptimConfig(lr=1e-4)
    key = prng.key(2)
    fwd_bwd = lambda: train.loss_and_grad(params, buf, key, loss_fn)  # the train step's gradient
    step = lambda: train.train_step(state, buf, key, loss_fn, ocfg)
    fwd_bwd(), step()  # warm-up
    t_fb, t_step = [], []
    for _ in range(repeats):
        t_fb.append(common.timed(fwd_bwd)[0])
        t_step.append(common.timed(step)[0])
    # Best of the repeats, like the peak: what the code can do when the machine lets it.
    fb, st = min(t_fb), min(t_step)
    flops = train_flops(cfg, rows, t)
    return {"rows": rows, "tokens_per_row": t, "tokens": rows * t, "model_flops": flops,
            "fwd_bwd_seconds": fb, "train_step_seconds": st, "fwd_bwd_tokens_per_s": rows * t / fb,
            "train_step_tokens_per_s": rows * t / st, "fwd_bwd_flops_per_s": flops / fb}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = common.parse_args("train_throughput", __doc__.splitlines()[0], argv, lambda p: (
        p.add_argument("--repeats", type=int, default=5),
        p.add_argument("--peak_n", type=int, default=2048),
    ))
    torch.set_num_threads(args.threads)
    shapes, repeats, peak_n = SHAPES, args.repeats, args.peak_n
    if args.quick:
        shapes, repeats, peak_n = [(SHAPES[0][0], SHAPES[0][1], 4, 6)], 1, 256
    peak_before = matmul_peak(peak_n, 3 if args.quick else 5)
    results = [{"shape": name, **measure(cfg, rows, t, repeats)} for name, cfg, rows, t in shapes]
    peak = max(peak_before, matmul_peak(peak_n, 3 if args.quick else 5))  # before and after: the better one
    for r in results:
        r["fraction_of_peak"] = r["fwd_bwd_flops_per_s"] / peak
    table = common.print_table(
        f"Training throughput, float32, {args.threads} thread(s), best of {repeats}; measured matmul peak "
        f"{peak / 1e9:.1f} GFLOP/s ({peak_n}^3 torch.mm, best of {3 if args.quick else 5})",
        ["model", "batch (rows x tokens)", "fwd+bwd tokens/s", "train step tokens/s", "model GFLOP/s",
         "fraction of matmul peak"],
        [[r["shape"], f"{r['rows']} x {r['tokens_per_row']}", r["fwd_bwd_tokens_per_s"], r["train_step_tokens_per_s"],
          r["fwd_bwd_flops_per_s"] / 1e9, f"{100 * r['fraction_of_peak']:.1f}%"] for r in results])
    out = {"benchmark": "train_throughput", "machine": common.machine_info(args.threads), "quick": args.quick,
           "matmul_peak_flops_per_s": peak, "results": results, "table": table}
    common.write_json(args.out, out)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
