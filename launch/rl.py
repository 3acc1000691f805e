"""The algorithm side of the loop: which objective, how a step's groups are sampled, how the state updates.

main.py asks this module three things: `collect` (prompts -> responses -> rewards through
launch.rollout.collect, with DAPO's dynamic sampling and overlong shaping when asked), `finish` (critic values and
advantages on the packed buffer) and `make_update` (the pure update of the run's state).
"""

from __future__ import annotations

import dataclasses
import importlib
import traceback
from collections.abc import Callable
from typing import Any

import torch

from launch import memory as launch_memory
from launch import rollout
from launch.engines.config import RolloutConfig
from miles_fn import dapo, lora, objective, prng, train
from miles_fn.config import ModelConfig
from miles_fn.rollout_buffer import gradient_rows
from state.train_state import ActorCriticState, RolloutBuffer

K_DYNAMIC = 3  # sub-key of a step's key for dynamic sampling's extra rounds (round 0 uses the plain keys)


@dataclasses.dataclass(frozen=True)
class RolloutShaping:
    dynamic_sampling: bool = False  # DAPO: keep only groups whose rewards differ; oversample to fill the batch
    dynamic_sampling_max_rounds: int = 4  # generation rounds per step at most (then train on what was kept)
    overlong_buffer: int = 0  # DAPO soft overlong punishment over the last B tokens of max_new_tokens (0 = off)
    overlong_penalty_factor: float = 1.0
    critic_lr: float = 1e-3


def collect(job: Any, key: prng.Key, k_data: int, k_rollout: int, step: int = 0, task: Any = None
            ) -> rollout.Collected:
    """One step's samples through launch.rollout.collect, with DAPO's dynamic sampling and overlong shaping.

    task: what prompts are drawn from and scored by (default job.task).

    Dynamic sampling is that loop's GroupSelection without fill: groups whose rewards are all
    equal are dropped and new prompts are drawn (round r > 0 keys: fold_in(fold_in(key, K_DYNAMIC),
    r)) until prompts_per_step groups are kept or dynamic_sampling_max_rounds rounds ran; the batch
    is then what was kept (never empty: with nothing kept, the last round as is, zero advantage).
    """
    cfg, shaping = job.cfg, job.cfg.shaping
    rcfg = getattr(cfg, "rollout", None) or RolloutConfig()

    def round_keys(r: int) -> tuple[prng.Key, prng.Key]:
        k = prng.fold_in(prng.fold_in(key, K_DYNAMIC), r)
        return prng.fold_in(k, k_data), prng.fold_in(k, k_rollout)

    selection = (rollout.GroupSelection(shaping.dynamic_sampling_max_rounds, fill=False) if shaping.dynamic_sampling
                 else rollout.GroupSelection())
    out = rollout.collect(job.engine, job.task if task is None else task, rcfg, cfg.sampling, prng.fold_in(key, k_data),
                          prng.fold_in(key, k_rollout), getattr(getattr(job, "state", None), "key", key), step,
                          cfg.prompts_per_step, cfg.group_size, selection, round_keys)
    if shaping.overlong_buffer > 0:
        lengths = torch.tensor([len(r) for r in out.batch.tokens])
        pen = dapo.overlong_penalty(lengths, cfg.sampling.max_new_tokens, shaping.overlong_buffer,
                                    shaping.overlong_penalty_factor)
        stats = {**(out.stats or {}), "overlong_penalty_mean": float(pen.mean()),
                 "task_reward_mean": sum(out.rewards) / len(out.rewards)}
        out = out._replace(rewards=[r + p for r, p in zip(out.rewards, pen.tolist(), strict=True)], stats=stats)
    return out


def finish(job: Any, buf: RolloutBuffer) -> RolloutBuffer:
    """Critic values (PPO) and the configured advantages on a packed buffer.

    The default objective (GRPO, no KL in the reward) keeps the advantages the buffer was
    built with, so the default job's numbers do not move.
    """
    obj: objective.ObjectiveConfig = job.cfg.objective
    if obj.advantage_estimator == "grpo" and not obj.kl_in_reward:
        return buf
    values = objective.critic_values(job.state, job.cfg.model, buf) if obj.uses_critic else None
    return objective.with_advantages(buf, obj, values)


def make_update(
    cfg: Any, mesh: Any = None
) -> Callable[[Any, RolloutBuffer, prng.Key], tuple[Any, dict[str, torch.Tensor]]]:
    """The run's pure update: train_step of the policy loss, or PPO's policy + critic step; under a
    ("dp",) mesh (torchrun) the policy's update is data-parallel over sharded state (launch.memory)."""
    obj: objective.ObjectiveConfig = cfg.objective
    model_cfg: ModelConfig = launch_memory.training_model_config(cfg.memory, cfg.model)
    if cfg.custom_loss:
        policy_loss = build_custom_loss(cfg.custom_loss, model_cfg, obj)
    elif _is_default(cfg):
        policy_loss = train.make_grpo_loss(model_cfg, cfg.loss, cfg.ops, cfg.offpolicy)  # the default job
    else:
        _check_packable(cfg)
        policy_loss = objective.make_policy_loss(model_cfg, obj, cfg.ops, cfg.offpolicy)

    skip = obj.skips_zero_advantage_rows and not cfg.custom_loss  # a custom loss may have terms of its own

    def policy_update(state: Any, buf: RolloutBuffer, key: prng.Key):
        rows = gradient_rows(buf) if skip else buf
        loss_fn = lora.loss_for(policy_loss, state, getattr(cfg, "lora", None))  # --lora_rank: in the adapters
        state, metrics = launch_memory.train_update(cfg.memory, cfg.model, state, rows, key, loss_fn, cfg.optim, mesh)
        if skip:
            metrics["train_rows_frac"] = torch.tensor(rows.tokens.shape[0] / max(buf.tokens.shape[0], 1))
        return state, metrics

    if not obj.uses_critic:
        return policy_update
    if cfg.memory.offload_train_state:
        raise ValueError("--advantage_estimator=gae (a value model) does not support --offload_train_state yet")
    value_loss = objective.make_value_loss(model_cfg, obj)
    # the critic's own step counter starts at 0 when RL starts: its schedule does too
    critic_optim = dataclasses.replace(cfg.optim, lr=cfg.shaping.critic_lr, schedule_start=0)

    def update(state: ActorCriticState, buf: RolloutBuffer, key: prng.Key):
        """PPO: the policy through the memory path (micro-batched if asked), the critic on the whole batch."""
        policy, pm = policy_update(state.policy, buf, prng.fold_in(key, 0))
        critic, cm = train.train_step(state.critic, buf, prng.fold_in(key, 1), value_loss, critic_optim)
        return ActorCriticState(policy, critic), {**pm, **{f"critic_{k}": v for k, v in cm.items() if k != "lr"}}

    return update


def _is_default(cfg: Any) -> bool:
    """The objective train.make_grpo_loss computes: ppo_clip on GRPO advantages, k3 KL loss, no entropy."""
    obj = cfg.objective
    return (obj.policy_loss == "ppo_clip" and obj.loss_agg in objective.PACKED_AGG_MODES and obj.kl_type == "k3"
            and obj.kl_clamp == 10.0 and (obj.use_kl_loss or obj.kl_coef == 0) and obj.entropy_coef == 0)


def _check_packable(cfg: Any) -> None:
    if not cfg.memory.max_tokens_per_micro_batch:
        return
    obj = cfg.objective
    if obj.loss_agg not in objective.PACKED_AGG_MODES or obj.policy_loss not in objective.PACKED_POLICY_LOSSES:
        raise ValueError(f"--max_tokens_per_micro_batch packs several samples a row, which --loss_agg={obj.loss_agg} "
                         f"with --policy_loss={obj.policy_loss} does not support yet; use --loss_agg in "
                         f"{list(objective.PACKED_AGG_MODES)} and --policy_loss in "
                         f"{list(objective.PACKED_POLICY_LOSSES)}, or --max_tokens_per_micro_batch=0")


def load_factory(path: str) -> Callable[..., train.LossFn]:
    """The loss factory at "module:function" (--custom_loss); ValueError names the flag on a bad path."""
    module, _, name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name or "make_loss")
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--custom_loss={path}: {type(e).__name__}: {e}") from e
    if not callable(fn):
        raise ValueError(f"--custom_loss={path}: {name} is not a function")
    return fn


def build_custom_loss(path: str, model_cfg: ModelConfig, obj: objective.ObjectiveConfig) -> train.LossFn:
    """--custom_loss's loss; ValueError naming the flag when its factory raises or returns no function."""
    factory = load_factory(path)
    try:
        loss_fn = factory(model_cfg, obj)
    except Exception as e:  # noqa: BLE001 (user code: any failure is reported with the flag)
        frames = traceback.extract_tb(e.__traceback__)
        at = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        raise ValueError(f"--custom_loss={path}: the factory raised {type(e).__name__}: {e}{at}") from e
    if not callable(loss_fn):
        raise ValueError(f"--custom_loss={path}: the factory returned {type(loss_fn).__name__}, not a loss function")
    return loss_fn


def attach_critic(cfg: Any, state: Any) -> Any:
    """After the warm-up: PPO wraps the policy state with a value model initialised from its trunk."""
    return objective.init_actor_critic(state) if cfg.objective.uses_critic else state

