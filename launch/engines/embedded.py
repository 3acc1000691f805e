"""The embedded rollout engine: miles_fn.generate in this process, behind the engine interface."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_fn import prng
from miles_fn.config import ModelConfig
from miles_fn.generate import Generation, generate
from miles_fn.sampling import SamplingConfig


class EmbeddedEngine:
    """Holds a reference to the current weights; update_weights swaps it and bumps the version."""

    def __init__(self, cfg: ModelConfig, params: Any, version: int = 0):
        self.cfg = cfg
        self.params = params
        self.version = version

    def update_weights(self, version: int, params: Any) -> None:
        self.params = params
        self.version = version

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        key: prng.Key,
        sampling: SamplingConfig,
        request_ids: Sequence[int] | None = None,
    ) -> Generation:
        return generate(self.params, self.cfg, prompts, key, sampling, request_ids)

    def health(self) -> bool:
        return True
