"""A research objective composed from miles-fn's pieces, run with

    python -m launch.main --flagfile=launch/flags/grpo.flags --advantage_estimator=rloo \\
        --custom_loss=examples.composed_loss:make_loss

Dual-clip PPO with clip-higher, Dr. GRPO's constant normaliser, a k2 KL to the reference when
--kl_coef > 0, and a small entropy bonus from the full-vocabulary entropy.
"""

from __future__ import annotations

from typing import Any

import torch

from miles_fn import losses, model, objective, prng


def make_loss(model_cfg: Any, cfg: objective.ObjectiveConfig):
    def loss_fn(params: Any, batch: Any, key: prng.Key) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logp, entropy = model.sequence_logprobs_and_entropy(params, model_cfg, batch.tokens, batch.positions,
                                                            batch.segment_ids, cfg.temperature)
        mask = batch.loss_mask
        norm = mask.shape[0] * cfg.max_response_len  # a constant: every token weighs the same in every step
        per_tok, aux = losses.dual_clip(logp, batch.old_logprobs, batch.advantages, mask, eps_low=0.2,
                                        eps_high=0.28, clip_c=3.0)
        loss = losses.aggregate(per_tok, mask, "seq_mean_token_sum_norm", norm)
        if cfg.kl_coef > 0 and batch.ref_logprobs is not None:
            kl = losses.aggregate(losses.kl("k2", logp, batch.ref_logprobs), mask, "seq_mean_token_sum_norm", norm)
            loss, aux["kl"] = loss + cfg.kl_coef * kl, kl.detach()
        ent = losses.aggregate(entropy, mask, "token_mean")
        aux["entropy"] = ent.detach()
        return loss - 1e-3 * ent, aux

    return loss_fn
