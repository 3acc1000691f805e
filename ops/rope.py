"""Rotary position embeddings (the rotate-half convention of transformers)."""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [*positions.shape, head_dim], in float32."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exps)
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """What apply_rope takes, once per forward: cos and the signed sin [-sin | sin], as [B, 1, T, D].

    rotate_half(x) * sin = [-x2, x1] * [s, s] = [x2, x1] * [-s, s] = roll(x, D/2) * signed sin, exactly
    (a sign flip rounds nothing), so apply_rope needs one roll instead of a split, a negation and a cat.
    """
    cos, sin = rope_cos_sin(positions, head_dim, theta)
    h = head_dim // 2
    signed = torch.cat([-sin[..., :h], sin[..., h:]], dim=-1)
    return cos.unsqueeze(-3).to(dtype), signed.unsqueeze(-3).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos, signed_sin: [B, 1, T, D] from rope_tables. Equals x*cos + rotate_half(x)*sin."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin
