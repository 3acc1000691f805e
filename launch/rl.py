"""The algorithm side of the loop: which objective, how a step's groups are sampled, how the state updates.

main.py asks this module three things: `collect` (prompts -> responses -> rewards, with
DAPO's dynamic sampling and overlong shaping when asked), `finish` (critic values and
advantages on the packed buffer) and `make_update` (the pure update of the run's state).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import torch

from launch import memory as launch_memory
from launch.engines.base import generate_batch
from miles_fn import dapo, objective, prng, train
from miles_fn import model as model_lib
from miles_fn.config import ModelConfig
from miles_fn.rollout_buffer import build_rollout_buffer
from state.train_state import ActorCriticState, RolloutBuffer

K_DYNAMIC = 3  # sub-key of a step's key for dynamic sampling's extra rounds (round 0 uses the plain keys)


@dataclasses.dataclass(frozen=True)
class RolloutShaping:
    dynamic_sampling: bool = False  # DAPO: keep only groups whose rewards differ; oversample to fill the batch
    dynamic_sampling_max_rounds: int = 4  # generation rounds per step at most (then train on what was kept)
    overlong_buffer: int = 0  # DAPO soft overlong punishment over the last B tokens of max_new_tokens (0 = off)
    overlong_penalty_factor: float = 1.0
    critic_lr: float = 1e-3


@dataclasses.dataclass
class Collected:
    prompts: list[list[int]]
    responses: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    rewards: list[float]
    group_ids: list[int]
    stats: dict[str, float]


def _one_round(job: Any, data_key: prng.Key, gen_key: prng.Key) -> Collected:
    cfg, task, g = job.cfg, job.task, job.cfg.group_size
    pairs = task.sample_pairs(data_key, cfg.prompts_per_step)
    prompts = [task.prompt_ids(*p) for p in pairs for _ in range(g)]
    gen = generate_batch(job.engine, prompts, gen_key, cfg.sampling)
    rewards = [task.reward(r, pairs[i // g]) for i, r in enumerate(gen.tokens)]
    return Collected(prompts, gen.tokens, gen.logprobs, gen.finish_reasons, rewards,
                     [i // g for i in range(len(prompts))], {})


def _keep_groups(c: Collected, keep: list[int], first_id: int) -> Collected:
    rows = [i for i, gid in enumerate(c.group_ids) if gid in set(keep)]  # keep's order is ascending
    remap = {gid: first_id + j for j, gid in enumerate(keep)}
    return Collected([c.prompts[i] for i in rows], [c.responses[i] for i in rows], [c.logprobs[i] for i in rows],
                     [c.finish_reasons[i] for i in rows], [c.rewards[i] for i in rows],
                     [remap[c.group_ids[i]] for i in rows], {})


def _concat(a: Collected, b: Collected) -> Collected:
    return Collected(a.prompts + b.prompts, a.responses + b.responses, a.logprobs + b.logprobs,
                     a.finish_reasons + b.finish_reasons, a.rewards + b.rewards, a.group_ids + b.group_ids, {})


def collect(job: Any, key: prng.Key, k_data: int, k_rollout: int) -> Collected:
    """One step's samples. Without dynamic sampling this is one round with the step's data and rollout keys.

    With it (DAPO), groups whose task rewards are all equal are dropped and new prompts are
    sampled (round r > 0 keys: fold_in(fold_in(key, K_DYNAMIC), r)) until prompts_per_step
    groups are kept or dynamic_sampling_max_rounds rounds ran; the batch is then what was kept
    (never empty: with nothing kept the last round is used as is, contributing zero advantage).
    """
    cfg, shaping = job.cfg, job.cfg.shaping
    first = _one_round(job, prng.fold_in(key, k_data), prng.fold_in(key, k_rollout))
    out = first
    if shaping.dynamic_sampling:
        want, kept, last, rounds, seen = cfg.prompts_per_step, None, first, 0, 0
        while rounds < shaping.dynamic_sampling_max_rounds and (kept is None or len(set(kept.group_ids)) < want):
            if rounds > 0:
                k = prng.fold_in(prng.fold_in(key, K_DYNAMIC), rounds)
                last = _one_round(job, prng.fold_in(k, k_data), prng.fold_in(k, k_rollout))
            rounds += 1
            seen += cfg.prompts_per_step
            ok = dapo.informative_groups(torch.tensor(last.rewards), torch.tensor(last.group_ids)).tolist()
            have = 0 if kept is None else len(set(kept.group_ids))
            keep = [gid for gid, good in enumerate(ok) if good][: want - have]
            part = _keep_groups(last, keep, have)
            kept = part if kept is None else _concat(kept, part)
        n_kept = len(set(kept.group_ids)) if kept is not None else 0
        out = dataclasses.replace(kept if n_kept else last, stats={
            "ds_rounds": float(rounds), "ds_kept_groups": float(n_kept), "ds_kept_frac": n_kept / max(seen, 1),
            "ds_batch_full": float(n_kept >= want)})
    if shaping.overlong_buffer > 0:
        lengths = torch.tensor([len(r) for r in out.responses])
        pen = dapo.overlong_penalty(lengths, cfg.sampling.max_new_tokens, shaping.overlong_buffer,
                                    shaping.overlong_penalty_factor)
        stats = {**out.stats, "overlong_penalty_mean": float(pen.mean()),
                 "task_reward_mean": sum(out.rewards) / len(out.rewards)}
        out = dataclasses.replace(out, rewards=[r + p for r, p in zip(out.rewards, pen.tolist(), strict=True)],
                                  stats=stats)
    return out


def shapes_rollouts(cfg: Any) -> bool:
    """Whether the step's samples come from `collect` below (DAPO) rather than the plain rollout."""
    return cfg.shaping.dynamic_sampling or cfg.shaping.overlong_buffer > 0


def dapo_rollout(job: Any, key: prng.Key, ref_params: Any, k_data: int, k_rollout: int
                 ) -> tuple[RolloutBuffer, dict[str, torch.Tensor]]:
    """The step's buffer from `collect` (dynamic sampling, overlong shaping), reference log-probs, advantages."""
    cfg = job.cfg
    gen = collect(job, key, k_data, k_rollout)
    buf = build_rollout_buffer(gen.prompts, gen.responses, gen.logprobs, gen.rewards, gen.group_ids,
                               cfg.normalize_advantage_std)
    if ref_params is not None:
        with torch.no_grad():
            ref = model_lib.sequence_logprobs(ref_params, cfg.model, buf.tokens, buf.positions, buf.segment_ids,
                                              cfg.loss.temperature)
        buf = buf._replace(ref_logprobs=ref)
    buf = finish(job, buf)
    n = len(gen.responses)
    stats = {
        "reward_mean": buf.rewards.mean(),
        "response_len": torch.tensor(sum(len(t) for t in gen.responses) / n),
        "truncated_frac": torch.tensor(sum(f == "length" for f in gen.finish_reasons) / n),
        **{k: torch.tensor(v) for k, v in gen.stats.items()},
    }
    return buf, stats


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


def make_update(cfg: Any) -> Callable[[Any, RolloutBuffer, prng.Key], tuple[Any, dict[str, torch.Tensor]]]:
    """The run's pure update: train_step of the policy loss, or PPO's policy + critic step."""
    obj: objective.ObjectiveConfig = cfg.objective
    model_cfg: ModelConfig = launch_memory.training_model_config(cfg.memory, cfg.model)
    if cfg.custom_loss:
        policy_loss = load_factory(cfg.custom_loss)(model_cfg, obj)
    elif _is_default(cfg):
        policy_loss = train.make_grpo_loss(model_cfg, cfg.loss, cfg.ops, cfg.offpolicy)  # the default job
    else:
        _check_packable(cfg)
        policy_loss = objective.make_policy_loss(model_cfg, obj, cfg.ops, cfg.offpolicy)

    def policy_update(state: Any, buf: RolloutBuffer, key: prng.Key):
        return launch_memory.train_update(cfg.memory, cfg.model, state, buf, key, policy_loss, cfg.optim)

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


def attach_critic(cfg: Any, state: Any) -> Any:
    """After the warm-up: PPO wraps the policy state with a value model initialised from its trunk."""
    return objective.init_actor_critic(state) if cfg.objective.uses_critic else state

