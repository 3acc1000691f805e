"""Log-probabilities of given target tokens."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[targets], in float32; logits [..., V], targets [...]."""
    lp = torch.log_softmax(logits.to(torch.float32) / temperature, dim=-1)
    return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
