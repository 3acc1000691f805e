"""Advantage estimators: pure functions from rewards (and masks) to per-sample advantages."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch


def group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group mean, group unbiased std, group size), gathered back to [N].

    Groups are reduced with index_add_ in sample order, a fixed reduction order.
    """
    g = int(group_ids.max()) + 1 if group_ids.numel() else 0
    r = rewards.to(torch.float64)
    count = torch.zeros(g, dtype=torch.float64).index_add_(0, group_ids, torch.ones_like(r))
    mean = torch.zeros(g, dtype=torch.float64).index_add_(0, group_ids, r) / count
    dev = (r - mean[group_ids]) ** 2
    var = torch.zeros(g, dtype=torch.float64).index_add_(0, group_ids, dev) / torch.clamp(count - 1, min=1)
    return mean[group_ids], var.sqrt()[group_ids], count[group_ids]


def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al., 2024): A_i = (r_i - mean_g) / (std_g + eps); without std it is Dr. GRPO.

    std is the unbiased group standard deviation; a group whose rewards are all
    equal gets advantage 0 in both forms.
    """
    mean, std, _ = group_stats(rewards, group_ids)
    adv = rewards.to(torch.float64) - mean
    if normalize_std:
        adv = torch.where(std > 0, adv / (std + eps), torch.zeros_like(adv))
    return adv.to(torch.float32)


def broadcast_to_tokens(adv: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Per-sample advantages [N] -> per-token [N, T] (zero off the mask)."""
    return adv[:, None].to(loss_mask.dtype) * loss_mask


# ---------------------------------------------------------------------------------------------
# The estimator library. Every estimator shares one signature,
#     estimator(inputs: AdvantageInputs, cfg: AdvantageConfig) -> (advantages [N, T], returns [N, T]),
# so a registry is a plain read-only dict of functions (ESTIMATORS below).
# Token layout: column t of the [N, T] tensors scores tokens[:, t+1]; the trained columns are those
# where mask = 1. A multi-turn response has masked gaps (tool output the policy did not write, e.g.
# mask 1 1 1 0 0 1 1): the outcome reward goes once, to the last trained column of the row, and
# returns / GAE run over the trained columns only, stepping over the gaps as if the masked columns
# were not there (as verl's GAE does). So gamma (and lambda) count trained tokens, not columns:
# G at trained column t = r_t + gamma G at the next trained column; a gap neither discounts nor
# ends the episode, and V bootstraps from the next trained column's value. Gap-free masks give the
# values of the contiguous-run formulas, bit for bit.


class AdvantageInputs(NamedTuple):
    rewards: torch.Tensor  # [N] outcome rewards
    group_ids: torch.Tensor  # [N] int64, samples of one prompt share an id
    mask: torch.Tensor  # [N, T] response columns
    kl: torch.Tensor | None = None  # [N, T] per-token KL(pi_old || ref), folded into the reward when kl_coef > 0
    values: torch.Tensor | None = None  # [N, T] V(s_t) of the critic (GAE only)


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    normalize_std: bool = True  # GRPO: divide by the group std (False = Dr. GRPO)
    gamma: float = 1.0  # discount (GAE, REINFORCE++)
    lam: float = 0.95  # GAE lambda
    kl_coef: float = 0.0  # beta of the KL folded into the reward (0 = off)
    eps: float = 1e-6


def last_token_mask(mask: torch.Tensor) -> torch.Tensor:
    """1.0 at the last trained column of each row, gaps or not (rows without one are all zero)."""
    trained = mask > 0
    later = trained.flip(-1).cumsum(-1).flip(-1) - trained.to(torch.int64)  # trained columns after t
    return (trained & (later == 0)).to(mask.dtype)


def first_token_mask(mask: torch.Tensor) -> torch.Tensor:
    """1.0 at the first trained column of each row, gaps or not (rows without one are all zero)."""
    trained = mask > 0
    earlier = trained.cumsum(-1) - trained.to(torch.int64)  # trained columns before t
    return (trained & (earlier == 0)).to(mask.dtype)


def token_rewards(rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token rewards: r_t = R 1[t = last trained column] - beta kl_t on the trained columns (float64).

    R is written once a row, however many trained segments (turns) the mask has."""
    m = mask.to(torch.float64)
    out = last_token_mask(m) * rewards.to(torch.float64)[:, None]
    if kl is not None and kl_coef > 0:
        out = out - kl_coef * torch.where(m > 0, kl.to(torch.float64), torch.zeros_like(m))
    return out


def sequence_rewards(inputs: AdvantageInputs, kl_coef: float) -> torch.Tensor:
    """R_i - beta sum_t kl_{i,t}: the outcome reward with the KL penalty folded in (float64, [N])."""
    return token_rewards(inputs.rewards, inputs.mask, inputs.kl, kl_coef).sum(-1)


def discounted_returns(r: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma G_{next trained column after t} on trained columns, zero elsewhere: the return to go.

    Masked columns are skipped (their r is ignored, they do not discount), so the return crosses a
    tool-output gap to the reward at the end of the row.
    """
    trained = mask > 0
    out = torch.zeros_like(r)
    nxt = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        nxt = torch.where(trained[:, t], r[:, t] + gamma * nxt, nxt)
        out[:, t] = torch.where(trained[:, t], nxt, 0.0)
    return out


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries of the whole batch (population std), zero elsewhere."""
    m = mask.to(torch.float64)
    x = torch.where(m > 0, x.to(torch.float64), torch.zeros_like(m))
    n = torch.clamp(m.sum(), min=1.0)
    mean = x.sum() / n
    var = (((x - mean) * m) ** 2).sum() / n
    return (x - mean) / (var.sqrt() + eps) * m


def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al., 2024): A_i = r_i - (sum_{j in g, j != i} r_j) / (n_g - 1); 0 for singletons."""
    mean, _, count = group_stats(rewards, group_ids)
    r = rewards.to(torch.float64)
    loo = (mean * count - r) / torch.clamp(count - 1, min=1)
    return torch.where(count > 1, r - loo, torch.zeros_like(r)).to(torch.float32)


def est_grpo(inputs: AdvantageInputs, cfg: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: A_{i,t} = (R_i - mean_g R) / (std_g R + eps) on every response token (Dr. GRPO without std)."""
    r = inputs.rewards if cfg.kl_coef <= 0 or inputs.kl is None else sequence_rewards(inputs, cfg.kl_coef)
    adv = broadcast_to_tokens(grpo(r, inputs.group_ids, cfg.normalize_std, cfg.eps), inputs.mask)
    return adv, adv


def est_dr_grpo(inputs: AdvantageInputs, cfg: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO (Liu et al., 2025): A_{i,t} = R_i - mean_g R; pair it with loss_agg=seq_mean_token_sum_norm."""
    return est_grpo(inputs, dataclasses.replace(cfg, normalize_std=False))


def est_rloo(inputs: AdvantageInputs, cfg: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: A_{i,t} = R_i - mean of the other samples' R in the group, on every response token."""
    r = inputs.rewards if cfg.kl_coef <= 0 or inputs.kl is None else sequence_rewards(inputs, cfg.kl_coef)
    adv = broadcast_to_tokens(rloo(r, inputs.group_ids), inputs.mask)
    return adv, adv


def est_reinforce(inputs: AdvantageInputs, cfg: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE with a batch-mean baseline: A_{i,t} = G_{i,t} - mean_j G_{j,first}, G the return to go.

    With gamma = 1 and no KL, G_{i,t} = R_i and the baseline is the batch mean reward.
    """
    g = discounted_returns(token_rewards(inputs.rewards, inputs.mask, inputs.kl, cfg.kl_coef), inputs.mask, cfg.gamma)
    first = (g * first_token_mask(inputs.mask)).sum(-1)
    baseline = first.mean() if first.numel() else first.sum()
    m = inputs.mask.to(torch.float64)
    return ((g - baseline) * m).to(torch.float32), g.to(torch.float32)


def est_reinforce_pp(inputs: AdvantageInputs, cfg: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, 2025): G_t = sum_{s >= t} gamma^{k(s)-k(t)} (R 1[s = last] - beta kl_s), A = whiten(G).

    s runs over the trained columns, k(s) counts them (gaps do not discount, see the token layout above).
    The whitening (mean and std over every response token of the batch) replaces a critic.
    """
    g = discounted_returns(token_rewards(inputs.rewards, inputs.mask, inputs.kl, cfg.kl_coef), inputs.mask, cfg.gamma)
    return masked_whiten(g, inputs.mask, cfg.eps).to(torch.float32), g.to(torch.float32)


def gae(r: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al., 2016) over the trained columns: returns (advantages, returns = A + V).

    With t' the next trained column after t:  delta_t = r_t + gamma V_{t'} - V_t;  A_t = delta_t + gamma lam A_{t'}
    The value after the last trained token is 0 (the episode ends there); a masked gap is stepped over
    (no TD error of its own, no discount, V bootstraps across it). Zero off the mask.
    """
    m = mask.to(torch.float64)
    trained = m > 0
    v = torch.where(trained, values.to(torch.float64), torch.zeros_like(m))
    r = r.to(torch.float64)
    adv = torch.zeros_like(r)
    a_next = torch.zeros_like(r[:, 0])
    v_next = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        a = r[:, t] + gamma * v_next - v[:, t] + gamma * lam * a_next
        a_next = torch.where(trained[:, t], a, a_next)
        v_next = torch.where(trained[:, t], v[:, t], v_next)
        adv[:, t] = torch.where(trained[:, t], a, 0.0)
    return adv, (adv + v) * m


def est_gae(inputs: AdvantageInputs, cfg: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's GAE on per-token rewards (outcome at the last token, minus beta kl_t) with the critic's V."""
    if inputs.values is None:
        raise ValueError("advantage estimator 'gae' needs the critic's values (run with --advantage_estimator=gae, "
                         "which trains a value model)")
    adv, ret = gae(token_rewards(inputs.rewards, inputs.mask, inputs.kl, cfg.kl_coef), inputs.values, inputs.mask,
                   cfg.gamma, cfg.lam)
    return adv.to(torch.float32), ret.to(torch.float32)


ESTIMATORS: Mapping[str, Callable[[AdvantageInputs, AdvantageConfig], tuple[torch.Tensor, torch.Tensor]]] = (
    MappingProxyType({
        "grpo": est_grpo,
        "dr_grpo": est_dr_grpo,
        "rloo": est_rloo,
        "reinforce": est_reinforce,
        "reinforce_pp": est_reinforce_pp,
        "gae": est_gae,
    })
)


def estimate(name: str, inputs: AdvantageInputs, cfg: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Look up an estimator by name and apply it; the error lists the known names."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {sorted(ESTIMATORS)}")
    return ESTIMATORS[name](inputs, cfg)
