"""Train/inference mismatch and the off-policy corrections for it: pure functions over [N, T] tensors.

The engine samples from pi_engine; the trainer computes pi_train for the same tokens with
its own kernels. Unless both run the batch-invariant ops (--true_on_policy) the two differ,
and the "on-policy" update is in fact off-policy. With d = log pi_train - log pi_engine:

    mismatch_mean = mean |d|,  mismatch_max = max |d|,  mismatch_k3 = mean (e^d - d - 1)
    (k3 is Schulman's estimator of KL(pi_engine || pi_train) from the engine's samples)

Corrections reweight each token's policy-gradient term by a function of r = e^d
(Ionides 2008; Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL"):

    TIS (truncated importance sampling):  w = min(r, cap)
    MIS (masked importance sampling):     w = r * 1[low <= r <= high]   (outliers leave the loss)

The weights are constants (no gradient). The PPO ratio is then taken against the trainer's
own log-probs at the rollout weights (the proximal policy), not the engine's.
"""

from __future__ import annotations

import dataclasses

import torch

CORRECTIONS = ("none", "tis", "mis")


@dataclasses.dataclass(frozen=True)
class OffPolicyConfig:
    correction: str = "none"
    tis_cap: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 2.0

    def __post_init__(self) -> None:
        if self.correction not in CORRECTIONS:
            raise ValueError(f"off-policy correction {self.correction!r} is not one of {CORRECTIONS}")
        if self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")
        if not 0 <= self.mis_low <= 1 <= self.mis_high:
            raise ValueError(f"need 0 <= mis_low <= 1 <= mis_high, got {self.mis_low}, {self.mis_high}")


def _log_ratio(train_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask > 0, train_logp.detach() - engine_logp, torch.zeros_like(engine_logp))


def tis_weights(train_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """w = min(pi_train / pi_engine, cap) on masked tokens, 0 elsewhere."""
    w = torch.clamp(torch.exp(_log_ratio(train_logp, engine_logp, mask)), max=cap)
    return torch.where(mask > 0, w, torch.zeros_like(w))


def mis_weights(train_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, low: float,
                high: float) -> torch.Tensor:
    """w = r if low <= r <= high else 0, r = pi_train / pi_engine; 0 off the mask."""
    r = torch.exp(_log_ratio(train_logp, engine_logp, mask))
    keep = (mask > 0) & (r >= low) & (r <= high)
    return torch.where(keep, r, torch.zeros_like(r))


def importance_weights(train_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor,
                       cfg: OffPolicyConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights of cfg.correction and their summary ({"is_weight_mean", "is_kept_frac"})."""
    if cfg.correction == "tis":
        w = tis_weights(train_logp, engine_logp, mask, cfg.tis_cap)
    elif cfg.correction == "mis":
        w = mis_weights(train_logp, engine_logp, mask, cfg.mis_low, cfg.mis_high)
    else:
        w = mask.clone()
    denom = torch.clamp(mask.sum(), min=1.0)
    kept = ((w > 0) & (mask > 0)).to(mask.dtype).sum() / denom
    return w.detach(), {"is_weight_mean": (w.sum() / denom).detach(), "is_kept_frac": kept}


def mismatch_metrics(train_logp: torch.Tensor, engine_logp: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """mean and max |log pi_train - log pi_engine| and the k3 KL over masked tokens (no gradient)."""
    with torch.no_grad():  # float64: k3 ~ d^2 / 2 underflows float32 for the ~1e-7 gaps of fast kernels
        d = _log_ratio(train_logp, engine_logp, mask).double()
        denom = torch.clamp(mask.double().sum(), min=1.0)
        k3 = torch.where(mask > 0, torch.expm1(d) - d, torch.zeros_like(d))
        return {
            "mismatch_mean": d.abs().sum() / denom,
            "mismatch_max": d.abs().max() if d.numel() else torch.zeros(()),
            "mismatch_k3": k3.sum() / denom,
        }
