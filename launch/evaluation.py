"""Sampled evaluation: pass@k on the held-out prompts (`--eval_pass_k`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from launch.engines.base import Engine, generate_batch
from miles_fn import prng
from miles_fn.sampling import SamplingConfig

PASS_K_STREAM = 0xE7A2  # the key of the evaluation samples: fixed, so every evaluation draws alike


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k) (Chen et al., 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def sampled_pass_at_k(engine: Engine, prompts: Sequence[Sequence[int]], labels: Sequence[Any],
                      score: Callable[[list[list[int]], list[list[int]], list[Any]], Sequence[float]],
                      sampling: SamplingConfig, n: int, ks: Sequence[int]) -> dict[str, float]:
    """Mean pass@k over prompts, n samples each (a sample passes when its score > 0).

    score(prompts, responses, labels) scores every sample at once, as a rollout is scored."""
    reqs = [list(p) for p in prompts for _ in range(n)]
    batch = generate_batch(engine, reqs, prng.key(PASS_K_STREAM), sampling)
    scores = list(score(reqs, batch.tokens, [lab for lab in labels for _ in range(n)]))
    correct = [sum(scores[i * n + j] > 0 for j in range(n)) for i in range(len(prompts))]
    return {f"eval_pass@{k}": sum(pass_at_k(n, c, k) for c in correct) / len(prompts) for k in ks}
