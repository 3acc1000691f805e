"""Token sampling from logits with explicit keys: temperature, top-k, top-p (nucleus)."""

from __future__ import annotations

import dataclasses

import torch

from miles_fn import prng


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    # Ids >= vocab_limit are never sampled (0 = every row of the logits). Checkpoints pad their vocabulary
    # (Qwen2.5: 151,936 rows for 151,665 tokens): the rows past the tokenizer's length are no tokens.
    vocab_limit: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.vocab_limit < 0:
            raise ValueError(f"vocab_limit must be >= 0 (0 = no limit), got {self.vocab_limit}")

    @property
    def logprob_temperature(self) -> float:
        """The temperature the reported log-probs use (1 for greedy decoding)."""
        return self.temperature if self.temperature > 0 else 1.0

    def limits(self, vocab: int) -> bool:
        """Whether vocab_limit removes rows from logits of `vocab` columns."""
        return 0 < self.vocab_limit < vocab


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus to -inf; the argmax always survives."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, keys: prng.Key, cfg: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of logits [B, V] with per-row keys [B, 2] (inverse CDF, one uniform a row).

    Returns (tokens [B], log-probs [B] under softmax(logits / logprob_temperature) over every row,
    before top-k/top-p truncation and the vocab_limit cut: the distribution the trainer recomputes).
    """
    u = None if cfg.temperature == 0 else prng.uniform64(keys)
    return sample_with_uniform(logits, u, cfg)


def sample_with_uniform(
    logits: torch.Tensor, u: torch.Tensor | None, cfg: SamplingConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` with its uniforms [B] in [0, 1) drawn beforehand (None when greedy).

    The token is the first whose cumulative probability exceeds u. One random number a row, where
    Gumbel-max needs one a vocabulary entry (150k Threefry calls a token for a real tokenizer).
    The CDF is float64 and divided by its last entry, which is then exactly 1 > u: the pick is
    always a token of non-zero probability, and the one a float64 reference of the CDF picks.

    With cfg.vocab_limit the pick (argmax, or the CDF renormalised) runs over the first vocab_limit
    columns only, as if the others were -inf; the log-prob stays the full-row one, which the trainer's
    full-row log_softmax recomputes exactly (they differ from the cut distribution's by log(1 - p_cut)).
    """
    scaled = logits.to(torch.float32) / cfg.logprob_temperature
    logp = torch.log_softmax(scaled, dim=-1)
    cut = cfg.limits(scaled.shape[-1])
    pick = scaled[..., : cfg.vocab_limit] if cut else scaled
    if cfg.temperature == 0:
        tokens = torch.argmax(pick, dim=-1)
    else:
        if cfg.top_k > 0 or cfg.top_p < 1.0:
            probs = torch.softmax(filter_logits(pick, cfg.top_k, cfg.top_p), dim=-1)
        else:  # renormalised in float32 when cut: the kept rows' mass may be far below 1
            probs = torch.softmax(pick, dim=-1) if cut else logp.exp()
        cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
        cdf = cdf / cdf[..., -1:]
        tokens = torch.searchsorted(cdf, u.to(torch.float64).contiguous()[..., None], right=True).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
