"""Advantage estimators: pure functions from rewards (and masks) to per-sample advantages."""

from __future__ import annotations

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
