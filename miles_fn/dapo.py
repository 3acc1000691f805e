"""DAPO's reward-side pieces (Yu et al., 2025): dynamic sampling's group filter and overlong reward shaping.

Both are pure; the oversampling loop that uses `informative_groups` lives in the shell,
which owns the engine.
"""

from __future__ import annotations

import torch


def informative_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[G] bool: True for groups whose rewards are not all equal (max_g r > min_g r).

    A group of equal rewards has GRPO advantage 0 on every sample: it adds no gradient,
    only dilutes the batch, so dynamic sampling drops it and samples more prompts.
    """
    g = int(group_ids.max()) + 1 if group_ids.numel() else 0
    r = rewards.to(torch.float64)
    hi = torch.full((g,), -torch.inf, dtype=torch.float64).scatter_reduce(0, group_ids, r, "amax")
    lo = torch.full((g,), torch.inf, dtype=torch.float64).scatter_reduce(0, group_ids, r, "amin")
    return hi > lo


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment added to the reward, per sample:

        0                                   if |y| <= L - B
        factor * ((L - B) - |y|) / B        if L - B < |y| <= L
        -factor                             if |y| > L
    with L = max_len, B = buffer (B = 0 turns it off).
    """
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    if buffer > max_len:
        raise ValueError(f"overlong buffer {buffer} exceeds the maximum response length {max_len} (--overlong_buffer)")
    n = lengths.to(torch.float64)
    soft = (max_len - buffer) - n
    pen = torch.where(n <= max_len - buffer, torch.zeros_like(n), soft / buffer)
    pen = torch.where(n > max_len, torch.full_like(n, -1.0), pen)
    return (factor * pen).to(torch.float32)
