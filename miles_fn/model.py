"""A Qwen2/Llama-family decoder as a pure function over a params pytree.

params = {
    "embed": [V, H],
    "layers": [{"attn_norm", "wq", "bq", "wk", "bk", "wv", "bv", "wo",
                "mlp_norm", "w_gate", "w_up", "w_down"}, ...],
    "final_norm": [H],
    "lm_head": [V, H],          # absent when the embeddings are tied
}
Weights keep the Hugging Face [out, in] layout so that import, export and
weight sync are renames, not transposes. Biases exist only when cfg.attention_bias.
"""

from __future__ import annotations

import functools
from typing import Any

import optree
import torch

import ops
from miles_fn import prng, remat
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
    shapes: Params = {
        "embed": (cfg.vocab_size, h),
        "layers": [dict(layer) for _ in range(cfg.num_layers)],
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
) -> torch.Tensor:
    b, t, _ = x.shape
    d = cfg.dim_head
    h = ops.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps, oc)
    q = ops.linear(h, p["wq"], p.get("bq"), oc).view(b, t, cfg.num_heads, d).transpose(1, 2)
    k = ops.linear(h, p["wk"], p.get("bk"), oc).view(b, t, cfg.num_kv_heads, d).transpose(1, 2)
    v = ops.linear(h, p["wv"], p.get("bv"), oc).view(b, t, cfg.num_kv_heads, d).transpose(1, 2)
    q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
    if cache is not None:
        # The cache buffers are donated to this call (as JAX donates buffers): written in place.
        ck, cv = cache
        ck[:, :, cache_start : cache_start + t] = k
        cv[:, :, cache_start : cache_start + t] = v
        k, v = ck[:, :, : cache_start + t], cv[:, :, : cache_start + t]
    a = ops.attention(q, k, v, mask, oc).transpose(1, 2).reshape(b, t, cfg.num_heads * d)
    x = x + ops.linear(a, p["wo"], None, oc)
    h = ops.rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps, oc)
    gate = ops.silu(ops.linear(h, p["w_gate"], None, oc), oc)
    return x + ops.linear(gate * ops.linear(h, p["w_up"], None, oc), p["w_down"], None, oc)


def _recomputed_block(
    p: Params, cfg: ModelConfig, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
    oc: ops.OpsConfig = ops.REFERENCE,
) -> torch.Tensor:
    """_block with activation recomputation: only the layer's input is kept for the backward pass."""
    names = sorted(p)

    def block(x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        return _block(dict(zip(names, weights, strict=True)), cfg, x, cos, sin, mask, None, 0, oc)

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
) -> torch.Tensor:
    """Logits [B, T, V] for tokens [B, T] at positions [B, T] under mask [B, T, S].

    Without a cache S = T; with one, keys are the cache's first cache_start + T columns.
    cfg.recompute recomputes each layer's activations in the backward pass (miles_fn.remat).
    `ops_cfg` picks the kernels (ops.OpsConfig); ops_cfg.compile runs the forward under torch.compile.
    """
    fn = _compiled_forward() if ops_cfg.compile else _forward
    return fn(params, cfg, tokens, positions, mask, cache, cache_start, False, ops_cfg)[0]


def forward_with_activations(
    params: Params, cfg: ModelConfig, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`forward` (the same ops in the same order, so the same logits bit for bit), also returning
    the residual stream by name: "embed", "layer_00", ..., "final_norm" (each [B, T, H]), for debugging."""
    return _forward(params, cfg, tokens, positions, mask, None, 0, True, ops.REFERENCE)


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    acts: dict[str, torch.Tensor] = {}
    x = params["embed"][tokens]
    if keep:
        acts["embed"] = x
    cos, sin = ops.rope_cos_sin(positions, cfg.dim_head, cfg.rope_theta)
    for i, layer in enumerate(params["layers"]):
        if cfg.recompute and cache is None and torch.is_grad_enabled():
            x = _recomputed_block(layer, cfg, x, cos, sin, mask, oc)
        else:
            x = _block(layer, cfg, x, cos, sin, mask, None if cache is None else cache[i], cache_start, oc)
        if keep:
            acts[f"layer_{i:02d}"] = x
    x = ops.rms_norm(x, params["final_norm"], cfg.rms_norm_eps, oc)
    if keep:
        acts["final_norm"] = x
    return ops.linear(x, params.get("lm_head", params["embed"]), None, oc), acts


@functools.cache
def _compiled_forward():
    """One torch.compile wrapper per process (a memo of a pure transformation, not state)."""
    return torch.compile(_forward, dynamic=True)


def sequence_logprobs(
    params: Params,
    cfg: ModelConfig,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    segment_ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    ops_cfg: ops.OpsConfig = ops.REFERENCE,
) -> torch.Tensor:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) for t < T-1: shape [B, T-1]."""
    logits = forward(params, cfg, tokens, positions, causal_segment_mask(segment_ids), ops_cfg=ops_cfg)
    return ops.token_logprobs(logits[:, :-1], tokens[:, 1:], temperature, ops_cfg)


def sequence_logprobs_and_entropy(
    params: Params,
    cfg: ModelConfig,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    segment_ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    ops_cfg: ops.OpsConfig = ops.REFERENCE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence_logprobs, full-vocabulary entropy of each next-token distribution), both [B, T-1], one forward."""
    logits = forward(params, cfg, tokens, positions, causal_segment_mask(segment_ids), ops_cfg=ops_cfg)[:, :-1]
    return ops.token_logprobs(logits, tokens[:, 1:], temperature, ops_cfg), ops.token_entropy(logits, temperature)


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
