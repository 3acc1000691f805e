"""Sequence packing: variable-length samples into token-budget micro-batches (pure).

A RolloutBuffer holds one sample per right-padded row. Padding costs compute in
proportion to max_len / mean_len, which on RL batches is often 4x or more. Here
samples are packed several to a row, first-fit-decreasing, into rows of
`row_len` tokens, and rows are grouped into micro-batches of at most
`max_tokens` padded tokens (rows x width <= max_tokens). Inside a row each
sample has its own segment id (1, 2, ...; 0 = padding) and positions that
restart at 0, so `model.causal_segment_mask` makes attention block-diagonal and
causal: no sample sees another.

Log-prob column t predicts token t+1. In a packed row the column at a sample's
last token would predict the next sample's first token; every per-token field
(loss_mask, old_logprobs, advantages, ref_logprobs) is zero there, so no loss
crosses a boundary.

For flash-attn's varlen kernels the micro-batch also carries `cu_seqlens`
(int32 [K+1]) and `max_seqlen` over the flattened tokens `tokens.reshape(-1)`:
every sample is one sequence and every row's padding tail is one sequence of
its own (its outputs are masked). With row_len = max_tokens a micro-batch is a
single row, exactly the THD layout flash_attn_varlen_func takes.

The whole batch's normalisers ride along (`num_tokens`, `num_samples`) so that
the losses of micro-batches, each divided by the whole batch's count, sum to
the whole-batch loss (see `aggregate` and `train.train_step_accumulated`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from miles_fn import losses
from state.train_state import RolloutBuffer


class PackedBatch(NamedTuple):
    """One micro-batch of packed samples; field names match RolloutBuffer where they mean the same."""

    tokens: torch.Tensor  # [R, L] int64
    positions: torch.Tensor  # [R, L] int64, restarting at 0 in every sample
    segment_ids: torch.Tensor  # [R, L] int64, 1..k within a row, 0 = padding
    loss_mask: torch.Tensor  # [R, L-1] float32, 0 at sample boundaries and padding
    old_logprobs: torch.Tensor  # [R, L-1]
    advantages: torch.Tensor  # [R, L-1]
    rewards: torch.Tensor  # [S] per sample, in sample order
    group_ids: torch.Tensor  # [S]
    sample_index: torch.Tensor  # [S] int64: the sample's row in the source RolloutBuffer
    starts: torch.Tensor  # [S] int64: the sample's first token in tokens.reshape(-1)
    lengths: torch.Tensor  # [S] int64: tokens of the sample
    cu_seqlens: torch.Tensor  # [K+1] int32 over tokens.reshape(-1) (flash-attn varlen)
    max_seqlen: int
    num_tokens: torch.Tensor  # float32 scalar: loss-mask tokens of the WHOLE batch
    num_samples: torch.Tensor  # float32 scalar: samples of the WHOLE batch
    ref_logprobs: torch.Tensor | None = None  # [R, L-1]


class _Sample(NamedTuple):
    """One sample cut out of its row: tokens/positions [n], per-token fields [n-1]."""

    index: int
    tokens: torch.Tensor
    positions: torch.Tensor
    columns: dict[str, torch.Tensor]  # loss_mask, old_logprobs, advantages[, ref_logprobs]
    reward: torch.Tensor
    group_id: torch.Tensor


_COLUMN_FIELDS = ("loss_mask", "old_logprobs", "advantages", "ref_logprobs")


def sample_lengths(segment_ids: torch.Tensor) -> list[int]:
    """Tokens per right-padded row; refuses rows whose non-padding is not a prefix."""
    valid = segment_ids != 0
    lengths = valid.sum(-1).tolist()
    for i, n in enumerate(lengths):
        if n == 0:
            raise ValueError(f"row {i} of the batch is empty (segment_ids all 0): nothing to pack")
        if not bool(valid[i, :n].all()):
            raise ValueError(f"row {i} of the batch is not right-padded (segment_ids has padding inside the sample)")
    return lengths


def plan(lengths: Sequence[int], max_tokens: int, row_len: int | None = None) -> list[list[list[int]]]:
    """Micro-batches -> rows -> sample indices, first-fit-decreasing; deterministic.

    Samples are taken longest first (ties by index) and each goes into the first
    row with room; rows are then grouped max_tokens // row_len to a micro-batch.
    row_len defaults to the longest sample, so no row attends over more tokens
    than the right-padded layout would; row_len = max_tokens gives one row per
    micro-batch (the flash-attn varlen layout).
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens_per_micro_batch must be positive, got {max_tokens}")
    if row_len is not None and row_len > max_tokens:
        raise ValueError(f"pack_row_len={row_len} exceeds max_tokens_per_micro_batch={max_tokens}")
    row_len = max(lengths, default=0) if row_len is None else row_len
    for i, n in enumerate(lengths):
        if n > min(row_len, max_tokens):
            what = f"max_tokens_per_micro_batch={max_tokens}" if n > max_tokens else f"pack_row_len={row_len}"
            raise ValueError(f"sample {i} has {n} tokens, more than {what}; raise it or shorten the sample")
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for r, f in enumerate(fill):
            if f + lengths[i] <= row_len:
                rows[r].append(i)
                fill[r] += lengths[i]
                break
        else:
            rows.append([i])
            fill.append(lengths[i])
    per_mb = max(1, max_tokens // max(row_len, 1))
    return [rows[k : k + per_mb] for k in range(0, len(rows), per_mb)]


def whole_batch_counts(buffer: RolloutBuffer) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss-mask tokens, samples) of the whole batch: the buffer's own, or the counts it carries
    when it is a cut of a larger batch (rollout_buffer.gradient_rows)."""
    if buffer.num_tokens is not None and buffer.num_samples is not None:
        return buffer.num_tokens.to(torch.float32), buffer.num_samples.to(torch.float32)
    return buffer.loss_mask.sum().to(torch.float32), torch.tensor(float(buffer.loss_mask.shape[0]))


def pack(buffer: RolloutBuffer, max_tokens: int, row_len: int | None = None) -> list[PackedBatch]:
    """The batch as packed micro-batches under a budget of max_tokens padded tokens each."""
    lengths = sample_lengths(buffer.segment_ids)
    samples = [_cut(buffer, i, n) for i, n in enumerate(lengths)]
    num_tokens, num_samples = whole_batch_counts(buffer)
    return [
        _build([[samples[i] for i in row] for row in rows], num_tokens, num_samples)
        for rows in plan(lengths, max_tokens, row_len)
    ]


def pad(buffer: RolloutBuffer, max_tokens: int) -> list[PackedBatch]:
    """The right-padded layout cut into micro-batches: one sample a row, every row the batch's full width.

    The baseline packing is measured against (bench/packing.py), and a layout for attention
    backends that take one sequence a row; max_tokens // width rows a micro-batch.
    """
    lengths = sample_lengths(buffer.segment_ids)
    width = buffer.tokens.shape[1]
    if width > max_tokens:
        raise ValueError(f"rows of {width} tokens exceed max_tokens_per_micro_batch={max_tokens}")
    samples = [_cut(buffer, i, n) for i, n in enumerate(lengths)]
    num_tokens, num_samples = whole_batch_counts(buffer)
    per_mb = max_tokens // width
    return [
        _build([[x] for x in samples[k : k + per_mb]], num_tokens, num_samples, width)
        for k in range(0, len(samples), per_mb)
    ]


def split(batch: PackedBatch) -> tuple[PackedBatch, PackedBatch]:
    """Two micro-batches holding the first and second half of batch's samples (for OOM retries).

    Each half is re-packed first-fit-decreasing into rows no wider than batch's;
    the whole-batch normalisers are kept, so the halves' losses sum to batch's.
    """
    s = int(batch.lengths.numel())
    if s < 2:
        raise ValueError("a micro-batch of one sample cannot be split")
    samples = _samples_of(batch)
    width = batch.tokens.shape[1]
    halves = []
    for part in (samples[: s // 2], samples[s // 2 :]):
        rows = plan([int(x.tokens.numel()) for x in part], width * len(part), width)[0]  # one micro-batch
        halves.append(_build([[part[i] for i in row] for row in rows], batch.num_tokens, batch.num_samples))
    return halves[0], halves[1]


def sample_columns(x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Per-token values in packed layout [R, L-1] -> per-sample right-padded [S, Ts-1] (zeros past the end).

    Differentiable (a gather); the inverse of `packed_columns` on valid columns.
    """
    index, valid = _column_index(batch)
    flat = x.reshape(-1)
    return torch.where(valid, flat[index], torch.zeros((), dtype=x.dtype))


def packed_columns(x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Per-sample values [S, >=Ts-1] -> packed layout [R, L-1], zero at boundaries and padding."""
    r, width = batch.tokens.shape
    index, valid = _column_index(batch)
    out = torch.zeros(r * (width - 1), dtype=x.dtype)
    out[index[valid]] = x[:, : index.shape[1]][valid]
    return out.view(r, width - 1)


def unpack(values: Sequence[torch.Tensor], batches: Sequence[PackedBatch], n: int, t: int) -> torch.Tensor:
    """Packed per-token values, one [R, L-1] per micro-batch, back to the source layout [n, t-1] (0 on padding)."""
    out = torch.zeros(n, t - 1, dtype=values[0].dtype if values else torch.float32)
    for x, b in zip(values, batches, strict=True):
        per_sample = sample_columns(x, b)
        for j, i in enumerate(b.sample_index.tolist()):
            k = int(b.lengths[j]) - 1
            out[i, :k] = per_sample[j, :k]
    return out


def normalizer(batch: RolloutBuffer | PackedBatch, mode: str) -> torch.Tensor | None:
    """The whole batch's count a loss divides by, or None for a whole batch (local counts).

    token_mean -> loss-mask tokens of the whole batch; seq_mean_* -> its samples. Set on every
    micro-batch, and on a buffer cut to its gradient rows (rollout_buffer.gradient_rows).
    """
    if batch.num_tokens is None or batch.num_samples is None:
        return None
    return batch.num_tokens if mode == "token_mean" else batch.num_samples


def aggregate(per_token: torch.Tensor, batch: RolloutBuffer | PackedBatch, mode: str = "token_mean") -> torch.Tensor:
    """losses.aggregate for whole batches; for a micro-batch, its share of the whole batch's value.

    token_mean:          sum_{r,t} m l / N_tokens(whole batch)
    seq_mean_token_mean: sum_{s in micro-batch} (sum_{t in s} m l / sum_{t in s} m) / N_samples(whole batch)
    Summed over the micro-batches of a batch, either equals losses.aggregate on the whole batch.
    """
    if not isinstance(batch, PackedBatch):
        d = normalizer(batch, mode)
        return losses.aggregate(per_token, batch.loss_mask, mode, None if d is None else torch.clamp(d, min=1.0))
    mask = batch.loss_mask
    x = torch.where(mask > 0, per_token, torch.zeros_like(per_token))
    if mode == "token_mean":
        return x.sum() / torch.clamp(normalizer(batch, mode), min=1.0)
    if mode == "seq_mean_token_mean":
        per_seq = sample_columns(x, batch).sum(-1) / torch.clamp(sample_columns(mask, batch).sum(-1), min=1.0)
        return per_seq.sum() / torch.clamp(normalizer(batch, mode), min=1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}; choose token_mean or seq_mean_token_mean")


def token_share(aux: dict[str, torch.Tensor], batch: RolloutBuffer | PackedBatch) -> dict[str, torch.Tensor]:
    """Micro-batch token means -> shares of the whole batch's (x * local tokens / whole-batch tokens).

    Metrics of micro-batches are summed; this turns a local token mean into its summand.
    """
    if not isinstance(batch, PackedBatch):
        return aux
    share = batch.loss_mask.sum() / torch.clamp(batch.num_tokens, min=1.0)
    return {k: v * share for k, v in aux.items()}


def _cut(buffer: RolloutBuffer, i: int, n: int) -> _Sample:
    cols = {f: getattr(buffer, f)[i, : n - 1] for f in _COLUMN_FIELDS if getattr(buffer, f) is not None}
    return _Sample(i, buffer.tokens[i, :n], buffer.positions[i, :n], cols, buffer.rewards[i], buffer.group_ids[i])


def _samples_of(batch: PackedBatch) -> list[_Sample]:
    flat_tok, flat_pos = batch.tokens.reshape(-1), batch.positions.reshape(-1)
    r, width = batch.tokens.shape
    flat_cols = {f: getattr(batch, f).reshape(-1) for f in _COLUMN_FIELDS if getattr(batch, f) is not None}
    out = []
    for j, (s, n) in enumerate(zip(batch.starts.tolist(), batch.lengths.tolist(), strict=True)):
        c = (s // width) * (width - 1) + s % width  # the sample's first column in the flattened [R, L-1]
        cols = {f: v[c : c + n - 1] for f, v in flat_cols.items()}
        out.append(_Sample(int(batch.sample_index[j]), flat_tok[s : s + n], flat_pos[s : s + n], cols,
                           batch.rewards[j], batch.group_ids[j]))
    return out


def _build(
    rows: list[list[_Sample]], num_tokens: torch.Tensor, num_samples: torch.Tensor, width: int | None = None
) -> PackedBatch:
    width = width or max(sum(int(x.tokens.numel()) for x in row) for row in rows)
    r = len(rows)
    tokens = torch.zeros(r, width, dtype=torch.int64)
    positions = torch.zeros(r, width, dtype=torch.int64)
    seg = torch.zeros(r, width, dtype=torch.int64)
    fields = [f for f in _COLUMN_FIELDS if f in rows[0][0].columns]
    cols = {f: torch.zeros(r, max(width - 1, 0), dtype=rows[0][0].columns[f].dtype) for f in fields}
    order: list[_Sample] = []
    starts, lengths, cu = [], [], [0]
    for ri, row in enumerate(rows):
        o = 0
        for k, x in enumerate(row):
            n = int(x.tokens.numel())
            tokens[ri, o : o + n] = x.tokens
            positions[ri, o : o + n] = x.positions
            seg[ri, o : o + n] = k + 1
            for f in fields:
                cols[f][ri, o : o + n - 1] = x.columns[f]  # column o+n-1 (the boundary) stays 0
            order.append(x)
            starts.append(ri * width + o)
            lengths.append(n)
            o += n
            cu.append(ri * width + o)
        if o < width:
            cu.append((ri + 1) * width)  # the padding tail is a sequence of its own
    cu_t = torch.tensor(cu, dtype=torch.int32)
    return PackedBatch(
        tokens=tokens,
        positions=positions,
        segment_ids=seg,
        loss_mask=cols["loss_mask"],
        old_logprobs=cols["old_logprobs"],
        advantages=cols["advantages"],
        rewards=torch.stack([x.reward for x in order]),
        group_ids=torch.stack([x.group_id for x in order]),
        sample_index=torch.tensor([x.index for x in order], dtype=torch.int64),
        starts=torch.tensor(starts, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int64),
        cu_seqlens=cu_t,
        max_seqlen=int((cu_t[1:] - cu_t[:-1]).max()),
        num_tokens=num_tokens,
        num_samples=num_samples,
        ref_logprobs=cols.get("ref_logprobs"),
    )


def _column_index(batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """([S, Ts-1] index into the flattened [R*(L-1)] columns, valid mask)."""
    width = batch.tokens.shape[1]
    first = (batch.starts // width) * (width - 1) + batch.starts % width
    span = max(int(batch.lengths.max()) - 1, 0)
    c = torch.arange(span)
    valid = c[None, :] < (batch.lengths[:, None] - 1)
    return torch.where(valid, first[:, None] + c[None, :], torch.zeros((), dtype=torch.int64)), valid
