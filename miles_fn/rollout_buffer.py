"""From engine outputs and rewards to the RolloutBuffer the train step consumes (pure)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from miles_fn import advantages as adv_lib
from miles_fn.batching import pack_right_padded, place_rows
from miles_fn.packing import whole_batch_counts
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


def gradient_rows(buf: RolloutBuffer) -> RolloutBuffer:
    """The rows that can move the policy, with the whole batch's counts kept for the normalisers.

    A row whose advantage is 0 at every loss token adds exactly 0 to an advantage-scaled policy
    loss (PPO-clip, dual-clip, GSPO, plain policy gradient) and to its gradient. With 0/1 rewards
    most GRPO groups are all right or all wrong, so most rows are such rows (bench/rl_step's
    task: 60-95%), and leaving them out gives the same update for a fraction of the work. That
    holds only when every term of the loss scales with the advantage (no KL loss, no entropy
    bonus): the caller decides (objective.ObjectiveConfig.skips_zero_advantage_rows).

    num_tokens / num_samples are set from the whole batch (or kept, if already set), so the loss
    divides by the same counts as without the cut. One row is kept when no row carries gradient:
    the step still runs, since AdamW moves the parameters on a zero gradient too.
    """
    n = buf.loss_mask.shape[0]
    if buf.num_tokens is None or buf.num_samples is None:
        num_tokens, num_samples = whole_batch_counts(buf)
        buf = buf._replace(num_tokens=num_tokens, num_samples=num_samples)
    live = torch.nonzero(((buf.advantages != 0) & (buf.loss_mask > 0)).any(-1)).squeeze(-1)
    if live.numel() == n:
        return buf
    if live.numel() == 0:
        live = live.new_zeros(1)
    per_row = {f: getattr(buf, f)[live] for f in _ROW_FIELDS if getattr(buf, f) is not None}
    return buf._replace(**per_row)


_ROW_FIELDS = ("tokens", "positions", "segment_ids", "loss_mask", "old_logprobs", "advantages", "rewards",
               "group_ids", "ref_logprobs", "values", "returns", "routed_experts")
