"""Model configuration: a frozen dataclass read from (and written back to) a Hugging Face config."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

# Read-only: the core keeps no mutable module state.
SUPPORTED_ARCHITECTURES = MappingProxyType({"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Qwen2/Llama-family decoder. Defaults are the tiny CPU model of the default task."""

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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must divide by num_heads ({self.num_heads})")
        if self.model_type not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(f"model_type {self.model_type!r} is not one of {sorted(SUPPORTED_ARCHITECTURES.values())}")
        if self.model_type == "qwen2" and not self.attention_bias:
            raise ValueError("qwen2 always has q/k/v biases: use model_type='llama' for attention_bias=False")

    @property
    def dim_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads


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
    )


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
    if c.model_type == "llama":
        d["attention_bias"] = c.attention_bias
        d["mlp_bias"] = False
    else:
        d["use_sliding_window"] = False
    return d
