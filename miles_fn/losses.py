"""Policy losses, KL estimators and loss aggregation: pure functions over per-token tensors.

Shapes: logprobs, old_logprobs, ref_logprobs, advantages, mask are all [N, T];
mask is 1.0 on tokens that train and 0.0 elsewhere. Masked tokens never reach
the loss, its value or its gradient (they are selected out with `where`, so even
a NaN there cannot leak).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask > 0, x, torch.zeros_like(x))


AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_mean",
    normalizer: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar: a sum over this batch divided by a normaliser D.

    token_mean:              sum_{i,t} m l / D,                      D = sum_{i,t} m  (tokens)
    seq_mean_token_mean:     sum_i (sum_t m l / sum_t m) / D,        D = N            (sequences)
    seq_mean_token_sum:      sum_i sum_t m l / D,                    D = N
    seq_mean_token_sum_norm: sum_i sum_t m l / D,                    D = N * T        (Dr. GRPO's constant;
                             pass D = N * max_response_len to make it a true constant)
    `normalizer` overrides D. Pass the count of the *whole* batch (NeMo-RL style) when this
    call sees one micro-batch: the micro-batch losses then sum to the full-batch loss, so
    accumulating their gradients equals one full-batch step.
    """
    x = _masked(per_token, mask)
    if mode == "token_mean":
        d = torch.clamp(mask.sum(), min=1.0) if normalizer is None else normalizer
        return x.sum() / d
    if mode == "seq_mean_token_mean":
        per_seq = x.sum(-1) / torch.clamp(mask.sum(-1), min=1.0)
        return per_seq.mean() if normalizer is None else per_seq.sum() / normalizer
    if mode == "seq_mean_token_sum":
        d = max(mask.shape[0], 1) if normalizer is None else normalizer
        return x.sum(-1).sum() / d
    if mode == "seq_mean_token_sum_norm":
        d = max(mask.shape[0] * mask.shape[-1], 1) if normalizer is None else normalizer
        return x.sum(-1).sum() / d
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {', '.join(AGG_MODES)}")


def normalizer_for(mode: str, num_tokens: torch.Tensor | float, num_samples: torch.Tensor | float,
                   max_response_len: int = 0) -> torch.Tensor | float:
    """D of `aggregate` from global counts: tokens for token_mean, sequences (x max length for Dr. GRPO) else."""
    if mode == "token_mean":
        return torch.clamp(torch.as_tensor(num_tokens, dtype=torch.float32), min=1.0)
    if mode == "seq_mean_token_sum_norm":
        if max_response_len <= 0:
            raise ValueError("loss_agg=seq_mean_token_sum_norm needs max_response_len > 0 with global counts")
        return num_samples * max_response_len
    if mode in AGG_MODES:
        return num_samples
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {', '.join(AGG_MODES)}")


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) per token, with clip_frac and ratio_mean over the mask."""
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        denom = torch.clamp(mask.sum(), min=1.0)
        clip_frac = _masked((clipped < unclipped).to(mask.dtype), mask).sum() / denom
        ratio_mean = _masked(ratio, mask).sum() / denom
    return loss, {"clip_frac": clip_frac, "ratio_mean": ratio_mean}


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
    ratio = torch.exp(_masked(logprobs - old_logprobs, mask))
    return _clipped_surrogate(ratio, advantages, mask, eps_low, eps_low if eps_high is None else eps_high)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, clamp: float = 10.0) -> torch.Tensor:
    """Schulman's low-variance unbiased KL(pi || ref) estimator per token.

    k3 = exp(d) - d - 1, d = logp_ref - logp, with d clamped to [-clamp, clamp].
    """
    d = torch.clamp(ref_logprobs - logprobs, -clamp, clamp)
    return torch.exp(d) - d - 1.0


def sft_nll(logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood; aggregate over a loss mask."""
    return -logprobs


def dual_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    clip_c: float = 3.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dual-clip PPO (Ye et al., 2020): for A < 0 the loss is also capped at -c A, c > 1.

    l = l_ppo                      if A >= 0
      = min(l_ppo, -c A)           if A < 0     (bounds the step when rho >> 1 on a bad token)
    """
    if clip_c <= 1.0:
        raise ValueError(f"dual-clip constant must be > 1, got {clip_c} (--dual_clip_c)")
    loss, aux = ppo_clip(logprobs, old_logprobs, advantages, mask, eps_low, eps_high)
    capped = torch.minimum(loss, -clip_c * advantages)
    out = torch.where(advantages < 0, capped, loss)
    with torch.no_grad():
        aux["dual_clip_frac"] = _masked(((advantages < 0) & (capped < loss)).to(mask.dtype), mask).sum() / torch.clamp(
            mask.sum(), min=1.0)
    return out, aux


def gspo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float | None = 4e-4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al., 2025): PPO clip on the length-normalised *sequence* ratio.

    s_i = exp((1/|y_i|) sum_t m (logp - logp_old));  per token s_{i,t} = sg[s_i] exp(logp_t - sg[logp_t])
    l_{i,t} = -min(s_{i,t} A_{i,t}, clip(s_{i,t}, 1 - eps_low, 1 + eps_high) A_{i,t})
    The value of s_{i,t} is s_i; its gradient is s_i grad logp_t (the GSPO-token form, which
    with a sequence-constant A equals GSPO's gradient). Aggregate with seq_mean_token_mean.
    """
    lp = _masked(logprobs, mask)
    log_ratio = _masked(logprobs - old_logprobs, mask)
    seq_log_ratio = log_ratio.sum(-1) / torch.clamp(mask.sum(-1), min=1.0)
    ratio = torch.exp(seq_log_ratio.detach()[:, None] + lp - lp.detach())
    return _clipped_surrogate(ratio, advantages, mask, eps_low, eps_low if eps_high is None else eps_high)


def policy_gradient(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain (REINFORCE) policy gradient: l = -A logp, so grad l = -A grad logp. old_logprobs are unused."""
    del old_logprobs
    return -advantages * _masked(logprobs, mask), {}


@dataclasses.dataclass(frozen=True)
class ClipConfig:
    """The knobs the registered policy losses read (each reads the ones it needs)."""

    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    dual_clip_c: float = 3.0


PolicyLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, ClipConfig],
                      tuple[torch.Tensor, dict[str, torch.Tensor]]]

# name -> loss(logprobs, old_logprobs, advantages, mask, ClipConfig) -> (per-token loss [N, T], aux)
POLICY_LOSSES: Mapping[str, PolicyLoss] = MappingProxyType({
    "ppo_clip": lambda lp, old, a, m, c: ppo_clip(lp, old, a, m, c.eps_clip, c.eps_clip_high),
    "dual_clip": lambda lp, old, a, m, c: dual_clip(lp, old, a, m, c.eps_clip, c.eps_clip_high, c.dual_clip_c),
    "gspo": lambda lp, old, a, m, c: gspo(lp, old, a, m, c.eps_clip, c.eps_clip_high),
    "pg": lambda lp, old, a, m, c: policy_gradient(lp, old, a, m),
})


def policy_loss(name: str) -> PolicyLoss:
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, clamp: float = 10.0) -> torch.Tensor:
    """k1 = logp - logp_ref = -d (unbiased, high variance, can be negative), d clamped to [-clamp, clamp]."""
    return -torch.clamp(ref_logprobs - logprobs, -clamp, clamp)


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, clamp: float = 10.0) -> torch.Tensor:
    """k2 = d^2 / 2 (biased, low variance; its gradient is that of the true KL to first order), d clamped."""
    d = torch.clamp(ref_logprobs - logprobs, -clamp, clamp)
    return 0.5 * d * d


KL_ESTIMATORS: Mapping[str, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = MappingProxyType({
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
})


def kl(kind: str, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, clamp: float = 10.0) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate of the chosen kind (Schulman, "Approximating KL divergence")."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](logprobs, ref_logprobs, clamp)


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float = 0.2
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (PPO2 baselines): l = 1/2 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2).

    clip <= 0 turns clipping off: l = 1/2 (V - R)^2.
    """
    v = _masked(values, mask)
    err = (v - returns) ** 2
    if clip <= 0:
        return 0.5 * _masked(err, mask), {}
    v_clip = old_values + torch.clamp(v - old_values, -clip, clip)
    err_clip = (v_clip - returns) ** 2
    with torch.no_grad():
        frac = _masked((err_clip > err).to(mask.dtype), mask).sum() / torch.clamp(mask.sum(), min=1.0)
    return 0.5 * _masked(torch.maximum(err, err_clip), mask), {"value_clip_frac": frac}


def entropy_bonus(entropy: torch.Tensor) -> torch.Tensor:
    """Per-token loss -H (minimising it raises entropy); H from ops.token_entropy over the full vocab."""
    return -entropy
