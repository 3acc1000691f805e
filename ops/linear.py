"""Linear layers in the Hugging Face weight layout ([out, in])."""

from __future__ import annotations

import torch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = torch.matmul(x, weight.t())
    return y if bias is None else y + bias
