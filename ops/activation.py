"""SiLU. torch's fused silu is not position-invariant on CPU: its SIMD body and scalar
tail round differently (on this AVX512 machine ~4% of elements change with their offset
in the tensor), so the invariant form is built from exp and IEEE division, which are.

    silu(x) = x / (1 + exp(-x))
"""

from __future__ import annotations

import torch

from ops.config import REFERENCE, OpsConfig


def silu(x: torch.Tensor, cfg: OpsConfig = REFERENCE) -> torch.Tensor:
    if cfg.invariant:
        return x / (1.0 + torch.exp(-x))
    return torch.nn.functional.silu(x)
