"""From engine outputs and rewards to the RolloutBuffer the train step consumes (pure)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from miles_fn import advantages as adv_lib
from miles_fn.batching import pack_right_padded, place_rows
from state.train_state import RolloutBuffer


def build_rollout_buffer(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    response_logprobs: Sequence[Sequence[float]],
    rewards: Sequence[float],
    group_ids: Sequence[int],
    normalize_std: bool = True,
    loss_masks: Sequence[Sequence[int]] | None = None,
) -> RolloutBuffer:
    """Right-padded tensors of prompt+response exactly as the engine produced them, with GRPO advantages.

    `loss_masks` (one 0/1 per response token) drop tokens the model did not choose, such as tool
    output in a multi-turn rollout, from the loss."""
    tokens, positions, seg, mask = pack_right_padded(list(prompts), list(responses))
    starts = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.int64)  # column predicting response token 0
    width = mask.shape[1]
    if loss_masks is not None:
        if len(loss_masks) != len(prompts):
            raise ValueError(f"build_rollout_buffer: {len(loss_masks)} loss masks for {len(prompts)} samples")
        mask = mask * place_rows(loss_masks, starts, width, 1.0, torch.float32)
    old = place_rows(response_logprobs, starts, width, 0.0, torch.float32)
    r = torch.tensor(rewards, dtype=torch.float32)
    g = torch.tensor(group_ids, dtype=torch.int64)
    adv = adv_lib.broadcast_to_tokens(adv_lib.grpo(r, g, normalize_std), mask)
    return RolloutBuffer(tokens, positions, seg, mask, old, adv, r, g)
