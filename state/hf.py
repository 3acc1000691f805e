"""Hugging Face checkpoint import and export (config.json + safetensors: Qwen2, Llama, Qwen3, Qwen3-MoE).

Qwen3-MoE experts: export writes one tensor per expert (mlp.experts.{e}.{gate,up,down}_proj.weight), as
save_pretrained does and SGLang/vLLM load; import reads that and transformers 5's fused in-memory form
(mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from miles_fn.config import ModelConfig, from_hf_dict, to_hf_dict
from miles_fn.model import Params, param_shapes

_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "wk": "self_attn.k_proj.weight",
    "bk": "self_attn.k_proj.bias",
    "wv": "self_attn.v_proj.weight",
    "bv": "self_attn.v_proj.bias",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "router": "mlp.gate.weight",
}
_EXPERT_LEAVES = ("e_gate", "e_up", "e_down")
_EXPERT_NAMES = {"e_gate": "gate_proj", "e_up": "up_proj", "e_down": "down_proj"}
_TOP_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}


def hf_names(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Hugging Face tensor name -> path into the params tree."""
    names: dict[str, tuple[Any, ...]] = {}
    for ours, theirs in _TOP_NAMES.items():
        if ours != "lm_head" or not cfg.tie_word_embeddings:
            names[theirs] = (ours,)
    for i in range(cfg.num_layers):
        for ours in param_shapes(cfg)["layers"][i]:
            if ours not in _EXPERT_LEAVES:
                names[f"model.layers.{i}.{_LAYER_NAMES[ours]}"] = ("layers", i, ours)
    return names


def weight_names(cfg: ModelConfig) -> dict[str, tuple[Any, ...]]:
    """hf_names plus one name per expert matrix (mlp.experts.{j}.gate_proj.weight -> ("layers", i, "e_gate", j),
    a row of the stacked tensor): every tensor a weight update to a server carries, as SGLang loads them."""
    names = dict(hf_names(cfg))
    for i in cfg.moe_layers:
        for ours, theirs in _EXPERT_NAMES.items():
            for j in range(cfg.num_experts):
                names[f"model.layers.{i}.mlp.experts.{j}.{theirs}.weight"] = ("layers", i, ours, j)
    return names


def named_tensors(cfg: ModelConfig, params: Params) -> dict[str, torch.Tensor]:
    """Every weight under its weight_names name (detached views, not copies): what export writes and what
    a weight update to a server carries."""
    out = {}
    for name, where in weight_names(cfg).items():
        node = params
        for w in where:
            node = node[w]
        out[name] = node.detach()
    return out


def _read_experts(path: str, tensors: dict[str, torch.Tensor], i: int, e: int) -> dict[str, torch.Tensor]:
    """Layer i's stacked experts from per-expert tensors or the fused form (popped from `tensors`)."""
    pre = f"model.layers.{i}.mlp.experts."
    if pre + "gate_up_proj" in tensors:
        gu = tensors.pop(pre + "gate_up_proj")
        if pre + "down_proj" not in tensors:
            raise KeyError(f"{path}: {pre}gate_up_proj without {pre}down_proj")
        half = gu.shape[1] // 2
        return {"e_gate": gu[:, :half], "e_up": gu[:, half:], "e_down": tensors.pop(pre + "down_proj")}
    out = {}
    for ours, theirs in _EXPERT_NAMES.items():
        names = [f"{pre}{j}.{theirs}.weight" for j in range(e)]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise KeyError(f"{path}: expert tensor {missing[0]!r} is missing (and no fused {pre}gate_up_proj)")
        out[ours] = torch.stack([tensors.pop(n) for n in names])
    return out


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = [f for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files (only safetensors checkpoints are read)")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        file = os.path.join(path, name)
        try:
            with safe_open(file, framework="pt") as f:
                for k in f.keys():
                    out[k] = f.get_tensor(k)
        except (SafetensorError, OSError) as e:  # a truncated or garbage file, or one the index names but lacks
            raise ValueError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e})") from e
    return out


def load_hf(path: str, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, Params]:
    """Read a transformers checkpoint directory into (config, params)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{cfg_path}: not found (a Hugging Face checkpoint directory needs config.json)")
    with open(cfg_path) as f:
        cfg = from_hf_dict(json.load(f))
    tensors = _read_tensors(path)
    shapes = param_shapes(cfg)
    params: Params = {k: v for k, v in shapes.items() if k != "layers"}
    params["layers"] = [dict(layer) for layer in shapes["layers"]]
    for name, where in hf_names(cfg).items():
        if name not in tensors:
            raise KeyError(f"{path}: tensor {name!r} is missing from the checkpoint")
        node = params
        for w in where[:-1]:
            node = node[w]
        expected = node[where[-1]]
        t = tensors.pop(name)
        if tuple(t.shape) != tuple(expected):
            raise ValueError(f"{path}: tensor {name!r} has shape {tuple(t.shape)}, config implies {expected}")
        # clone: own, aligned storage; CPU kernels give different bits on unaligned (mmapped) data
        node[where[-1]] = t.to(dtype).clone()
    for i in cfg.moe_layers:
        for ours, t in _read_experts(path, tensors, i, cfg.num_experts).items():
            expected = shapes["layers"][i][ours]
            if tuple(t.shape) != tuple(expected):
                raise ValueError(f"{path}: layer {i} experts {ours} have shape {tuple(t.shape)}, config implies "
                                 f"{expected}")
            params["layers"][i][ours] = t.to(dtype).contiguous().clone()
    tensors.pop("lm_head.weight", None)  # some tied checkpoints store a copy
    unknown = [k for k in tensors if not k.endswith("rotary_emb.inv_freq")]
    if unknown:
        raise ValueError(f"{path}: tensors the model does not use: {unknown[:5]}{'...' if len(unknown) > 5 else ''}")
    return cfg, params


def save_hf(path: str, cfg: ModelConfig, params: Params, dtype: torch.dtype = torch.float32) -> None:
    """Write config.json + model.safetensors that transformers' from_pretrained loads."""
    os.makedirs(path, exist_ok=True)
    tensors = {name: t.to(dtype).contiguous().clone() for name, t in named_tensors(cfg, params).items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(to_hf_dict(cfg), f, indent=2)


def save_peft_adapter(path: str, adapters: Any, lora_cfg: Any, base_model: str = "") -> None:
    """Write LoRA adapters (miles_fn.lora) as peft saves them: adapter_config.json + adapter_model.safetensors,
    which `peft.PeftModel.from_pretrained(base, path)` loads onto the base model in transformers."""
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for i, layer in enumerate(adapters["layers"]):
        for ours, ab in layer.items():
            module = _LAYER_NAMES[ours].removesuffix(".weight")
            for part, key in (("a", "lora_A"), ("b", "lora_B")):
                name = f"base_model.model.model.layers.{i}.{module}.{key}.weight"
                tensors[name] = ab[part].detach().cpu().contiguous()
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    targets = sorted({_LAYER_NAMES[n].removesuffix(".weight").split(".")[-1] for layer in adapters["layers"]
                      for n in layer})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha,
              "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "base_model_name_or_path": base_model or None}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
