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
    `params` is what the optimizer trains: the model, or under LoRA the adapters of `base`.
    """

    params: Any
    opt_state: AdamWState
    step: torch.Tensor  # int64 scalar
    key: torch.Tensor  # PRNG key [2]
    # LoRA (miles_fn/lora.py): the frozen model that `params`, then the adapters alone, adapt; None when
    # `params` is the whole model. Never updated, so checkpoints leave it out (launch/main.py save_checkpoint).
    base: Any = None


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
    values: torch.Tensor | None = None  # [N, T-1] critic's V at rollout time (PPO with a value model)
    returns: torch.Tensor | None = None  # [N, T-1] value targets (PPO with a value model)
    # Global counts of the whole step's batch (all micro-batches): losses normalise by them when set,
    # so that accumulating micro-batch gradients equals one full-batch step (NeMo-RL style).
    num_tokens: torch.Tensor | None = None  # scalar: sum of loss_mask over the whole batch
    num_samples: torch.Tensor | None = None  # scalar: rows of the whole batch
    # MoE: the experts the engine ran for the token at each column, [N, T-1, L_moe, k] int32, -1 = none (R3)
    routed_experts: torch.Tensor | None = None


class ActorCriticState(NamedTuple):
    """PPO's state: the policy's TrainState and the value model's, each with its own AdamW moments.

    One pytree (checkpointed, hashed and replayed as one). `params`, `step` and `key` are the
    policy's, so the shell can read it as it reads a TrainState (engine sync, checkpoint names).
    """

    policy: TrainState
    critic: TrainState

    @property
    def params(self) -> Any:
        return self.policy.params

    @property
    def step(self) -> torch.Tensor:
        return self.policy.step

    @property
    def key(self) -> torch.Tensor:
        return self.policy.key


def replace(state: NamedTuple, **changes: Any) -> Any:
    """A copy of a NamedTuple state with some fields changed (the original is untouched)."""
    return state._replace(**changes)


class SpeculativeState(NamedTuple):
    """A run's state with a speculative draft (miles_fn/draft.py): the policy's state as it would be
    without one, and the draft LM's own TrainState (params, AdamW moments, step, key).

    One pytree, so checkpoints, hashes, snapshots and replay cover the draft. `params`, `step` and `key`
    are the policy's, so the shell reads it as it reads a TrainState.
    """

    inner: Any  # TrainState
    draft: TrainState

    @property
    def params(self) -> Any:
        return self.inner.params

    @property
    def step(self) -> torch.Tensor:
        return self.inner.step

    @property
    def key(self) -> torch.Tensor:
        return self.inner.key
