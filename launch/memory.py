"""The shell's side of training memory: measuring free memory, offload around rollouts, micro-batched updates."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import torch
from absl import logging

from miles_fn import memory, packing, prng, train
from miles_fn.config import ModelConfig
from miles_fn.memory import MemoryConfig
from miles_fn.optim import OptimConfig
from state.train_state import ActorCriticState, RolloutBuffer, TrainState
from state.tree import tree_leaves


class MemoryPlanError(Exception):
    """The memory flags leave no micro-batch that fits: reported as one line naming the flags."""


def free_bytes(device: torch.device) -> int:
    """Free memory where the activations live: torch.cuda.mem_get_info on CUDA, MemAvailable on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def state_device(state: TrainState) -> torch.device:
    return tree_leaves(state.params)[0].device


@contextlib.contextmanager
def offloaded(holder: Any, enabled: bool) -> Iterator[None]:
    """Park holder.state in host memory for the body, the rollout, so that a colocated engine has the device.

    An engine that serves its own copy of the weights (a colocated SGLang server) lets the trainer's
    params and optimizer moments both wait on the host; the copy such an engine keeps to re-send
    after a restart (`engine.params`) moves with them, or it would pin the device params. An engine
    that computes on the trainer's params (`computes_on_trainer_params`: the embedded one) needs them
    where they are, so there only the optimizer state moves, and the params come back as the very
    tensors the engine holds, never as a second device copy.
    """
    if not enabled:
        yield
        return
    engine = getattr(holder, "engine", None)
    state = holder.state
    device = state_device(state)
    if getattr(engine, "computes_on_trainer_params", False):
        keep = state.params  # ActorCriticState.params is the policy's
        holder.state = memory.offload(_with_params(state, None))
        del state  # the generator's frame would otherwise hold the device moments through the body
        try:
            yield
        finally:
            holder.state = _with_params(memory.reload(holder.state, device), keep)
        return
    engine_copy = engine is not None and getattr(engine, "params", None) is state.params
    holder.state = memory.offload(state)
    del state
    if engine_copy:
        engine.params = holder.state.params
    try:
        yield
    finally:
        holder.state = memory.reload(holder.state, device)
        if engine_copy and engine.params is not None:
            engine.params = holder.state.params


def _with_params(state: Any, params: Any) -> Any:
    if isinstance(state, ActorCriticState):
        return state._replace(policy=state.policy._replace(params=params))
    return state._replace(params=params)


def plan_budget(cfg: MemoryConfig, model_cfg: ModelConfig, lengths: list[int], device: torch.device) -> tuple[int, int]:
    """(token budget, row length) for this step: the flags, capped so activations fit in free memory less the margin."""
    row_len = cfg.pack_row_len or max(lengths)
    bpt = memory.activation_bytes_per_token(model_cfg, row_len, cfg.recompute)  # plain autograd's, the gradient's
    try:
        budget = memory.plan_token_budget(cfg.max_tokens_per_micro_batch, free_bytes(device), cfg.memory_margin_gb,
                                          bpt)
    except ValueError as e:
        raise MemoryPlanError(str(e)) from e
    if budget < max(lengths) and budget == cfg.max_tokens_per_micro_batch:
        raise MemoryPlanError(
            f"--max_tokens_per_micro_batch={cfg.max_tokens_per_micro_batch} is less than the longest sample's "
            f"{max(lengths)} tokens (prompt + response): a sample is never split across micro-batches; raise it to "
            f"at least {max(lengths)}"
        )
    if budget < max(lengths):
        raise MemoryPlanError(
            f"--memory_margin_gb={cfg.memory_margin_gb} leaves room for {budget} tokens a micro-batch "
            f"(about {bpt} bytes a token), fewer than the longest sample's {max(lengths)}; lower the margin, "
            f"turn on --recompute or free memory"
        )
    return budget, min(row_len, budget)


def train_update(
    cfg: MemoryConfig,
    model_cfg: ModelConfig,
    state: TrainState,
    buf: RolloutBuffer,
    key: prng.Key,
    loss_fn: train.LossFn,
    optim_cfg: OptimConfig,
    mesh: Any = None,
) -> tuple[TrainState, dict[str, torch.Tensor]]:
    """The step's update: whole-batch when --max_tokens_per_micro_batch=0, else packed and accumulated.

    With --true_on_policy the micro-batches are the step's fixed gradient tiles (`gradient_tiles`),
    so the update, loss and metrics are bitwise the same under any budget that holds a tile
    (`token_budget` itself excepted). Under a ("dp",) mesh (torchrun) every rank gets the whole
    batch and trains on its share of it, its state sharded (`_dp_update`).
    """
    if mesh is not None:
        return _dp_update(cfg, model_cfg, state, buf, key, loss_fn, optim_cfg, mesh)
    if not cfg.max_tokens_per_micro_batch:
        return train.train_step(state, buf, key, loss_fn, optim_cfg)
    lengths = packing.sample_lengths(buf.segment_ids)
    budget, row_len = plan_budget(cfg, model_cfg, lengths, state_device(state))
    if cfg.grad_tile_tokens:
        micro_batches = gradient_tiles(cfg, buf, lengths, budget)
        state, metrics = train.train_step_accumulated(state, micro_batches, key, loss_fn, optim_cfg, 0,
                                                      logging.warning, fixed_order=True)
    else:
        micro_batches = packing.pack(buf, budget, row_len)
        state, metrics = train.train_step_accumulated(state, micro_batches, key, loss_fn, optim_cfg,
                                                      cfg.max_oom_splits, logging.warning)
    padded = sum(mb.tokens.numel() for mb in micro_batches)
    metrics.update(token_budget=torch.tensor(float(budget)), pack_efficiency=torch.tensor(sum(lengths) / padded))
    return state, metrics


def _dp_update(cfg: MemoryConfig, model_cfg: ModelConfig, state: TrainState, buf: RolloutBuffer, key: prng.Key,
               loss_fn: train.LossFn, optim_cfg: OptimConfig, mesh: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
    """train_update across the mesh's ranks (miles_fn/sharding.py): whole groups a rank, global counts.

    --max_tokens_per_micro_batch=0: each rank's groups in one micro-batch through DTensor's autograd.
    --true_on_policy: the whole batch's gradient tiles, dealt to the ranks in blocks of one balanced
    tree (the same bits at any power-of-two world size). Otherwise each rank packs its own groups.
    The budget is the smallest over the ranks, so that no rank's free memory changes another's plan.
    """
    import torch.distributed as dist

    from miles_fn import sharding

    if not cfg.max_tokens_per_micro_batch:
        return sharding.dp_train_step(state, buf, key, loss_fn, optim_cfg, mesh)
    rank, world = mesh.get_local_rank(), mesh.size()
    lengths = packing.sample_lengths(buf.segment_ids)
    budget, row_len = plan_budget(cfg, model_cfg, lengths, state_device(state))
    agreed = torch.tensor([budget, row_len], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=mesh.get_group())
    budget, row_len = int(agreed[0]), int(agreed[1])
    if cfg.grad_tile_tokens:
        tiles = gradient_tiles(cfg, buf, lengths, budget)
        state, metrics = sharding.dp_train_step_tiles(state, tiles, key, loss_fn, optim_cfg, mesh)
        padded = sum(t.tokens.numel() for t in tiles)
    else:
        micro_batches = packing.pack(sharding.rank_buffer(buf, rank, world), budget, row_len)
        state, metrics = sharding.dp_train_step_accumulated(state, micro_batches, key, loss_fn, optim_cfg, mesh,
                                                            cfg.max_oom_splits, logging.warning)
        total = torch.tensor(float(sum(mb.tokens.numel() for mb in micro_batches)), dtype=torch.float64)
        dist.all_reduce(total, group=mesh.get_group())
        padded = int(total)
    metrics.update(token_budget=torch.tensor(float(budget)), pack_efficiency=torch.tensor(sum(lengths) / padded))
    return state, metrics


def gradient_tiles(
    cfg: MemoryConfig, buf: RolloutBuffer, lengths: list[int], budget: int
) -> list[packing.PackedBatch]:
    """The step's fixed gradient tiles (--true_on_policy): micro-batches that do not depend on the budget.

    Rows of --pack_row_len (default the longest sample) packed first-fit-decreasing, grouped
    --invariant_grad_tile_tokens // row_len rows a tile: a function of the batch and those two flags
    only. Each tile's gradient is then one fixed computation and train.train_step_accumulated folds
    them in tile order, so any budget that holds the largest tile gives the same bits.
    """
    row_len = cfg.pack_row_len or max(lengths)
    if row_len > cfg.grad_tile_tokens:
        raise MemoryPlanError(f"--invariant_grad_tile_tokens={cfg.grad_tile_tokens} is less than one row of {row_len} "
                              f"tokens (--pack_row_len, default the longest sample); raise it")
    tiles = packing.pack(buf, cfg.grad_tile_tokens, row_len)
    largest = max(t.tokens.numel() for t in tiles)
    if largest > budget:
        raise MemoryPlanError(
            f"a gradient tile of {largest} padded tokens (--invariant_grad_tile_tokens={cfg.grad_tile_tokens}) does "
            f"not fit the micro-batch budget of {budget} tokens (--max_tokens_per_micro_batch="
            f"{cfg.max_tokens_per_micro_batch}, capped by free memory less --memory_margin_gb); with "
            f"--true_on_policy tiles are never split: raise the budget or lower --invariant_grad_tile_tokens"
        )
    return tiles


def training_model_config(cfg: MemoryConfig, model_cfg: ModelConfig) -> ModelConfig:
    """The model config the loss trains with (recomputation is a training choice, not the model's)."""
    return dataclasses.replace(model_cfg, recompute=cfg.recompute)
