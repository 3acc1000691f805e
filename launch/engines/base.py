"""The one interface the loop sees for a rollout engine, whatever runs it (this process, a server, SGLang).

Token in, token out: a request is prompt ids, a sample is the response ids exactly as the engine
produced them, their log-probs, why generation stopped, and the weight version that produced them.

Per-request randomness: request `rid` of a batch drawn with key K samples from the key
fold_in(K, rid). That key travels as one 64-bit integer (`sampling_seed`, words k0, k1 ->
k0 * 2**32 + k1, inverted exactly by prng.key), so the same request gives the same tokens in
whichever process or batch runs it. Float results still depend on which requests share a forward
pass (CPU kernels are not batch invariant), so every engine cuts a request list into the same
consecutive chunks of `batch_size` and runs each chunk as one batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, TypeVar, runtime_checkable

import torch

from miles_fn import prng
from miles_fn.sampling import SamplingConfig

T = TypeVar("T")


class EngineError(Exception):
    """The engine cannot produce a complete batch (server gone, bad reply): the run stops, naming why."""


class Request(NamedTuple):
    rid: int  # unique within the batch; names the key stream
    input_ids: list[int]  # prompt tokens
    seed: int  # the request's key as a 64-bit integer (see request_seed)


class SpecInfo(NamedTuple):
    """How a speculating engine produced one sample (never what it produced: that is plain decoding's).

    histogram[j]: the verify forwards of this request that accepted exactly j draft tokens (j = 0..k);
    draft_version: the draft weights that proposed them (SGLang-style meta_info.spec_accept_histogram)."""

    histogram: tuple[int, ...]
    draft_version: int
    plain: int = 0  # decode steps taken without drafts (--speculative_disable_by_batch_size)


class Sample(NamedTuple):
    tokens: list[int]  # response ids, the stop token included when one was hit
    logprobs: list[float]  # one per response token
    finish_reason: str  # "stop" or "length"
    weight_version: int  # the weights that produced every token of it
    routed_experts: Any = None  # MoE: [P + R - 1, L_moe, k] int32, the experts run per token (R3)
    spec: SpecInfo | None = None  # speculative decoding: acceptance counts (None: decoded plainly)


class SpecDraft(NamedTuple):
    """A draft LM as an engine holds it: its config, weights, their version and k (draft tokens per verify)."""

    cfg: Any  # miles_fn.config.ModelConfig
    params: Any
    version: int
    num_steps: int
    disable_by_batch_size: int = 0  # rounds with more live rows decode plainly (0: always speculate)


class Batch(NamedTuple):
    """A batch of samples in request order, as columns (what the loop consumes)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    weight_versions: list[int]
    routed_experts: list | None = None  # per sample, where the engine recorded them (MoE, R3)


@runtime_checkable
class Engine(Protocol):
    """What the loop needs from a rollout engine. `generate` returns every sample or raises
    EngineError: a partial batch is never returned."""

    @property
    def version(self) -> int: ...

    def generate(self, requests: Sequence[Request], sampling: SamplingConfig) -> list[Sample]: ...

    def update_weights(self, version: int, params: object) -> None: ...

    def health(self) -> bool: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def flush_cache(self) -> None: ...

    def close(self) -> None: ...


def request_seed(key: prng.Key, rid: int) -> int:
    """The 64-bit seed of request `rid` under batch key `key`: the words of fold_in(key, rid)."""
    return request_seeds(key, [rid])[0]


def request_seeds(key: prng.Key, rids: Sequence[int]) -> list[int]:
    """request_seed of every rid in one vectorised fold_in (one Threefry call, not one per request)."""
    if not rids:
        return []
    words = prng.fold_in(key, torch.tensor(list(rids), dtype=torch.int64)).tolist()
    return [(k0 << 32) | k1 for k0, k1 in words]


def seed_keys(seeds: Sequence[int]) -> torch.Tensor:
    """Per-request keys [B, 2] from 64-bit seeds (the inverse of request_seed)."""
    for s in seeds:
        if not 0 <= s < 2**64:
            raise ValueError(f"a sampling seed must be in [0, 2**64), got {s}")
    return torch.tensor([[s >> 32, s & 0xFFFFFFFF] for s in seeds], dtype=torch.int64).reshape(-1, 2)


def make_requests(prompts: Sequence[Sequence[int]], key: prng.Key, request_ids: Sequence[int] | None = None
                  ) -> list[Request]:
    ids = list(request_ids) if request_ids is not None else list(range(len(prompts)))
    if len(ids) != len(prompts):
        raise ValueError(f"make_requests: {len(ids)} request ids for {len(prompts)} prompts")
    return [Request(rid, list(p), seed) for rid, p, seed in zip(ids, prompts, request_seeds(key, ids), strict=True)]


def chunked(items: Sequence[T], size: int) -> list[list[T]]:
    """Consecutive chunks of `size` (0 = one chunk): the batches every engine runs."""
    if size <= 0 or size >= len(items):
        return [list(items)] if items else []
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def generate_batch(engine: Engine, prompts: Sequence[Sequence[int]], key: prng.Key, sampling: SamplingConfig
                   ) -> Batch:
    """Prompts in, a complete Batch out (request i is prompts[i], keyed by fold_in(key, i))."""
    samples = engine.generate(make_requests(prompts, key), sampling)
    if len(samples) != len(prompts):
        raise EngineError(f"engine returned {len(samples)} samples for {len(prompts)} requests")
    routes = [s.routed_experts for s in samples]
    return Batch([s.tokens for s in samples], [s.logprobs for s in samples], [s.finish_reason for s in samples],
                 [s.weight_version for s in samples], None if any(r is None for r in routes) else routes)


class SpecMeter:
    """A speculating engine's acceptance counts and rollout tokens/s since the last take (the step's metrics)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, ...]] = []
        self.emitted = self.tokens = self.plain = 0
        self.seconds = 0.0

    def record(self, samples: Sequence[Sample], seconds: float) -> None:
        for s in samples:
            if s.spec is not None:
                self.rows.append(s.spec.histogram)
                self.plain += s.spec.plain
                # the first token of each comes from the prefill, and a plain step's from no verify
                self.emitted += len(s.tokens) - 1 - s.spec.plain
        self.tokens += sum(len(s.tokens) for s in samples)
        self.seconds += seconds

    def take(self) -> dict[str, float]:
        """spec_accept_length (tokens per verify), spec_accept_rate, spec_accept_pos_j, spec_plain_frac (the
        decode forwards that did not speculate); and time_rollout_tokens_per_s (wall clock, so it goes to
        timings.jsonl)."""
        from miles_fn.speculative import SpecStats

        st, out = SpecStats.from_rows(self.rows, self.emitted), {}
        if st.verifies:
            out = {"spec_accept_length": st.tokens_per_verify, "spec_accept_rate": st.accept_rate,
                   **{f"spec_accept_pos_{j + 1}": a for j, a in enumerate(st.accept_by_position)}}
        if st.verifies or self.plain:
            out["spec_plain_frac"] = self.plain / (self.plain + st.verifies)
        if self.seconds > 0:
            out["time_rollout_tokens_per_s"] = self.tokens / self.seconds
        self.__init__()
        return out
