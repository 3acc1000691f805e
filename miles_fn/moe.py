"""Qwen3-MoE's sparse MLP as a pure function: a softmax router, top-k experts, SwiGLU experts.

A MoE layer's params are {"router": [E, H], "e_gate": [E, I, H], "e_up": [E, I, H], "e_down": [E, H, I]}
(transformers' in-memory layout split into gate and up, so HF import/export is a rename and a split).
The experts run on the tokens routed to them, grouped by expert (one GEMM per expert that has any),
not every expert on every token; each token's k expert outputs are summed in slot order, a fixed
order, so under ops.INVARIANT a token's output does not depend on which other tokens share its batch.

Rollout routing replay (R3): `replay` [N, k] gives the expert ids to use (the engine's); the gate
weights are still this router's own probabilities at those ids, so the router's gradient flows.
Rows of -1 (nothing recorded) route by this router's own top-k.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

import ops


class Route(NamedTuple):
    """One MoE layer's routing of N tokens, for the aux loss, R3 recording and the route metric."""

    probs: torch.Tensor  # [N, E] float32 router softmax
    own: torch.Tensor  # [N, k] int64 this router's own top-k
    used: torch.Tensor  # [N, k] int64 the experts the layer ran (own, or the replayed ids)


def route(logits: torch.Tensor, k: int, norm_topk_prob: bool, replay: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, Route]:
    """(gate weights [N, k] float32, Route) from router logits [N, E]: softmax in float32, then top-k."""
    probs = torch.softmax(logits.to(torch.float32).contiguous(), dim=-1)
    top, own = torch.topk(probs, k, dim=-1)
    used = own
    if replay is not None:
        replay = replay.to(torch.int64)
        used = torch.where(replay >= 0, replay, own)
        top = probs.gather(1, used)
    if norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    return top, Route(probs, own, used)


def experts(x: torch.Tensor, used: torch.Tensor, weights: torch.Tensor, p: dict[str, torch.Tensor],
            oc: ops.OpsConfig) -> torch.Tensor:
    """sum_j weights[:, j] * expert_{used[:, j]}(x) for x [N, H]: tokens grouped by expert, one GEMM each."""
    n, k = used.shape
    if n == 0:
        return x.new_zeros(x.shape)
    flat = used.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, in token order within one
    counts = torch.bincount(flat, minlength=p["router"].shape[0]).tolist()
    outs, start = [], 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        rows = x[order[start : start + c] // k]
        g = ops.silu(ops.linear(rows, p["e_gate"][e], None, oc), oc) * ops.linear(rows, p["e_up"][e], None, oc)
        outs.append(ops.linear(g, p["e_down"][e], None, oc))
        start += c
    by_slot = torch.cat(outs)[torch.argsort(order)].view(n, k, -1)  # back to [token, slot]
    w = weights.to(x.dtype)
    y = w[:, 0, None] * by_slot[:, 0]
    for j in range(1, k):  # fixed order: slot 0, 1, ..., k-1
        y = y + w[:, j, None] * by_slot[:, j]
    return y


def moe_mlp(p: dict[str, torch.Tensor], h: torch.Tensor, k: int, norm_topk_prob: bool, oc: ops.OpsConfig,
            replay: torch.Tensor | None = None) -> tuple[torch.Tensor, Route]:
    """The sparse MLP of h [..., H] -> ([..., H], Route over the flattened tokens). replay: [..., k] or None."""
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    weights, r = route(ops.linear(x, p["router"], None, oc), k, norm_topk_prob,
                       None if replay is None else replay.reshape(-1, k))
    return experts(x, r.used, weights, p, oc).view(shape), r


def load_balancing_loss(routes: list[Route], mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-Transformer balance loss as transformers' load_balancing_loss_func computes it:
    E * sum_e (fraction of routes to e, per slot) * (mean router probability of e), over every
    MoE layer's tokens together; mask [N] (1 = a real token) leaves padding out. Uses the experts run."""
    if not routes:
        raise ValueError("load_balancing_loss: no MoE layers")
    e = routes[0].probs.shape[-1]
    probs = torch.cat([r.probs for r in routes])  # [L*N, E]
    hot = torch.nn.functional.one_hot(torch.cat([r.used for r in routes]), e).to(probs.dtype)  # [L*N, k, E]
    m = torch.ones(probs.shape[0], dtype=probs.dtype) if mask is None else mask.to(probs.dtype).repeat(len(routes))
    denom = m.sum().clamp(min=1.0)
    tokens_per_expert = (hot * m[:, None, None]).sum(0) / denom  # [k, E]
    prob_per_expert = (probs * m[:, None]).sum(0) / denom  # [E]
    return e * (tokens_per_expert * prob_per_expert[None]).sum()


def route_mismatch(routes: list[Route], recorded: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Fraction of (token, MoE layer) routes with a record where this router's own top-k set differs
    from the recorded one. recorded [N, L_moe, k] (-1 = none), mask [N]."""
    own = torch.stack([r.own for r in routes], 1).sort(-1).values  # [N, L, k]
    rec = recorded.to(torch.int64).sort(-1).values
    has = (rec >= 0).all(-1) & mask.bool()[:, None]
    differ = (own != rec).any(-1) & has
    return differ.sum().to(torch.float32) / has.sum().clamp(min=1).to(torch.float32)
