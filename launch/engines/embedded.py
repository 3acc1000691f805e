"""The embedded rollout engine: miles_fn.generate in this process, behind the engine interface."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ops
from launch.engines.base import Request, Sample, SpecDraft, SpecInfo, chunked, seed_keys
from miles_fn.config import ModelConfig
from miles_fn.generate import generate_rows
from miles_fn.prefix_cache import PrefixCache
from miles_fn.sampling import SamplingConfig
from miles_fn.speculative import generate_speculative_rows


class EmbeddedEngine:
    """Holds a reference to the current weights; update_weights swaps it and bumps the version.

    Runs requests in consecutive chunks of `batch_size` (0 = all at once), the same chunks a
    server-backed engine sends, so both give bitwise the same samples. Its prefix cache (prefix_cache_mb)
    keeps prompts' turns across calls until the weights change: faster calls, the same samples.
    """

    computes_on_trainer_params = True  # it generates from the trainer's tensors: offload must leave them

    def __init__(self, cfg: ModelConfig, params: Any, version: int = 0, batch_size: int = 0,
                 ops_cfg: ops.OpsConfig = ops.REFERENCE, prefix_cache_mb: int = 0):
        self.cfg = cfg
        self.params = params
        self.version = version
        self.batch_size = batch_size
        self.ops_cfg = ops_cfg  # the kernels; ops.INVARIANT makes its log-probs the trainer's bit for bit
        self.prefix_cache = PrefixCache(prefix_cache_mb << 20)

    def update_weights(self, version: int, params: Any) -> None:
        self.params = params
        self.version = version
        self.prefix_cache.clear()  # the old weights' entries could never be asked for again

    def generate(self, requests: Sequence[Request], sampling: SamplingConfig) -> list[Sample]:
        out: list[Sample] = []
        for chunk in chunked(requests, self.batch_size):
            out.extend(run_chunk(self.params, self.cfg, chunk, sampling, self.version, self.ops_cfg,
                                 prefix_cache=self.prefix_cache))
        return out

    def health(self) -> bool:
        return True

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def flush_cache(self) -> None:
        self.prefix_cache.clear()

    def close(self) -> None:
        pass


def run_chunk(params: Any, cfg: ModelConfig, chunk: Sequence[Request], sampling: SamplingConfig, version: int,
              ops_cfg: ops.OpsConfig = ops.REFERENCE, draft: SpecDraft | None = None,
              prefix_cache: PrefixCache | None = None) -> list[Sample]:
    """One chunk as one batch: what the embedded engine and the rollout server both run. With a draft it
    speculates (miles_fn.speculative): the same tokens and log-probs, each sample with its acceptance counts.
    `prefix_cache` (miles_fn.prefix_cache) only makes it faster."""
    prompts, keys = [r.input_ids for r in chunk], seed_keys([r.seed for r in chunk])
    if draft is not None:
        gen, stats = generate_speculative_rows(params, cfg, draft.params, draft.cfg, prompts, keys, sampling,
                                               draft.num_steps, ops_cfg=ops_cfg,
                                               disable_by_batch_size=draft.disable_by_batch_size,
                                               prefix_cache=prefix_cache)
        return [Sample(t, lp, f, version, spec=SpecInfo(h, draft.version, p))
                for t, lp, f, h, p in zip(gen.tokens, gen.logprobs, gen.finish_reasons, stats.rows, stats.plain,
                                          strict=True)]
    gen = generate_rows(params, cfg, prompts, keys, sampling, ops_cfg=ops_cfg, prefix_cache=prefix_cache)
    routes = gen.routed_experts or [None] * len(gen.tokens)  # MoE models: the experts run per token (R3)
    return [Sample(t, lp, f, version, r)
            for t, lp, f, r in zip(gen.tokens, gen.logprobs, gen.finish_reasons, routes, strict=True)]
