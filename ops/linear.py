"""Linear layers in the Hugging Face weight layout ([out, in]).

reference: one F.linear (GEMM and bias in one call) over all rows. The BLAS picks its kernel (and so its
reduction order over `in`) from the row count: on this machine's MKL a call with 1-7
rows rounds differently from one with 16+, so a row's output depends on its batch.

invariant: rows are cut into tiles of exactly `tile_rows` (the last one zero-padded)
and each tile is one GEMM of the same shape [tile_rows, in] x [in, out], issued as one
batched call (bmm: independent same-shape GEMMs). Every row then goes through the same
kernel with the same reduction order, wherever it sits and however many tiles there are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ops.config import REFERENCE, OpsConfig


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, cfg: OpsConfig = REFERENCE
) -> torch.Tensor:
    """y = x W^T + b over the last dim of x; x [..., in], weight [out, in]."""
    if cfg.gemm_backend == "deep_gemm":
        y = _deep_gemm(x, weight)
    elif cfg.invariant:
        y = _TiledLinear.apply(x, weight, cfg.tile_rows)
    else:
        return F.linear(x, weight, bias)
    return y if bias is None else y + bias


def tiled_matmul(x: torch.Tensor, weight: torch.Tensor, tile_rows: int) -> torch.Tensor:
    """x W^T with every GEMM call of shape [tile_rows, in]: the row result is independent of the batch."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    n = rows.shape[0]
    pad = (-n) % tile_rows
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, k)])
    tiles = rows.view(-1, tile_rows, k)
    out = torch.bmm(tiles, weight.t().unsqueeze(0).expand(tiles.shape[0], k, weight.shape[0]))
    return out.reshape(-1, weight.shape[0])[:n].reshape(*lead, weight.shape[0])


class _TiledLinear(torch.autograd.Function):
    """Forward: the tiled GEMM. Backward: plain matmuls (gradients need not be batch-invariant).

    dx = dy W,  dW = dy^T x  (rows flattened).
    """

    @staticmethod
    def forward(x, weight, tile_rows):
        return tiled_matmul(x, weight, tile_rows)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, _ = inputs
        ctx.save_for_backward(x, weight)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        return dy @ weight, dy2.t() @ x.reshape(-1, x.shape[-1]), None


def fp8_quantize_rows(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row, per-`block`-column FP8 (e4m3) scaling, the activation layout DeepGEMM expects.

    scale[r, j] = max |x[r, j*block:(j+1)*block]| / 448;  q = x / scale.
    """
    m, k = x.shape
    pad = (-k) % block
    xp = torch.nn.functional.pad(x.float(), (0, pad)).view(m, -1, block)
    amax = xp.abs().amax(-1).clamp(min=1e-4)
    q = (xp * (448.0 / amax[..., None])).to(torch.float8_e4m3fn).view(m, k + pad)[:, :k]
    return q.contiguous(), amax / 448.0


def fp8_quantize_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(block x block) FP8 scaling of a weight [out, in], DeepGEMM's weight layout."""
    n, k = w.shape
    pn, pk = (-n) % block, (-k) % block
    wp = torch.nn.functional.pad(w.float(), (0, pk, 0, pn)).view((n + pn) // block, block, (k + pk) // block, block)
    amax = wp.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4)
    q = (wp * (448.0 / amax)).to(torch.float8_e4m3fn).view(n + pn, k + pk)[:n, :k]
    return q.contiguous(), (amax / 448.0).view((n + pn) // block, (k + pk) // block)


def _deep_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """FP8 x FP8 -> BF16 GEMM on DeepGEMM (quantizing on the fly; a serving stack keeps W in FP8)."""
    import third_party

    dg = third_party.require("deep_gemm", "--gemm_backend=deep_gemm")
    lead, k = x.shape[:-1], x.shape[-1]
    a, sa = fp8_quantize_rows(x.reshape(-1, k))
    b, sb = fp8_quantize_blocks(weight)
    out = torch.empty(a.shape[0], weight.shape[0], device=x.device, dtype=torch.bfloat16)
    if hasattr(dg, "fp8_gemm_nt"):  # DeepGEMM >= 2.0
        dg.fp8_gemm_nt((a, sa), (b, sb), out)
    else:  # DeepGEMM 1.x wants the activation scales column-major and TMA-aligned
        sa = dg.get_col_major_tma_aligned_tensor(sa)
        dg.gemm_fp8_fp8_bf16_nt((a, sa), (b, sb), out)
    return out.to(x.dtype).reshape(*lead, weight.shape[0])
