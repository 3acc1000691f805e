"""The train step: a pure function (state, batch, key) -> (state, metrics).

A loss is any `loss_fn(params, batch, key) -> (loss, aux)`; research code builds
its own from the pieces in `losses` and `advantages` and passes it in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.func import grad

from miles_fn import losses, model, optim, prng
from miles_fn.config import ModelConfig
from state.train_state import RolloutBuffer, TrainState
from state.tree import tree_all_finite

LossFn = Callable[[Any, Any, prng.Key], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def init_state(params: Any, key: prng.Key) -> TrainState:
    return TrainState(
        params=params, opt_state=optim.adamw_init(params), step=torch.zeros((), dtype=torch.int64), key=key
    )


def train_step(
    state: TrainState, batch: Any, key: prng.Key, loss_fn: LossFn, optim_cfg: optim.OptimConfig
) -> tuple[TrainState, dict[str, torch.Tensor]]:
    """Gradients of loss_fn at state.params, global-norm clipping, one AdamW update.

    Non-finite gradients skip the update (the state is returned unchanged but for
    nothing) and report `finite = 0`, so the caller can snapshot the step.
    """
    grads, (loss, aux) = grad(lambda p: _with_loss_aux(loss_fn(p, batch, key)), has_aux=True)(state.params)
    grads, grad_norm = optim.clip_by_global_norm(grads, optim_cfg.max_grad_norm)
    lr = optim.lr_at(optim_cfg, int(state.step))
    finite = bool(torch.isfinite(loss)) and tree_all_finite(grads)
    metrics = {"loss": loss.detach(), "grad_norm": grad_norm.detach(), "lr": torch.tensor(lr), **aux}
    metrics["finite"] = torch.tensor(float(finite))
    if not finite:
        return state, metrics
    params, opt_state = optim.adamw_update(grads, state.opt_state, state.params, optim_cfg, lr)
    return state._replace(params=params, opt_state=opt_state, step=state.step + 1), metrics


def _with_loss_aux(out: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> tuple[torch.Tensor, tuple]:
    loss, aux = out
    return loss, (loss.detach(), {k: v.detach() for k, v in aux.items()})


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    kl_coef: float = 0.0
    loss_agg: str = "token_mean"
    temperature: float = 1.0


def make_grpo_loss(model_cfg: ModelConfig, cfg: PolicyLossConfig) -> LossFn:
    """PPO-clip on per-token advantages, token-mean, plus an optional k3 KL term to a reference."""

    def loss_fn(params: Any, batch: RolloutBuffer, key: prng.Key) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        del key  # the policy loss draws no randomness
        logp = model.sequence_logprobs(
            params, model_cfg, batch.tokens, batch.positions, batch.segment_ids, cfg.temperature
        )
        per_tok, aux = losses.ppo_clip(logp, batch.old_logprobs, batch.advantages, batch.loss_mask,
                                       cfg.eps_clip, cfg.eps_clip_high)
        loss = losses.aggregate(per_tok, batch.loss_mask, cfg.loss_agg)
        aux["pg_loss"] = loss.detach()
        if cfg.kl_coef > 0 and batch.ref_logprobs is not None:
            kl = losses.aggregate(losses.kl_k3(logp, batch.ref_logprobs), batch.loss_mask, cfg.loss_agg)
            loss = loss + cfg.kl_coef * kl
            aux["kl"] = kl.detach()
        with torch.no_grad():
            aux["entropy_proxy"] = losses.aggregate(-logp, batch.loss_mask, "token_mean")
            # |trainer - engine| log-prob of the sampled tokens, before this step's update: the rollout mismatch.
            aux["train_rollout_logprob_abs_diff"] = losses.aggregate((logp - batch.old_logprobs).abs(),
                                                                     batch.loss_mask, "token_mean")
        return loss, aux

    return loss_fn


def make_sft_loss(model_cfg: ModelConfig) -> LossFn:
    """Token-mean cross-entropy on batch.loss_mask (any batch with tokens, positions, segment_ids, loss_mask)."""

    def loss_fn(params: Any, batch: Any, key: prng.Key) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        del key
        logp = model.sequence_logprobs(params, model_cfg, batch.tokens, batch.positions, batch.segment_ids)
        return losses.aggregate(losses.sft_nll(logp), batch.loss_mask), {}

    return loss_fn
