"""Log-probabilities of given target tokens.

invariant: log-sum-exp written out as row reductions over a contiguous [rows, V] view,
    lp = (x_t - m) - log sum_v exp(x_v - m),  m = max_v x_v,  x = logits / temperature,
so the engine's [B, V] decode logits and the trainer's [N, T, V] logits give equal bits.
"""

from __future__ import annotations

import torch

from ops.config import REFERENCE, OpsConfig


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, cfg: OpsConfig = REFERENCE
) -> torch.Tensor:
    """log softmax(logits / temperature)[targets], in float32; logits [..., V], targets [...]."""
    x = logits.to(torch.float32) / temperature
    if not cfg.invariant:
        lp = torch.log_softmax(x, dim=-1)
        return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    lead, v = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, v).contiguous()
    z = rows - rows.amax(-1, keepdim=True)
    lse = torch.log(torch.exp(z).sum(-1))
    picked = z.gather(-1, targets.reshape(-1, 1)).squeeze(-1)
    return (picked - lse).reshape(lead)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H = -sum_v p_v log p_v of softmax(logits / temperature) over the whole vocabulary: [..., V] -> [...].

    Computed in float32 at least (float64 input stays float64).
    """
    lp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    return -(lp.exp() * lp).sum(-1)
