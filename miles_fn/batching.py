"""Turning variable-length samples into the dense tensors the model consumes."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


def place_rows(
    rows: Sequence[Sequence[float]], starts: torch.Tensor, width: int, fill: float = 0,
    dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """[len(rows), width] with row i's values at columns starts[i] ... starts[i] + len(rows[i]) - 1.

    One tensor from one flat list: a GRPO batch has hundreds of rows, and a tensor call and a slice
    assignment per row cost more than the step's rollout bookkeeping should."""
    lens = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    out = torch.full((len(rows), width), fill, dtype=dtype)
    if int(lens.sum()) == 0:
        return out
    if bool(((starts < 0) | (starts + lens > width)).any()):
        raise ValueError(f"place_rows: a row does not fit in width {width} at its start")
    cols = torch.arange(width)[None]
    inside = (cols >= starts[:, None]) & (cols < (starts + lens)[:, None])
    out[inside] = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=dtype)  # row-major order
    return out


def pack_right_padded(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, positions, segment_ids, response_mask) for prompt+response rows, right-padded.

    response_mask[:, t] = 1 where tokens[:, t+1] is a response token (the shape of log-probs).
    """
    rows = [list(itertools.chain(p, r)) for p, r in zip(prompts, responses, strict=True)]
    lens = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    t = int(lens.max())
    tokens = place_rows(rows, torch.zeros_like(lens), t, pad_id)
    cols = torch.arange(t)[None]
    seg = (cols < lens[:, None]).to(torch.int64)
    prompt_lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64)[:, None]
    mask = ((cols[:, :-1] >= prompt_lens - 1) & (cols[:, :-1] < lens[:, None] - 1)).to(torch.float32)
    positions = torch.clamp(torch.cumsum(seg, -1) - 1, min=0)
    return tokens, positions, seg, mask
