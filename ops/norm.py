"""RMSNorm, computed in float32 as transformers' Qwen2/Llama do.

Both implementations reduce along the row only; the invariant one makes the row
contiguous first, so the reduction kernel sees the same length and stride for a row
wherever it came from (a decode step's [B, 1, H] or a training batch's [N, T, H]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ops.config import REFERENCE, OpsConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cfg: OpsConfig = REFERENCE) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim."""
    dtype = x.dtype
    if not cfg.invariant and dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one kernel; float32 all through, as below
    h = x.to(torch.float32)
    if cfg.invariant:
        h = h.contiguous()
        ms = (h * h).sum(-1, keepdim=True) / h.shape[-1]
    else:
        ms = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(ms + eps)
    return weight * h.to(dtype)
