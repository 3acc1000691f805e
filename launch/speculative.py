"""The shell side of speculative decoding (--speculative_algorithm=STANDALONE): the draft's start, the engine
that speculates, the draft's weight sync and the per-step metrics.

The math lives in miles_fn/speculative.py (decoding) and miles_fn/draft.py (online training); the state is
state.train_state.SpeculativeState, so checkpoints, resume, snapshots and replay carry the draft as they carry
the policy. The embedded engine speculates here; a rollout server (--rollout_backend=http, one or a fleet)
speculates in its process with the draft sent after each update (launch/engines/remote.py, fleet.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import ops
from launch.engines.base import Request, Sample, SpecDraft, SpecMeter, chunked
from launch.engines.embedded import EmbeddedEngine, run_chunk
from miles_fn import draft, model, optim, prng, train
from miles_fn.config import ModelConfig
from miles_fn.sampling import SamplingConfig
from miles_fn.speculative import check_draft
from state.train_state import SpeculativeState

DRAFT_STREAM = 0xD2AF  # the random draft's init: fold_in(root, DRAFT_STREAM); fixed forever


def draft_model(spec: draft.SpeculativeConfig, target: ModelConfig, root: prng.Key) -> tuple[ModelConfig, Any]:
    """The start-of-run draft: --draft_checkpoint's LM, or a random one of the draft shape flags."""
    if spec.draft_checkpoint:
        from state import hf

        try:
            dcfg, params = hf.load_hf(spec.draft_checkpoint)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"--draft_checkpoint={spec.draft_checkpoint}: {type(e).__name__}: {e}") from e
    else:
        dcfg = draft.random_draft_config(spec, target)
        params = model.init_params(dcfg, prng.fold_in(root, DRAFT_STREAM))
    try:
        check_draft(target, dcfg, spec.num_steps)
    except ValueError as e:
        raise ValueError(f"--draft_checkpoint={spec.draft_checkpoint!r}: {e}") from e
    return dcfg, params


def draft_config(spec: draft.SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The draft's ModelConfig without its weights (what the update and replay need)."""
    if spec.draft_checkpoint:
        import json
        import os

        from miles_fn.config import from_hf_dict

        with open(os.path.join(spec.draft_checkpoint, "config.json")) as f:
            return from_hf_dict(json.load(f))
    return draft.random_draft_config(spec, target)


def draft_optim(spec: draft.SpeculativeConfig) -> optim.OptimConfig:
    return optim.OptimConfig(lr=spec.draft_lr, max_grad_norm=1.0)


def wrap_update(cfg: Any, update: Any) -> Any:
    """launch.rl.make_update's update, with the draft's online step after it when speculation is on."""
    spec = cfg.speculative
    if not spec.enabled:
        return update
    dcfg = draft_config(spec, cfg.model)
    spec_update = draft.with_draft(update, cfg.model, dcfg, draft_optim(spec), spec.train_steps,
                                   cfg.sampling.logprob_temperature, cfg.ops)

    def step(state: Any, buf: Any, key: prng.Key):
        if not isinstance(state, SpeculativeState):  # before the draft is attached (nothing else runs RL then)
            return update(state, buf, key)
        return spec_update(state, buf, key)

    return step


def attach(job: Any) -> None:
    """After the SFT warm-up: the run's state gains the draft (SpeculativeState), and the engine its weights."""
    spec = job.cfg.speculative
    if not spec.enabled or isinstance(job.state, SpeculativeState):
        return
    _, params = draft_model(spec, job.cfg.model, job.state.key)
    job.state = SpeculativeState(job.state, train.init_state(params, prng.fold_in(job.state.key, DRAFT_STREAM)))
    sync(job)


def sync(job: Any) -> None:
    """Ship the draft's current weights to a speculating engine (after each weight sync and on --resume)."""
    if isinstance(job.state, SpeculativeState) and hasattr(job.engine, "update_draft"):
        job.engine.update_draft(int(job.state.step), job.state.draft.params)


def server_draft(cfg: Any, state: Any) -> SpecDraft | None:
    """The draft a rollout server this run starts speculates with until the first sync: the one attach will
    give the state (the same key, so the same weights), or None without speculation or a server."""
    spec = cfg.speculative
    if not spec.enabled or cfg.rollout.backend != "http":
        return None
    dcfg, params = draft_model(spec, cfg.model, state.key)
    return SpecDraft(dcfg, params, int(state.step), spec.num_steps, spec.disable_by_batch_size)


def engine_for(cfg: Any, engine: Any) -> Any:
    """The embedded engine, speculating once it has a draft; other engines as they are."""
    if not cfg.speculative.enabled or not isinstance(engine, EmbeddedEngine):
        return engine
    return SpeculativeEngine(engine.cfg, engine.params, engine.version, engine.batch_size, engine.ops_cfg,
                             draft_config(cfg.speculative, engine.cfg), cfg.speculative.num_steps,
                             cfg.speculative.disable_by_batch_size, engine.prefix_cache.max_bytes >> 20)


class SpeculativeEngine(EmbeddedEngine):
    """The embedded engine with a draft: the same samples (miles_fn.speculative), sooner when the draft agrees.

    Until update_draft gives it weights it decodes plainly. take_stats returns the acceptance counts and the
    rollout tokens/s since the last call, for the step's metrics.
    """

    def __init__(self, cfg: ModelConfig, params: Any, version: int, batch_size: int, ops_cfg: ops.OpsConfig,
                 draft_cfg: ModelConfig, num_steps: int, disable_by_batch_size: int = 0, prefix_cache_mb: int = 0):
        super().__init__(cfg, params, version, batch_size, ops_cfg, prefix_cache_mb)
        self.draft_cfg, self.num_steps, self.disable_by_batch_size = draft_cfg, num_steps, disable_by_batch_size
        self.draft: SpecDraft | None = None
        self.meter = SpecMeter()

    def update_draft(self, version: int, params: Any) -> None:
        self.draft = SpecDraft(self.draft_cfg, params, version, self.num_steps, self.disable_by_batch_size)

    def generate(self, requests: Sequence[Request], sampling: SamplingConfig) -> list[Sample]:
        t0, out = time.perf_counter(), []
        for chunk in chunked(requests, self.batch_size):
            out.extend(run_chunk(self.params, self.cfg, chunk, sampling, self.version, self.ops_cfg, self.draft,
                                 self.prefix_cache))
        if self.draft is not None:
            self.meter.record(out, time.perf_counter() - t0)
        return out

    def take_stats(self) -> dict[str, float]:
        return self.meter.take()


def take_metrics(job: Any) -> dict[str, float]:
    """The engine's speculation metrics since the last call ({} without a speculating engine)."""
    take = getattr(job.engine, "take_stats", None)
    return take() if take is not None else {}
