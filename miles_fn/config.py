"""Model configuration: a frozen dataclass read from (and written back to) a Hugging Face config."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

# Read-only: the core keeps no mutable module state.
SUPPORTED_ARCHITECTURES = MappingProxyType({"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama",
                                           "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Qwen2/Llama/Qwen3(-MoE) decoder. Defaults are the tiny CPU model of the default task."""

    vocab_size: int = 32
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    attention_bias: bool = True  # Qwen2 has q/k/v biases; Llama does not.
    model_type: str = "qwen2"
    recompute: bool = False  # how to train it, not what it is: recompute layer activations in backward
    # Qwen3-MoE (model_type "qwen3_moe"; miles_fn/moe.py). num_experts = 0: every layer dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss in the training objective

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must divide by num_heads ({self.num_heads})")
        if self.model_type not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(f"model_type {self.model_type!r} is not one of {sorted(SUPPORTED_ARCHITECTURES.values())}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts "
                             f"({self.num_experts})")
        if self.num_experts and self.model_type != "qwen3_moe":
            raise ValueError(f"num_experts > 0 needs model_type='qwen3_moe', got {self.model_type!r}")
        if self.qk_norm and self.attention_bias:
            raise ValueError(f"{self.model_type} with attention_bias=True (an o_proj bias too) is not supported")
        if self.model_type == "qwen2" and not self.attention_bias:
            raise ValueError("qwen2 always has q/k/v biases: use model_type='llama' for attention_bias=False")

    @property
    def dim_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def qk_norm(self) -> bool:
        """Qwen3's per-head RMSNorm of queries and keys before RoPE."""
        return self.model_type in ("qwen3", "qwen3_moe")

    def is_moe_layer(self, i: int) -> bool:
        """transformers' rule: sparse where (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers."""
        return self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0 and i not in self.mlp_only_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))


def from_hf_dict(cfg: dict[str, Any]) -> ModelConfig:
    """Read a transformers config.json dict; refuse what the forward does not implement."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES.values():
        raise ValueError(
            f"config.json: model_type {model_type!r} (architectures {archs}) is not supported; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    rope_scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {})
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ValueError(f"config.json: rope scaling {rope_type!r} is not supported (only plain RoPE)")
    if cfg.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window=true is not supported")
    if cfg.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=true is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {cfg.get('hidden_act')!r} is not supported (only silu)")
    theta = cfg.get("rope_theta", rope_scaling.get("rope_theta", 10000.0))
    num_heads = cfg["num_attention_heads"]
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim"),
        rope_theta=float(theta),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=True if model_type == "qwen2" else bool(cfg.get("attention_bias", False)),
        model_type=model_type,
        **(_moe_fields(cfg) if model_type == "qwen3_moe" else {}),
    )


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError("config.json: shared experts are not supported (Qwen3-MoE has none)")
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))  # transformers 5 writes num_local_experts
    return {"num_experts": int(experts or 0), "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 0)),
            "moe_intermediate_size": int(cfg.get("moe_intermediate_size", 0)),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),  # transformers' default
            "decoder_sparse_step": int(cfg.get("decoder_sparse_step", 1)),
            "mlp_only_layers": tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
            "router_aux_loss_coef": float(cfg.get("router_aux_loss_coef", 0.0))}


def to_hf_dict(c: ModelConfig) -> dict[str, Any]:
    arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[c.model_type]
    d: dict[str, Any] = {
        "architectures": [arch],
        "model_type": c.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.dim_head,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if c.model_type == "qwen3_moe":
        d.update(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                 moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
                 decoder_sparse_step=c.decoder_sparse_step, mlp_only_layers=list(c.mlp_only_layers),
                 router_aux_loss_coef=c.router_aux_loss_coef)
    if c.model_type in ("llama", "qwen3", "qwen3_moe"):
        d["attention_bias"] = c.attention_bias
        d["mlp_bias"] = False
    if c.model_type != "llama":
        d["use_sliding_window"] = False
    return d
