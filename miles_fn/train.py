"""The train step: a pure function (state, batch, key) -> (state, metrics).

A loss is any `loss_fn(params, batch, key) -> (loss, aux)`; research code builds
its own from the pieces in `losses` and `advantages` and passes it in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from optree import tree_flatten, tree_unflatten
from torch.func import grad

import ops
from miles_fn import losses, model, offpolicy, optim, packing, prng, routing
from miles_fn.config import ModelConfig
from miles_fn.packing import PackedBatch
from state.train_state import RolloutBuffer, TrainState
from state.tree import tree_all_finite, tree_map

T = TypeVar("T")
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
    grads, (loss, aux) = loss_and_grad(state.params, batch, key, loss_fn)
    return apply_gradients(state, grads, loss, aux, optim_cfg)


def apply_gradients(
    state: TrainState, grads: Any, loss: torch.Tensor, aux: dict[str, torch.Tensor], optim_cfg: optim.OptimConfig,
    grad_norm: torch.Tensor | None = None,
) -> tuple[TrainState, dict[str, torch.Tensor]]:
    """Global-norm clipping and one AdamW update from given gradients (the tail of every train step).

    grad_norm: the gradients' global norm when the caller computed it (a fixed-order or sharded step,
    `optim.norm_from_row_sums`); the gradients are then finite exactly when it is (squares in float64
    cannot overflow), so no rank needs to see the others' gradients to take the same branch.
    """
    given = grad_norm is not None
    grads, grad_norm = optim.clip_by_global_norm(grads, optim_cfg.max_grad_norm, grad_norm)
    lr = optim.lr_at(optim_cfg, int(state.step))
    finite = bool(torch.isfinite(loss)) and (bool(torch.isfinite(grad_norm)) if given else tree_all_finite(grads))
    metrics = {"loss": loss.detach(), "grad_norm": grad_norm.detach(), "lr": torch.tensor(lr), **aux}
    metrics["finite"] = torch.tensor(float(finite))
    if not finite:
        return state, metrics
    params, opt_state = optim.adamw_update(grads, state.opt_state, state.params, optim_cfg, lr)
    return state._replace(params=params, opt_state=opt_state, step=state.step + 1), metrics


def train_step_accumulated(
    state: TrainState,
    micro_batches: Sequence[PackedBatch],
    key: prng.Key,
    loss_fn: LossFn,
    optim_cfg: optim.OptimConfig,
    max_oom_splits: int = 3,
    log: Callable[[str], None] | None = None,
    use_autograd: bool = True,
    fixed_order: bool = False,
) -> tuple[TrainState, dict[str, torch.Tensor]]:
    """One update from gradients summed over micro-batches: the same update as the whole batch at once.

    Contract: loss_fn divides by the whole batch's normaliser, which every micro-batch carries
    (`packing.aggregate` does), so sum_mb loss_mb = loss(whole batch) and likewise its gradient;
    metrics are summed the same way. A micro-batch that raises torch.OutOfMemoryError is split in
    two and retried, up to max_oom_splits times deep; each split is reported to `log` and counted
    in metrics["oom_splits"]. Summation runs in micro-batch order, so the result is deterministic.
    use_autograd: see `loss_and_grad`.

    fixed_order=True (--true_on_policy) is for micro-batches that are the batch's fixed gradient
    tiles (`packing.pack` with a tile size that does not depend on the token budget): gradients,
    loss and metrics are summed in the fixed balanced tree of `balanced_sum` over the tiles, and the
    norm is taken from per-row sums, so the bits depend on the tiles alone, also when the tiles are
    spread over data-parallel ranks (sharding.dp_train_step_tiles computes this very tree); a tile is
    never split on OOM (a split would change the reduction, so the error says to lower the tile size).
    """
    grads, loss, aux, stats = accumulate_gradients(state.params, micro_batches, key, loss_fn, max_oom_splits, log,
                                                   use_autograd, fixed_order)
    norm = optim.global_norm_by_rows(grads) if fixed_order else None
    state, metrics = apply_gradients(state, grads, loss, aux, optim_cfg, norm)
    return state, {**metrics, **stats}


def accumulate_gradients(
    params: Any,
    micro_batches: Sequence[PackedBatch],
    key: prng.Key,
    loss_fn: LossFn,
    max_oom_splits: int = 3,
    log: Callable[[str], None] | None = None,
    use_autograd: bool = True,
    fixed_order: bool = False,
) -> tuple[Any, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(sum of gradients, sum of losses, sum of aux (max for *_max keys), {"micro_batches", "oom_splits"}).

    Every sum is one left fold over the micro-batches in order (acc = acc + x), threaded through
    OOM halves too; fixed_order: the balanced tree of `balanced_sum` (see `train_step_accumulated`).
    """
    if not micro_batches:
        raise ValueError("train_step_accumulated needs at least one micro-batch")
    if fixed_order:
        parts = (next(iter(_micro_batch_grads(params, mb, key, loss_fn, use_autograd, 0, 0, log, True)))
                 for mb in micro_batches)
        grads, loss, aux = balanced_sum(parts, add_grads_loss_aux)
        return grads, loss, aux, {"micro_batches": torch.tensor(float(len(micro_batches))),
                                  "oom_splits": torch.tensor(0.0)}
    grads, loss, aux, done, splits = None, torch.zeros(()), {}, 0, 0
    for mb in micro_batches:
        for r in _micro_batch_grads(params, mb, key, loss_fn, use_autograd, 0, max_oom_splits, log, fixed_order):
            if r is None:
                splits += 1
                continue
            g, l_mb, a_mb = r
            grads = g if grads is None else tree_map(torch.add, grads, g)
            loss = loss + l_mb
            aux = a_mb if not aux else {k: torch.maximum(aux[k], v) if k.endswith("_max") else aux[k] + v
                                        for k, v in a_mb.items()}
            done += 1
    stats = {"micro_batches": torch.tensor(float(done)), "oom_splits": torch.tensor(float(splits))}
    return grads, loss, aux, stats


def balanced_sum(items: Iterable[T], add: Callable[[T, T], T]) -> T:
    """The sum of items in one fixed balanced binary tree: ((x0+x1)+(x2+x3)) + ..., pairs merged as they come.

    For n items it is the tree over the next power of two of slots with the missing trailing slots
    skipped, so any aligned block of 2^k slots is a subtree: W ranks that each sum their own block
    and then `balanced_sum` the W block sums in rank order compute these very bits. Holds O(log n)
    partial sums at a time.
    """
    stack: list[tuple[int, T]] = []
    for x in items:
        level = 0
        while stack and stack[-1][0] == level:
            x = add(stack.pop()[1], x)
            level += 1
        stack.append((level, x))
    if not stack:
        raise ValueError("balanced_sum of no items")
    out = stack.pop()[1]
    while stack:
        out = add(stack.pop()[1], out)
    return out


def add_grads_loss_aux(a: tuple[Any, torch.Tensor, dict[str, torch.Tensor]],
                       b: tuple[Any, torch.Tensor, dict[str, torch.Tensor]]
                       ) -> tuple[Any, torch.Tensor, dict[str, torch.Tensor]]:
    """(grads, loss, aux) + (grads, loss, aux): sums, the max for aux keys ending in _max."""
    return (tree_map(torch.add, a[0], b[0]), a[1] + b[1],
            {k: torch.maximum(v, b[2][k]) if k.endswith("_max") else v + b[2][k] for k, v in a[2].items()})


def _micro_batch_grads(
    params: Any,
    mb: Any,
    key: prng.Key,
    loss_fn: LossFn,
    use_autograd: bool,
    depth: int,
    max_oom_splits: int,
    log: Callable[[str], None] | None,
    fixed_order: bool = False,
) -> Iterator[tuple[Any, torch.Tensor, dict[str, torch.Tensor]] | None]:
    """(grads, loss, aux) of mb, or after an out-of-memory error those of its halves (None marks a split).

    The halves run after the `except` block has ended: inside it the live exception's traceback
    still holds the failed attempt's frames and activations, so on a GPU the retry would start
    with the memory that ran out still taken.
    """
    n = int(mb.lengths.numel()) if isinstance(mb, PackedBatch) else 1
    try:
        g, (loss, aux) = loss_and_grad(params, mb, key, loss_fn, use_autograd)
    except torch.OutOfMemoryError as e:
        if fixed_order:
            raise torch.OutOfMemoryError(
                f"out of memory on a gradient tile of {n} samples, {mb.tokens.numel()} tokens: with "
                f"--true_on_policy tiles are never split (a split would change the reduction order, and so the "
                f"update's bits); lower --invariant_grad_tile_tokens: {e}"
            ) from e
        if depth >= max_oom_splits or n < 2:
            raise torch.OutOfMemoryError(
                f"out of memory on a micro-batch of {n} samples, {mb.tokens.numel()} tokens after {depth} "
                f"splits (--max_oom_splits={max_oom_splits}); lower --max_tokens_per_micro_batch: {e}"
            ) from e
    else:
        yield g, loss, aux
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if log is not None:
        log(f"out of memory on a micro-batch of {n} samples ({tuple(mb.tokens.shape)} tokens): "
            f"splitting in two and retrying (depth {depth + 1})")
    yield None
    for half in packing.split(mb):
        yield from _micro_batch_grads(params, half, key, loss_fn, use_autograd, depth + 1, max_oom_splits, log)


def loss_and_grad(
    params: Any, batch: Any, key: prng.Key, loss_fn: LossFn, use_autograd: bool = True
) -> tuple[Any, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """(d loss / d params, (loss, aux)) of loss_fn(params, batch, key); params are not modified.

    By default torch.autograd.grad through detached leaf copies of params (the same values, so a
    pure function of its inputs). use_autograd=False takes torch.func.grad instead, for callers that
    compose it with other torch.func transforms; it runs its backward with create_graph=True, which
    keeps every backward intermediate (and every activation --recompute rebuilds) alive until it
    returns: 1.8x autograd's peak and about 11% slower on the default step (bench.packing, README).
    The two gradients agree to rounding (tests/test_packing.py), not bit for bit.
    """
    if not use_autograd:
        return grad(lambda p: _with_loss_aux(loss_fn(p, batch, key)), has_aux=True)(params)
    leaves, spec = tree_flatten(params)
    leaves = [x.detach().requires_grad_() for x in leaves]
    loss, out = _with_loss_aux(loss_fn(tree_unflatten(spec, leaves), batch, key))
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads, strict=True)]
    return tree_unflatten(spec, [g.detach() for g in grads]), out


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
    shared_prefix: bool = False  # run each group's common prefix once (model.shared_prefix_columns)
    routing_replay: bool = False  # MoE: run the engine's recorded experts (R3, miles_fn/routing.py)


def group_ids_for_sharing(batch: Any, shared_prefix: bool) -> torch.Tensor | None:
    """The group ids the shared-prefix forward groups rows by: a RolloutBuffer's (one row a sample)
    when asked; None for packed micro-batches, whose rows hold several samples."""
    return batch.group_ids if shared_prefix and isinstance(batch, RolloutBuffer) else None


def make_grpo_loss(model_cfg: ModelConfig, cfg: PolicyLossConfig, ops_cfg: ops.OpsConfig = ops.REFERENCE,
                   offpolicy_cfg: offpolicy.OffPolicyConfig | None = None) -> LossFn:
    """PPO-clip on per-token advantages, token-mean, plus an optional k3 KL term to a reference.

    Logs the train/inference mismatch (miles_fn.offpolicy.mismatch_metrics) every step; with an
    off-policy correction the per-token terms are importance-weighted and PPO's old policy is the
    trainer's own (detached) log-prob rather than the engine's.
    """

    def loss_fn(params: Any, batch: RolloutBuffer, key: prng.Key) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        del key  # the policy loss draws no randomness
        moe_kw, routes = routing.forward_args(model_cfg, batch, cfg.routing_replay)
        logp = model.sequence_logprobs(
            params, model_cfg, batch.tokens, batch.positions, batch.segment_ids, cfg.temperature, ops_cfg=ops_cfg,
            group_ids=group_ids_for_sharing(batch, cfg.shared_prefix), **moe_kw,
        )
        correct = offpolicy_cfg is not None and offpolicy_cfg.correction != "none"
        old = logp.detach() if correct else batch.old_logprobs
        per_tok, aux = losses.ppo_clip(logp, old, batch.advantages, batch.loss_mask,
                                       cfg.eps_clip, cfg.eps_clip_high)
        if correct:
            w, is_aux = offpolicy.importance_weights(logp, batch.old_logprobs, batch.loss_mask, offpolicy_cfg)
            per_tok = per_tok * w
            aux.update(is_aux)
        mismatch = offpolicy.mismatch_metrics(logp, batch.old_logprobs, batch.loss_mask)
        worst = mismatch.pop("mismatch_max")  # *_max metrics combine across micro-batches by max, not sum
        aux.update(mismatch)
        aux = packing.token_share(aux, batch)  # a micro-batch reports its share of the whole batch's means
        aux["mismatch_max"] = worst
        loss = packing.aggregate(per_tok, batch, cfg.loss_agg)
        aux["pg_loss"] = loss.detach()
        if cfg.kl_coef > 0 and batch.ref_logprobs is not None:
            kl = packing.aggregate(losses.kl_k3(logp, batch.ref_logprobs), batch, cfg.loss_agg)
            loss = loss + cfg.kl_coef * kl
            aux["kl"] = kl.detach()
        moe_loss, moe_aux = routing.loss_terms(model_cfg, batch, routes)
        loss = loss if moe_loss is None else loss + moe_loss
        aux.update(moe_aux)
        with torch.no_grad():
            aux["entropy_proxy"] = packing.aggregate(-logp, batch, "token_mean")
        return loss, aux

    return loss_fn


def make_sft_loss(model_cfg: ModelConfig, ops_cfg: ops.OpsConfig = ops.REFERENCE) -> LossFn:
    """Token-mean cross-entropy on batch.loss_mask (any batch with tokens, positions, segment_ids, loss_mask)."""

    def loss_fn(params: Any, batch: Any, key: prng.Key) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        del key
        logp = model.sequence_logprobs(params, model_cfg, batch.tokens, batch.positions, batch.segment_ids,
                                       ops_cfg=ops_cfg)
        return packing.aggregate(losses.sft_nll(logp), batch), {}

    return loss_fn
