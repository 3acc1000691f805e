"""The immutable state of a run. NamedTuples are pytrees to optree and torch.func alike."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class AdamWState(NamedTuple):
    count: torch.Tensor  # int64 scalar: updates applied
    mu: Any  # first moments, same tree as params
    nu: Any  # second moments


class TrainState(NamedTuple):
    """Everything the next step needs besides its batch.

    `key` is the run's root key: step s uses fold_in(key, s), so the key never
    has to be threaded or advanced and a resumed run draws the same numbers.
    """

    params: Any
    opt_state: AdamWState
    step: torch.Tensor  # int64 scalar
    key: torch.Tensor  # PRNG key [2]


class RolloutBuffer(NamedTuple):
    """One step's rollouts, right-padded to [N, T]; token t+1 is predicted at column t.

    tokens: prompt + response ids exactly as the engine produced them.
    loss_mask[:, t] = 1 where tokens[:, t+1] is a response token the loss trains on.
    """

    tokens: torch.Tensor  # [N, T] int64
    positions: torch.Tensor  # [N, T] int64
    segment_ids: torch.Tensor  # [N, T] int64, 0 = padding
    loss_mask: torch.Tensor  # [N, T-1] float32
    old_logprobs: torch.Tensor  # [N, T-1] float32, from the engine
    advantages: torch.Tensor  # [N, T-1] float32
    rewards: torch.Tensor  # [N] float32
    group_ids: torch.Tensor  # [N] int64
    ref_logprobs: torch.Tensor | None = None  # [N, T-1], when a KL to a reference is on


def replace(state: NamedTuple, **changes: Any) -> Any:
    """A copy of a NamedTuple state with some fields changed (the original is untouched)."""
    return state._replace(**changes)
