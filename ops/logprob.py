"""Log-probabilities of given target tokens."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[targets], in float32; logits [..., V], targets [...]."""
    lp = torch.log_softmax(logits.to(torch.float32) / temperature, dim=-1)
    return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H = -sum_v p_v log p_v of softmax(logits / temperature) over the whole vocabulary: [..., V] -> [...].

    Computed in float32 at least (float64 input stays float64).
    """
    lp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    return -(lp.exp() * lp).sum(-1)
