"""The MoE terms of a policy loss: the router's load-balancing loss and rollout routing replay (R3).

R3 is a pure argument: the batch carries the engine's experts (RolloutBuffer.routed_experts,
[N, T-1, L_moe, k], -1 = none recorded), and with `replay` the forward runs those experts, gated
by the trainer's own router probabilities at them (moe.route). The route-mismatch metric is the
fraction of token-layer routes where the trainer's own top-k differs from the engine's.
"""

from __future__ import annotations

from typing import Any

import torch

from miles_fn import moe, packing
from miles_fn.config import ModelConfig


def forward_args(model_cfg: ModelConfig, batch: Any, replay: bool) -> tuple[dict[str, Any], list | None]:
    """(extra kwargs for model.sequence_logprobs, the list the MoE layers' routes land in, or None)."""
    if not model_cfg.num_experts:
        if replay:
            raise ValueError(f"--routing_replay needs a MoE model; model_type={model_cfg.model_type!r} has no "
                             "experts (drop --routing_replay)")
        return {}, None
    recorded = getattr(batch, "routed_experts", None)
    if replay:
        if isinstance(batch, packing.PackedBatch):
            raise ValueError("--routing_replay does not support packed micro-batches "
                             "(--max_tokens_per_micro_batch): use --max_tokens_per_micro_batch=0")
        if recorded is None:
            raise ValueError("--routing_replay: the rollout buffer has no routed_experts (the engine must "
                             "record them: the embedded engine does for MoE models)")
    if model_cfg.router_aux_loss_coef <= 0 and recorded is None:
        return {}, None
    routes: list = []
    return {"replay": recorded if replay else None, "routes_out": routes}, routes


def loss_terms(model_cfg: ModelConfig, batch: Any, routes: list | None) -> tuple[torch.Tensor | None, dict]:
    """(router_aux_loss_coef * load-balancing loss or None, metrics), each a micro-batch's share of the whole."""
    if routes is None:
        return None, {}
    mask = (batch.segment_ids[:, :-1] != 0).reshape(-1)
    aux: dict[str, torch.Tensor] = {}
    loss = None
    if model_cfg.router_aux_loss_coef > 0:
        lb = moe.load_balancing_loss(routes, mask)
        loss = model_cfg.router_aux_loss_coef * lb
        aux["router_aux_loss"] = lb.detach()
    recorded = getattr(batch, "routed_experts", None)
    if recorded is not None:
        with torch.no_grad():
            aux["route_mismatch"] = moe.route_mismatch(routes, recorded.reshape(mask.shape[0], *recorded.shape[2:]),
                                                       mask)
    if loss is not None and isinstance(batch, packing.PackedBatch):
        loss = packing.token_share({"l": loss}, batch)["l"]
    return loss, packing.token_share(aux, batch)


def buffer_routes(routed: list[torch.Tensor], width: int, layers: int, k: int) -> torch.Tensor:
    """The engine's per-sample routes ([P + R - 1, L_moe, k] each) as a [N, width, L_moe, k] int32
    tensor aligned with the buffer's columns (column t = the token at t), -1 padded."""
    out = torch.full((len(routed), width, layers, k), -1, dtype=torch.int32)
    for i, r in enumerate(routed):
        if r.numel() == 0:
            continue
        if r.shape[1:] != (layers, k):
            raise ValueError(f"routed_experts of sample {i}: shape {tuple(r.shape)}, expected [tokens, {layers}, {k}]")
        n = min(r.shape[0], width)
        out[i, :n] = r[:n]
    return out
