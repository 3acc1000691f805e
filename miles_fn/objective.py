"""Objectives composed from the pieces in `advantages` and `losses`: configs in, pure loss functions out.

    advantages:  buffer -> buffer with advantages (and returns)     `with_advantages`
    policy loss: (params, buffer, key) -> (loss, aux)               `make_policy_loss`
    value loss:  (critic params, buffer, key) -> (loss, aux)        `make_value_loss`
    PPO update:  (ActorCriticState, buffer, key) -> (state, metrics) `actor_critic_step`

Each factory reads a frozen ObjectiveConfig once and returns a closure with no branches
on data; a research objective is a new factory of a dozen lines (see the README).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import ops
from miles_fn import advantages as adv_lib
from miles_fn import losses, model, offpolicy, optim, packing, prng, routing, train
from miles_fn.config import ModelConfig
from state.train_state import ActorCriticState, RolloutBuffer, TrainState


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    advantage_estimator: str = "grpo"  # a key of advantages.ESTIMATORS
    policy_loss: str = "ppo_clip"  # a key of losses.POLICY_LOSSES
    loss_agg: str = "token_mean"  # one of losses.AGG_MODES
    max_response_len: int = 0  # Dr. GRPO's constant (seq_mean_token_sum_norm with global counts)
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    dual_clip_c: float = 3.0
    kl_type: str = "k3"
    kl_coef: float = 0.0
    kl_clamp: float = 10.0
    use_kl_loss: bool = True  # True: beta KL is a loss term; False: folded into the reward
    entropy_coef: float = 0.0
    value_coef: float = 1.0
    value_clip: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    normalize_std: bool = True
    temperature: float = 1.0
    shared_prefix: bool = False  # run each group's common prefix once (model.shared_prefix_columns)
    skip_zero_advantage_rows: bool = False  # train only rollout_buffer.gradient_rows, where that is exact
    routing_replay: bool = False  # MoE: run the engine's recorded experts (R3, miles_fn/routing.py)

    def __post_init__(self) -> None:
        for name, table, flag in ((self.advantage_estimator, adv_lib.ESTIMATORS, "advantage_estimator"),
                                  (self.policy_loss, losses.POLICY_LOSSES, "policy_loss"),
                                  (self.kl_type, losses.KL_ESTIMATORS, "kl_type")):
            if name not in table:
                raise ValueError(f"--{flag}={name} is unknown; choose one of {sorted(table)}")
        if self.loss_agg not in losses.AGG_MODES:
            raise ValueError(f"--loss_agg={self.loss_agg} is unknown; choose one of {list(losses.AGG_MODES)}")

    @property
    def uses_critic(self) -> bool:
        return self.advantage_estimator == "gae"

    @property
    def kl_in_reward(self) -> bool:
        return self.kl_coef > 0 and not self.use_kl_loss

    @property
    def skips_zero_advantage_rows(self) -> bool:
        """Whether the policy step trains on rollout_buffer.gradient_rows alone: asked for, and exact.

        Exact when every term of the loss scales with the advantage (no KL loss, no entropy bonus;
        a KL folded into the reward is in the advantage) and the normaliser is a count of the whole
        batch (Dr. GRPO's N * T needs the fixed max_response_len, not the batch's width).
        """
        kl_loss = self.use_kl_loss and self.kl_coef > 0
        norm_ok = self.loss_agg != "seq_mean_token_sum_norm" or self.max_response_len > 0
        return (self.skip_zero_advantage_rows and not kl_loss and self.entropy_coef == 0 and norm_ok
                and self.policy_loss in ADVANTAGE_SCALED_LOSSES)

    @property
    def clip(self) -> losses.ClipConfig:
        return losses.ClipConfig(self.eps_clip, self.eps_clip_high, self.dual_clip_c)


def normalizer(batch: RolloutBuffer, mode: str, max_response_len: int = 0) -> Any:
    """The aggregation normaliser from the batch's global counts, or None (local counts) when unset."""
    if batch.num_tokens is None or batch.num_samples is None:
        if mode == "seq_mean_token_sum_norm" and max_response_len > 0:
            return batch.loss_mask.shape[0] * max_response_len
        return None
    return losses.normalizer_for(mode, batch.num_tokens, batch.num_samples, max_response_len)


def aggregate(per_token: torch.Tensor, batch: Any, mode: str, norm: Any = None) -> torch.Tensor:
    """losses.aggregate on a RolloutBuffer; on a packed micro-batch, packing.aggregate (its share of the whole)."""
    if isinstance(batch, packing.PackedBatch):
        return packing.aggregate(per_token, batch, mode)
    return losses.aggregate(per_token, batch.loss_mask, mode, norm)


# Policy losses that are 0, with gradient 0, wherever the advantage is 0.
ADVANTAGE_SCALED_LOSSES = ("ppo_clip", "dual_clip", "gspo", "pg")

# What a packed micro-batch (--max_tokens_per_micro_batch) supports: packing.aggregate's modes, and
# policy losses without a per-sequence reduction inside (GSPO's sequence ratio is per row there).
PACKED_AGG_MODES = ("token_mean", "seq_mean_token_mean")
PACKED_POLICY_LOSSES = ("ppo_clip", "dual_clip", "pg")


def with_global_counts(batch: RolloutBuffer) -> RolloutBuffer:
    """The batch with num_tokens / num_samples set from itself: call on the full batch before splitting it."""
    return batch._replace(num_tokens=batch.loss_mask.sum(), num_samples=torch.tensor(float(batch.loss_mask.shape[0])))


def with_advantages(batch: RolloutBuffer, cfg: ObjectiveConfig, values: torch.Tensor | None = None) -> RolloutBuffer:
    """Advantages (and, with a critic, returns and old values) by the configured estimator.

    With kl_in_reward the per-token KL of the sampling policy to the reference,
    kl_t = k(logp_old, logp_ref), is subtracted from the reward (beta = kl_coef).
    """
    kl = None
    if cfg.kl_in_reward:
        if batch.ref_logprobs is None:
            raise ValueError("KL in the reward (--nouse_kl_loss, --kl_coef > 0) needs the reference log-probs")
        kl = losses.kl(cfg.kl_type, batch.old_logprobs, batch.ref_logprobs, cfg.kl_clamp)
    inputs = adv_lib.AdvantageInputs(batch.rewards, batch.group_ids, batch.loss_mask, kl, values)
    acfg = adv_lib.AdvantageConfig(cfg.normalize_std, cfg.gamma, cfg.lam, cfg.kl_coef if kl is not None else 0.0)
    adv, ret = adv_lib.estimate(cfg.advantage_estimator, inputs, acfg)
    if values is None:
        return batch._replace(advantages=adv)
    return batch._replace(advantages=adv, returns=ret, values=values.detach())


def make_policy_loss(model_cfg: ModelConfig, cfg: ObjectiveConfig, ops_cfg: ops.OpsConfig = ops.REFERENCE,
                     offpolicy_cfg: offpolicy.OffPolicyConfig | None = None) -> train.LossFn:
    """policy loss + kl_coef * KL(pi || ref) (when use_kl_loss) - entropy_coef * H, one aggregation for all.

    With the default config this is exactly train.make_grpo_loss (same ops, same bits). ops_cfg is
    the trainer's kernels (ops.INVARIANT under --true_on_policy, so that the log-probs equal the
    engine's); with an off-policy correction each token's term is importance-weighted and the
    policy loss's old policy is the trainer's own detached log-prob, as in make_grpo_loss.
    """
    pg = losses.policy_loss(cfg.policy_loss)
    clip = cfg.clip
    correct = offpolicy_cfg is not None and offpolicy_cfg.correction != "none"

    def loss_fn(params: Any, batch: RolloutBuffer, key: prng.Key) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        del key  # no randomness in the loss
        args = (params, model_cfg, batch.tokens, batch.positions, batch.segment_ids, cfg.temperature)
        gids = train.group_ids_for_sharing(batch, cfg.shared_prefix)
        moe_kw, routes = routing.forward_args(model_cfg, batch, cfg.routing_replay)
        if cfg.entropy_coef > 0:
            logp, entropy = model.sequence_logprobs_and_entropy(*args, ops_cfg=ops_cfg, group_ids=gids, **moe_kw)
        else:
            logp, entropy = model.sequence_logprobs(*args, ops_cfg=ops_cfg, group_ids=gids, **moe_kw), None
        packed = isinstance(batch, packing.PackedBatch)
        mask = batch.loss_mask
        norm = None if packed else normalizer(batch, cfg.loss_agg, cfg.max_response_len)
        per_tok, aux = pg(logp, logp.detach() if correct else batch.old_logprobs, batch.advantages, mask, clip)
        if correct:
            w, is_aux = offpolicy.importance_weights(logp, batch.old_logprobs, mask, offpolicy_cfg)
            per_tok = per_tok * w
            aux.update(is_aux)
        mismatch = offpolicy.mismatch_metrics(logp, batch.old_logprobs, mask)
        worst = mismatch.pop("mismatch_max")  # *_max metrics combine across micro-batches by max, not sum
        aux = packing.token_share({**aux, **mismatch}, batch)  # a micro-batch's share of the whole batch's means
        aux["mismatch_max"] = worst
        loss = aggregate(per_tok, batch, cfg.loss_agg, norm)
        aux["pg_loss"] = loss.detach()
        if cfg.use_kl_loss and cfg.kl_coef > 0 and batch.ref_logprobs is not None:
            kl = aggregate(losses.kl(cfg.kl_type, logp, batch.ref_logprobs, cfg.kl_clamp), batch, cfg.loss_agg, norm)
            loss = loss + cfg.kl_coef * kl
            aux["kl"] = kl.detach()
        if entropy is not None:
            bonus = aggregate(losses.entropy_bonus(entropy), batch, cfg.loss_agg, norm)
            loss = loss + cfg.entropy_coef * bonus
            aux["entropy"] = -bonus.detach()
        moe_loss, moe_aux = routing.loss_terms(model_cfg, batch, routes)  # router balance loss, R3 metrics
        loss = loss if moe_loss is None else loss + moe_loss
        aux.update(moe_aux)
        with torch.no_grad():
            aux["entropy_proxy"] = aggregate(-logp, batch, "token_mean")
        return loss, aux

    return loss_fn


def make_value_loss(model_cfg: ModelConfig, cfg: ObjectiveConfig) -> train.LossFn:
    """value_coef * token-mean clipped value loss of a value model (model.sequence_values) against batch.returns.

    The critic runs the reference ops: no engine computes values, so there is nothing to match.
    """

    def loss_fn(params: Any, batch: RolloutBuffer, key: prng.Key) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        del key
        if batch.returns is None or batch.values is None:
            raise ValueError("the value loss needs batch.returns and batch.values (use with_advantages with values)")
        v = model.sequence_values(params, model_cfg, batch.tokens, batch.positions, batch.segment_ids)
        per_tok, aux = losses.value_loss(v, batch.values, batch.returns, batch.loss_mask, cfg.value_clip)
        loss = cfg.value_coef * losses.aggregate(per_tok, batch.loss_mask, "token_mean",
                                                 normalizer(batch, "token_mean"))
        with torch.no_grad():
            aux["value_mean"] = losses.aggregate(v, batch.loss_mask, "token_mean")
        return loss, aux

    return loss_fn


def init_actor_critic(policy: TrainState, critic_params: Any | None = None) -> ActorCriticState:
    """PPO state: the policy as it is (optimizer moments kept) and a fresh value model from its trunk."""
    params = model.value_model_from(policy.params) if critic_params is None else critic_params
    return ActorCriticState(policy, train.init_state(params, policy.key.clone()))  # no shared storage


def critic_values(state: ActorCriticState, model_cfg: ModelConfig, batch: RolloutBuffer) -> torch.Tensor:
    with torch.no_grad():
        return model.sequence_values(state.critic.params, model_cfg, batch.tokens, batch.positions, batch.segment_ids)


def actor_critic_step(
    state: ActorCriticState,
    batch: RolloutBuffer,
    key: prng.Key,
    policy_loss_fn: train.LossFn,
    value_loss_fn: train.LossFn,
    policy_optim: optim.OptimConfig,
    critic_optim: optim.OptimConfig,
) -> tuple[ActorCriticState, dict[str, torch.Tensor]]:
    """One PPO update: a train_step of the policy and one of the critic, each with its own optimizer state."""
    policy, pm = train.train_step(state.policy, batch, prng.fold_in(key, 0), policy_loss_fn, policy_optim)
    critic, cm = train.train_step(state.critic, batch, prng.fold_in(key, 1), value_loss_fn, critic_optim)
    return ActorCriticState(policy, critic), {**pm, **{f"critic_{k}": v for k, v in cm.items() if k != "lr"}}
