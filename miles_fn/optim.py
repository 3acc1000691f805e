"""AdamW, global-norm clipping and learning-rate schedules as pure functions over pytrees (optax style)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import optree
import torch

from state.train_state import AdamWState
from state.tree import global_norm, tree_leaves, tree_map


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 0.0
    warmup_steps: int = 0
    decay_steps: int = 0  # decay length after warm-up; 0 = constant after warm-up
    decay: str = "cosine"  # cosine | linear, from lr down to min_lr over decay_steps
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 0.0  # 0 = no clipping
    schedule_start: int = 0  # the optimizer step at which this schedule's step 0 falls


def lr_at(cfg: OptimConfig, step: int) -> float:
    """Linear warm-up from lr/warmup to lr, then cosine or linear decay to min_lr over decay_steps.

    lr(s) = lr * (s+1)/W                                  for s < W
          = min + (lr - min) * (1 + cos(pi * p)) / 2,      p = min(1, (s - W) / D)   (cosine)
          = min + (lr - min) * (1 - p)                                              (linear)
    """
    if step < cfg.schedule_start:
        # Before its start a schedule has no value: warm-up would give a negative rate (or divide by zero).
        raise ValueError(f"learning-rate schedule asked for optimizer step {step}, before its start at step "
                         f"{cfg.schedule_start} (OptimConfig.schedule_start)")
    step = step - cfg.schedule_start
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.decay_steps <= 0:
        return cfg.lr
    p = min(1.0, (step - cfg.warmup_steps) / cfg.decay_steps)
    if cfg.decay == "linear":
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * (1.0 - p)
    if cfg.decay != "cosine":
        raise ValueError(f"OptimConfig.decay must be 'cosine' or 'linear', got {cfg.decay!r}")
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))


def clip_by_global_norm(grads: Any, max_norm: float, norm: torch.Tensor | None = None) -> tuple[Any, torch.Tensor]:
    """Scale grads by min(1, max_norm / (norm + 1e-6)) as torch.nn.utils.clip_grad_norm_ does.

    norm: the global norm when the caller computed it (`norm_from_row_sums`: a sharded or fixed-order
    step); by default `global_norm` of grads. Returns (clipped grads, the norm before clipping).
    """
    norm = global_norm(grads) if norm is None else norm
    if max_norm <= 0:
        return grads, norm
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return tree_map(lambda g: g * scale.to(g.dtype), grads), norm


def row_sums_of_squares(x: torch.Tensor) -> torch.Tensor:
    """float64 sum of squares of each dim-0 row of x (a 0-d x is one row).

    A row's sum is computed alike whether x is a whole leaf or a Shard(0) slice of its rows, so a norm
    built from these (`norm_from_row_sums`) does not depend on how the rows are split over ranks.
    float32 squares are exact in float64.
    """
    x = x.detach().reshape(1, 1) if x.dim() == 0 else x.detach().reshape(x.shape[0], math.prod(x.shape[1:]))
    return x.to(torch.float64).pow(2).sum(dim=1)


def norm_from_row_sums(row_sums: list[torch.Tensor]) -> torch.Tensor:
    """The float32 global norm from each leaf's whole vector of row sums, reduced in leaf order."""
    total = torch.zeros((), dtype=torch.float64)
    for r in row_sums:
        total = total + r.sum()
    return torch.sqrt(total).to(torch.float32)


def global_norm_by_rows(grads: Any) -> torch.Tensor:
    """The global norm through per-row sums: the same bits as a sharded step's (sharding.dp_train_step_tiles)."""
    return norm_from_row_sums([row_sums_of_squares(g) for g in tree_leaves(grads) if isinstance(g, torch.Tensor)])


def adamw_init(params: Any) -> AdamWState:
    zeros = tree_map(lambda p: torch.zeros_like(p, dtype=torch.float32), params)
    return AdamWState(count=torch.zeros((), dtype=torch.int64), mu=zeros, nu=tree_map(torch.zeros_like, zeros))


def adamw_update(
    grads: Any, state: AdamWState, params: Any, cfg: OptimConfig, lr: float
) -> tuple[Any, AdamWState]:
    """Decoupled weight decay Adam (Loshchilov & Hutter), the arithmetic of torch.optim.AdamW.

    p <- p * (1 - lr*wd);  m <- b1 m + (1-b1) g;  v <- b2 v + (1-b2) g^2
    p <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    Moments are float32 whatever the params dtype. Returns (new params, new state).
    """
    t = int(state.count) + 1
    bc1 = 1.0 - cfg.beta1**t
    bc2_sqrt = math.sqrt(1.0 - cfg.beta2**t)
    decay = 1.0 - lr * cfg.weight_decay

    def leaf(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # The formula above, one rounding per operation in this order, computed into three fresh buffers
        # (the new moments and the new param) plus nothing else: in-place writes go only to tensors made
        # here, so the inputs are untouched. Fewer buffers is what makes it fast: on CPU a fresh large
        # tensor costs a page fault per 4 KiB, which dominated the version with one temporary per op.
        g = g.to(torch.float32)
        tmp = torch.mul(g, 1.0 - cfg.beta1)
        new_m = torch.mul(m, cfg.beta1).add_(tmp)
        torch.mul(g, g, out=tmp).mul_(1.0 - cfg.beta2)
        new_v = torch.mul(v, cfg.beta2).add_(tmp)
        torch.sqrt(new_v, out=tmp).div_(bc2_sqrt).add_(cfg.eps)
        torch.div(new_m, tmp, out=tmp).mul_(lr / bc1)
        p32 = p.to(torch.float32)
        if decay != 1.0:
            p32 = p32 * decay
        new_p = torch.sub(p32, tmp, out=tmp) if p.dtype == torch.float32 else (p32 - tmp).to(p.dtype)
        return new_p, new_m, new_v

    spec = optree.tree_structure(params)
    new_p, new_m, new_v = zip(*map(leaf, *(spec.flatten_up_to(t) for t in (params, grads, state.mu, state.nu))),
                              strict=True)
    return spec.unflatten(new_p), AdamWState(count=state.count + 1, mu=spec.unflatten(new_m),
                                             nu=spec.unflatten(new_v))
