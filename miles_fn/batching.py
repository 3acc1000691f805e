"""Turning variable-length samples into the dense tensors the model consumes."""

from __future__ import annotations

import torch


def pack_right_padded(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, positions, segment_ids, response_mask) for prompt+response rows, right-padded.

    response_mask[:, t] = 1 where tokens[:, t+1] is a response token (the shape of log-probs).
    """
    n = len(prompts)
    t = max(len(p) + len(r) for p, r in zip(prompts, responses))
    tokens = torch.full((n, t), pad_id, dtype=torch.int64)
    seg = torch.zeros(n, t, dtype=torch.int64)
    mask = torch.zeros(n, t - 1, dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        row = list(p) + list(r)
        tokens[i, : len(row)] = torch.tensor(row)
        seg[i, : len(row)] = 1
        mask[i, len(p) - 1 : len(row) - 1] = 1.0
    positions = torch.clamp(torch.cumsum(seg, -1) - 1, min=0)
    return tokens, positions, seg, mask
