"""Policy losses, KL estimators and loss aggregation: pure functions over per-token tensors.

Shapes: logprobs, old_logprobs, ref_logprobs, advantages, mask are all [N, T];
mask is 1.0 on tokens that train and 0.0 elsewhere. Masked tokens never reach
the loss, its value or its gradient (they are selected out with `where`, so even
a NaN there cannot leak).
"""

from __future__ import annotations

import torch


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask > 0, x, torch.zeros_like(x))


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean") -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    token_mean:  sum_{i,t} m l / sum_{i,t} m
    seq_mean_token_mean: mean_i (sum_t m l / sum_t m)
    """
    x = _masked(per_token, mask)
    if mode == "token_mean":
        return x.sum() / torch.clamp(mask.sum(), min=1.0)
    if mode == "seq_mean_token_mean":
        per_seq = x.sum(-1) / torch.clamp(mask.sum(-1), min=1.0)
        return per_seq.mean()
    raise ValueError(f"unknown loss aggregation {mode!r}; choose token_mean or seq_mean_token_mean")


def ppo_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate per token (Schulman et al., 2017), clip-higher when eps_high is set.

    rho = exp(logp - logp_old);  l = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)
    Returns (per-token loss [N, T], {"clip_frac", "ratio_mean"} over masked tokens).
    """
    eps_high = eps_low if eps_high is None else eps_high
    log_ratio = _masked(logprobs - old_logprobs, mask)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        denom = torch.clamp(mask.sum(), min=1.0)
        clip_frac = _masked((clipped < unclipped).to(mask.dtype), mask).sum() / denom
        ratio_mean = _masked(ratio, mask).sum() / denom
    return loss, {"clip_frac": clip_frac, "ratio_mean": ratio_mean}


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, clamp: float = 10.0) -> torch.Tensor:
    """Schulman's low-variance unbiased KL(pi || ref) estimator per token.

    k3 = exp(d) - d - 1, d = logp_ref - logp, with d clamped to [-clamp, clamp].
    """
    d = torch.clamp(ref_logprobs - logprobs, -clamp, clamp)
    return torch.exp(d) - d - 1.0


def sft_nll(logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood; aggregate over a loss mask."""
    return -logprobs
