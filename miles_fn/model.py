"""A Qwen2/Llama/Qwen3(-MoE) decoder as a pure function over a params pytree.

params = {
    "embed": [V, H],
    "layers": [{"attn_norm", "wq", "bq", "wk", "bk", "wv", "bv", "wo",
                "mlp_norm", "w_gate", "w_up", "w_down"}, ...],
                # Qwen3: + "q_norm", "k_norm" [head_dim]; a Qwen3-MoE sparse layer has
                # "router", "e_gate", "e_up", "e_down" (miles_fn/moe.py) for w_gate/w_up/w_down
    "final_norm": [H],
    "lm_head": [V, H],          # absent when the embeddings are tied
}
Weights keep the Hugging Face [out, in] layout so that import, export and
weight sync are renames, not transposes. Biases exist only when cfg.attention_bias.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

import ops
from miles_fn import moe, prng, remat
from miles_fn.config import ModelConfig

Params = dict[str, Any]
# One (key, value) pair of [B, Hkv, S, D] buffers per layer.
KVCache = list[tuple[torch.Tensor, torch.Tensor]]


def param_shapes(cfg: ModelConfig) -> Params:
    h, d = cfg.hidden_size, cfg.dim_head
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    layer: dict[str, tuple[int, ...]] = {
        "attn_norm": (h,),
        "wq": (q, h),
        "wk": (kv, h),
        "wv": (kv, h),
        "wo": (h, q),
        "mlp_norm": (h,),
        "w_gate": (cfg.intermediate_size, h),
        "w_up": (cfg.intermediate_size, h),
        "w_down": (h, cfg.intermediate_size),
    }
    if cfg.attention_bias:
        layer.update(bq=(q,), bk=(kv,), bv=(kv,))
    if cfg.qk_norm:
        layer.update(q_norm=(d,), k_norm=(d,))
    e, i = cfg.num_experts, cfg.moe_intermediate_size
    sparse = {k: v for k, v in layer.items() if k not in ("w_gate", "w_up", "w_down")}
    sparse.update(router=(e, h), e_gate=(e, i, h), e_up=(e, i, h), e_down=(e, h, i))
    shapes: Params = {
        "embed": (cfg.vocab_size, h),
        "layers": [dict(sparse if cfg.is_moe_layer(n) else layer) for n in range(cfg.num_layers)],
        "final_norm": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, h)
    return shapes


def init_params(cfg: ModelConfig, key: prng.Key, std: float = 0.02, dtype: torch.dtype = torch.float32) -> Params:
    """Normal(0, std) matrices, unit norms, zero biases; each leaf from its own derived key."""
    counter = iter(range(1 << 30))

    def leaf(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        k = prng.fold_in(key, next(counter))
        if name.endswith("norm"):
            return torch.ones(shape, dtype=dtype)
        if name.startswith("b"):
            return torch.zeros(shape, dtype=dtype)
        return (prng.normal(k, shape, torch.float64) * std).to(dtype)

    shapes = param_shapes(cfg)
    return {
        name: [{n: leaf(n, s) for n, s in layer.items()} for layer in value] if name == "layers" else leaf(name, value)
        for name, value in shapes.items()
    }


def causal_segment_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[B, T, T] mask: causal within a segment; id 0 is padding. Padding rows see themselves only.

    One mechanism serves right-padding and packing several samples into a row.
    """
    t = segment_ids.shape[-1]
    idx = torch.arange(t, device=segment_ids.device)
    causal = idx[None, :] <= idx[:, None]
    same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] != 0)
    return (causal & same) | torch.eye(t, dtype=torch.bool, device=segment_ids.device)


def new_kv_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype = torch.float32) -> KVCache:
    shape = (batch, cfg.num_kv_heads, max_len, cfg.dim_head)
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_layers)]


def _block(
    p: Params,
    cfg: ModelConfig,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor] | None,
    cache_start: int,
    oc: ops.OpsConfig,
    prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_out: list | None = None,
    replay: torch.Tensor | None = None,
    routes_out: list | None = None,
) -> torch.Tensor:
    """One decoder layer. prefix_kv: keys/values [B, Hkv, P, D] (rotated) placed before this call's own,
    as a shared prompt's (shared_prefix_logits); kv_out, when given, receives this call's own (k, v).
    A MoE layer: replay [B, T, k] expert ids to run (R3, -1 = its own); routes_out receives its moe.Route."""
    b, t, _ = x.shape
    d = cfg.dim_head
    h = ops.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps, oc)
    q = ops.linear(h, p["wq"], p.get("bq"), oc).view(b, t, cfg.num_heads, d).transpose(1, 2)
    k = ops.linear(h, p["wk"], p.get("bk"), oc).view(b, t, cfg.num_kv_heads, d).transpose(1, 2)
    v = ops.linear(h, p["wv"], p.get("bv"), oc).view(b, t, cfg.num_kv_heads, d).transpose(1, 2)
    if "q_norm" in p:  # Qwen3: each head's vector normalised before RoPE (after the transpose: same values)
        q, k = ops.rms_norm(q, p["q_norm"], cfg.rms_norm_eps, oc), ops.rms_norm(k, p["k_norm"], cfg.rms_norm_eps, oc)
    q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
    if cache is not None:
        # The cache buffers are donated to this call (as JAX donates buffers): written in place.
        ck, cv = cache
        ck[:, :, cache_start : cache_start + t] = k
        cv[:, :, cache_start : cache_start + t] = v
        k, v = ck[:, :, : cache_start + t], cv[:, :, : cache_start + t]
    if kv_out is not None:
        kv_out.append((k, v))
    if prefix_kv is not None:
        k, v = torch.cat([prefix_kv[0], k], 2), torch.cat([prefix_kv[1], v], 2)
    a = ops.attention(q, k, v, mask, oc).transpose(1, 2).reshape(b, t, cfg.num_heads * d)
    x = x + ops.linear(a, p["wo"], None, oc)
    h = ops.rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps, oc)
    if "router" in p:
        y, r = moe.moe_mlp(p, h, cfg.num_experts_per_tok, cfg.norm_topk_prob, oc, replay)
        if routes_out is not None:
            routes_out.append(r)
        return x + y
    gate = ops.silu(ops.linear(h, p["w_gate"], None, oc), oc)
    return x + ops.linear(gate * ops.linear(h, p["w_up"], None, oc), p["w_down"], None, oc)


def _recomputed_block(
    p: Params, cfg: ModelConfig, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
    oc: ops.OpsConfig = ops.REFERENCE, replay: torch.Tensor | None = None,
) -> torch.Tensor:
    """_block with activation recomputation: only the layer's input is kept for the backward pass."""
    names = sorted(p)

    def block(x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        return _block(dict(zip(names, weights, strict=True)), cfg, x, cos, sin, mask, None, 0, oc, replay=replay)

    return remat.recompute(block, x, *(p[n] for n in names))


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    cache: KVCache | None = None,
    cache_start: int = 0,
    *,
    ops_cfg: ops.OpsConfig = ops.REFERENCE,
    replay: torch.Tensor | None = None,
    routes_out: list | None = None,
) -> torch.Tensor:
    """Logits [B, T, V] for tokens [B, T] at positions [B, T] under mask [B, T, S].

    Without a cache S = T; with one, keys are the cache's first cache_start + T columns.
    cfg.recompute recomputes each layer's activations in the backward pass (miles_fn.remat).
    `ops_cfg` picks the kernels (ops.OpsConfig); ops_cfg.compile runs the forward under torch.compile.
    MoE (miles_fn/moe.py): replay [B, T, L_moe, k] expert ids (R3, -1 = route by the model's own
    router); routes_out, when given, receives one moe.Route per MoE layer, in layer order.
    """
    fn = _compiled_forward() if ops_cfg.compile else _forward
    return fn(params, cfg, tokens, positions, mask, cache, cache_start, False, ops_cfg, replay, routes_out)[0]


def forward_with_activations(
    params: Params, cfg: ModelConfig, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`forward` (the same ops in the same order, so the same logits bit for bit), also returning
    the residual stream by name: "embed", "layer_00", ..., "final_norm" (each [B, T, H]), for debugging."""
    return _forward(params, cfg, tokens, positions, mask, None, 0, True, ops.REFERENCE)


def _trunk(
    params: Params,
    cfg: ModelConfig,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    cache: KVCache | None,
    cache_start: int,
    keep: bool,
    oc: ops.OpsConfig,
    replay: torch.Tensor | None = None,
    routes_out: list | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    acts: dict[str, torch.Tensor] = {}
    x = params["embed"][tokens]
    if keep:
        acts["embed"] = x
    cos, sin = ops.rope_tables(positions, cfg.dim_head, cfg.rope_theta, x.dtype)
    moe_index = {n: j for j, n in enumerate(cfg.moe_layers)}
    for i, layer in enumerate(params["layers"]):
        rep = None if replay is None or i not in moe_index else replay[:, :, moe_index[i]]
        if cfg.recompute and cache is None and torch.is_grad_enabled():
            if routes_out is not None:
                raise ValueError("MoE routes (the router aux loss, R3 metrics) are not collected under --recompute")
            x = _recomputed_block(layer, cfg, x, cos, sin, mask, oc, rep)
        else:
            x = _block(layer, cfg, x, cos, sin, mask, None if cache is None else cache[i], cache_start, oc,
                       replay=rep, routes_out=routes_out)
        if keep:
            acts[f"layer_{i:02d}"] = x
    x = ops.rms_norm(x, params["final_norm"], cfg.rms_norm_eps, oc)
    if keep:
        acts["final_norm"] = x
    return x, acts


def _forward(
    params: Params,
    cfg: ModelConfig,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    cache: KVCache | None,
    cache_start: int,
    keep: bool,
    oc: ops.OpsConfig,
    replay: torch.Tensor | None = None,
    routes_out: list | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x, acts = _trunk(params, cfg, tokens, positions, mask, cache, cache_start, keep, oc, replay, routes_out)
    return output_layer(params, x, oc), acts


def hidden_states(params: Params, cfg: ModelConfig, tokens: torch.Tensor, positions: torch.Tensor,
                  mask: torch.Tensor, *, ops_cfg: ops.OpsConfig = ops.REFERENCE) -> torch.Tensor:
    """`forward` without its output layer: the final norm's output [B, T, H]. `output_layer` of some of its
    rows gives forward's logits there, for a loss that needs the vocabulary-wide head at a few columns only
    (the draft's, at response tokens: on a 49k vocabulary the head and its softmax dominate a small LM)."""
    return _trunk(params, cfg, tokens, positions, mask, None, 0, False, ops_cfg)[0]


def last_logits(
    params: Params,
    cfg: ModelConfig,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    cache: KVCache | None = None,
    cache_start: int = 0,
    *,
    ops_cfg: ops.OpsConfig = ops.REFERENCE,
    routes_out: list | None = None,
    head: bool = True,
) -> torch.Tensor | None:
    """`forward(...)[:, -1]` with the output layer at the last column only ([B, V]): a prefill samples from
    that column alone, and on SmolLM2's 49k vocabulary the head is a fifth of a 45-token prompt's FLOPs.
    head=False fills the cache and returns None (a draft's prefill). The eager trunk even under
    ops_cfg.compile: a prefill runs once a call."""
    x = _trunk(params, cfg, tokens, positions, mask, cache, cache_start, False, ops_cfg, None, routes_out)[0]
    return output_layer(params, x[:, -1], ops_cfg) if head else None


def output_layer(params: Params, x: torch.Tensor, ops_cfg: ops.OpsConfig = ops.REFERENCE) -> torch.Tensor:
    """Logits [..., V] of final-norm outputs x [..., H]: the tied embedding or lm_head."""
    return ops.linear(x, params.get("lm_head", params["embed"]), None, ops_cfg)


@functools.cache
def _compiled_forward():
    """One torch.compile wrapper per process (a memo of a pure transformation, not state)."""
    return torch.compile(_forward, dynamic=True)


# A per-column function of the head's output: (logits [..., C, V], targets [..., C]) -> tensors [..., C].
ColumnFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


def sequence_logprobs(
    params: Params,
    cfg: ModelConfig,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    segment_ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    ops_cfg: ops.OpsConfig = ops.REFERENCE,
    group_ids: torch.Tensor | None = None,
    replay: torch.Tensor | None = None,
    routes_out: list | None = None,
) -> torch.Tensor:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) for t < T-1: shape [B, T-1].
    replay [B, T-1, L_moe, k] / routes_out: as in `forward`, for its T-1 columns.

    group_ids [B]: rows of a group (GRPO's samples of one prompt) run their common prefix once
    (shared_prefix_columns); the same log-probs, bit for bit under ops.INVARIANT.
    """
    (lp,) = next_token_columns(params, cfg, tokens, positions, segment_ids,
                               lambda lg, tg: (ops.token_logprobs(lg, tg, temperature, ops_cfg),), ops_cfg, group_ids,
                               replay=replay, routes_out=routes_out)
    return lp


def sequence_logprobs_and_entropy(
    params: Params,
    cfg: ModelConfig,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    segment_ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    ops_cfg: ops.OpsConfig = ops.REFERENCE,
    group_ids: torch.Tensor | None = None,
    replay: torch.Tensor | None = None,
    routes_out: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence_logprobs, full-vocabulary entropy of each next-token distribution), both [B, T-1], one forward."""
    lp, ent = next_token_columns(
        params, cfg, tokens, positions, segment_ids,
        lambda lg, tg: (ops.token_logprobs(lg, tg, temperature, ops_cfg), ops.token_entropy(lg, temperature)),
        ops_cfg, group_ids, replay=replay, routes_out=routes_out)
    return lp, ent


def next_token_columns(
    params: Params, cfg: ModelConfig, tokens: torch.Tensor, positions: torch.Tensor, segment_ids: torch.Tensor,
    fn: ColumnFn, ops_cfg: ops.OpsConfig = ops.REFERENCE, group_ids: torch.Tensor | None = None,
    *, replay: torch.Tensor | None = None, routes_out: list | None = None,
) -> tuple[torch.Tensor, ...]:
    """fn(logits, targets) for each column t < T-1, whose logits predict targets = tokens[:, t+1]: each [B, T-1].
    With group_ids, by the shared-prefix forward where it applies (plain right-padded rows, no
    recomputation, a prefix to share, no MoE routes asked for)."""
    plain = replay is None and routes_out is None
    if group_ids is not None and plain and not cfg.recompute and not ops_cfg.compile:
        layout = shared_prefix_layout(tokens, segment_ids, group_ids)
        if layout is not None:
            return shared_prefix_columns(params, cfg, tokens, positions, segment_ids, layout, fn, ops_cfg=ops_cfg)
    # The last column predicts nothing and, under a causal mask, changes no other column: leave it out.
    logits = forward(params, cfg, tokens[:, :-1], positions[:, :-1], causal_segment_mask(segment_ids[:, :-1]),
                     ops_cfg=ops_cfg, replay=replay, routes_out=routes_out)
    return fn(logits, tokens[:, 1:])


class PrefixLayout(NamedTuple):
    """Which rows share which prefix: group g is the rows with row_group == g, and its first
    prefix_len[g] tokens are those of row prefix_rows[g] (every row of it keeps >= 1 token of its own)."""

    prefix_rows: torch.Tensor  # [G]
    prefix_len: torch.Tensor  # [G]
    row_group: torch.Tensor  # [B]


def shared_prefix_layout(tokens: torch.Tensor, segment_ids: torch.Tensor, group_ids: torch.Tensor
                         ) -> PrefixLayout | None:
    """The longest prefix the rows of each group (by group_ids) have in common, capped at each row's
    length - 1; None where sharing cannot apply or saves nothing (packed rows, every prefix empty)."""
    with torch.no_grad():
        if segment_ids.numel() == 0 or int(segment_ids.max()) > 1 or tokens.shape[1] < 2:
            return None  # packed rows (several segments a row) keep the plain forward
        b, t = tokens.shape
        lengths = (segment_ids != 0).sum(-1)
        if bool((segment_ids != (torch.arange(t) < lengths[:, None]).to(segment_ids.dtype)).any()):
            return None  # not right-padded
        _, row_group = torch.unique(group_ids, return_inverse=True)
        g = int(row_group.max()) + 1
        rows = torch.arange(b)
        first = torch.full((g,), b, dtype=torch.int64).scatter_reduce(0, row_group, rows, "amin")
        rep = first[row_group]
        cols = torch.arange(t)
        same = (tokens == tokens[rep]) & (cols < torch.minimum(lengths, lengths[rep])[:, None])
        common = torch.cumprod(same.to(torch.int64), -1).sum(-1)
        cap = torch.minimum(common, (lengths - 1).clamp(min=0))
        plen = torch.full((g,), t, dtype=torch.int64).scatter_reduce(0, row_group, cap, "amin")
        if int(plen.max()) == 0 or g == b:
            return None
        return PrefixLayout(first, plen, row_group)


def shared_prefix_columns(
    params: Params, cfg: ModelConfig, tokens: torch.Tensor, positions: torch.Tensor, segment_ids: torch.Tensor,
    layout: PrefixLayout, fn: ColumnFn, *, ops_cfg: ops.OpsConfig = ops.REFERENCE,
) -> tuple[torch.Tensor, ...]:
    """next_token_columns with each group's common prefix run once, as one row of a prefix stream,
    and each row's own tokens as a row of a suffix stream whose attention sees the prefix's keys.

    A GRPO group of G samples of one P-token prompt costs P + sum of (response length - 1) tokens
    instead of G * P + sum of response lengths: the gradient is the same sum (the prefix's activations
    collect every sample's share). A query sees the same ordered keys as in its own row (valid prefix
    columns, then its own), so under ops.INVARIANT the logits are the plain forward's bit for bit.
    The head runs once a group on the columns inside the prefix too (they predict the group's common
    tokens), and once a row only from the prefix's last column on.
    """
    b, t = tokens.shape
    lengths = (segment_ids != 0).sum(-1)
    plen_row = layout.prefix_len[layout.row_group]  # [B]
    pm = int(layout.prefix_len.max())
    # A row's own tokens that a logit needs: all but its last, which predicts nothing and is a key
    # to no later query of its row (a GRPO response is a few tokens, so this is a large share).
    own = lengths - plen_row - 1
    rm = max(int(own.max()), 1)
    dev = tokens.device
    cp, cr = torch.arange(pm, device=dev), torch.arange(rm, device=dev)
    # prefix stream [G, pm]: causal over the group's valid prefix columns
    p_tok, p_pos = tokens[layout.prefix_rows, :pm], positions[layout.prefix_rows, :pm]
    p_valid = cp[None] < layout.prefix_len[:, None]
    eye_p, eye_r = torch.eye(pm, dtype=torch.bool, device=dev), torch.eye(rm, dtype=torch.bool, device=dev)
    p_mask = (torch.tril(torch.ones(pm, pm, dtype=torch.bool, device=dev))[None] & p_valid[:, None]) | eye_p[None]
    # suffix stream [B, rm]: the row's tokens after its group's prefix; keys = prefix columns, then its own
    idx = (plen_row[:, None] + cr[None]).clamp(max=t - 1)
    r_tok, r_pos = tokens.gather(1, idx), positions.gather(1, idx)
    r_valid = cr[None] < own[:, None]
    r_self = (torch.tril(torch.ones(rm, rm, dtype=torch.bool, device=dev))[None] & r_valid[:, None]) | eye_r[None]
    r_mask = torch.cat([(cp[None, None] < plen_row[:, None, None]).expand(b, rm, pm), r_self], -1)
    x_p, x_r = params["embed"][p_tok], params["embed"][r_tok]
    cos_p, sin_p = ops.rope_tables(p_pos, cfg.dim_head, cfg.rope_theta, x_p.dtype)
    cos_r, sin_r = ops.rope_tables(r_pos, cfg.dim_head, cfg.rope_theta, x_r.dtype)
    for layer in params["layers"]:
        kv: list = []
        x_p = _block(layer, cfg, x_p, cos_p, sin_p, p_mask, None, 0, ops_cfg, kv_out=kv)
        (pk, pv), = kv
        x_r = _block(layer, cfg, x_r, cos_r, sin_r, r_mask, None, 0, ops_cfg,
                     prefix_kv=(pk[layout.row_group], pv[layout.row_group]))

    def head(x: torch.Tensor) -> torch.Tensor:
        x = ops.rms_norm(x, params["final_norm"], cfg.rms_norm_eps, ops_cfg)
        return ops.linear(x, params.get("lm_head", params["embed"]), None, ops_cfg)

    # Row column c predicts token c+1. For c < the prefix length - 1 that is a prefix token, the same
    # for every row of the group: fn runs on the prefix stream, and its values are copied per row. From
    # c = prefix length - 1 (the prefix's last column, then the suffix stream's) it runs once a row.
    x_own = torch.cat([x_p[layout.row_group, plen_row - 1][:, None], x_r], 1)  # [B, rm + 1, H]
    own_targets = tokens.gather(1, (plen_row[:, None] + torch.arange(rm + 1, device=dev)[None]).clamp(max=t - 1))
    c = torch.arange(t - 1, device=dev)[None]
    j = (c - (plen_row[:, None] - 1)).clamp(0, rm)
    in_prefix = c < plen_row[:, None] - 1
    row_vals = fn(head(x_own), own_targets)
    if pm < 2:  # no column lies inside a prefix
        return tuple(v.gather(1, j) for v in row_vals)
    prefix_vals = fn(head(x_p[:, : pm - 1]), p_tok[:, 1:pm])
    pc = c.clamp(max=pm - 2).expand(b, t - 1)
    return tuple(torch.where(in_prefix, pv[layout.row_group].gather(1, pc), rv.gather(1, j))
                 for pv, rv in zip(prefix_vals, row_vals, strict=True))


def sequence_values(
    params: Params, cfg: ModelConfig, tokens: torch.Tensor, positions: torch.Tensor, segment_ids: torch.Tensor
) -> torch.Tensor:
    """V(tokens[:, :t+1]) for t < T-1, [B, T-1], from a value model: a decoder whose lm_head is [1, H]."""
    if params["lm_head"].shape[0] != 1:
        raise ValueError(f"a value model's lm_head must be [1, hidden], got {tuple(params['lm_head'].shape)}")
    return forward(params, cfg, tokens, positions, causal_segment_mask(segment_ids))[:, :-1, 0]


def value_model_from(params: Params) -> Params:
    """A value model initialised from a policy: a copy of its trunk and a zero value head (V = 0 at the start)."""
    trunk = {k: v for k, v in params.items() if k != "lm_head"}
    copy = optree.tree_map(torch.clone, trunk)
    return {**copy, "lm_head": torch.zeros(1, params["embed"].shape[1], dtype=params["embed"].dtype)}
