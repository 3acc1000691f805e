"""LoRA: low-rank adapters trained beside a frozen base model (Hu et al. 2021), as pure functions.

adapters = {"layers": [{"wq": {"a": A [r, in], "b": B [out, r]}, ...}, ...]}
holds one (A, B) pair for each targeted linear W [out, in] of each layer (the model's names: wq, wk, wv, wo,
w_gate, w_up, w_down); biases, norms, embeddings and the head stay frozen. The forward runs on
`merge(base, adapters, cfg)`, whose targeted weights are W + (alpha / r) B @ A, so the model code is untouched,
the rollout engine is sent the very merged tensors the trainer computes on, and autograd reaches only the
adapter leaves (the base holds no graph). A training state under LoRA is a TrainState whose `params` are the
adapters (so AdamW keeps moments for them alone) and whose `base` is the frozen model.

Init as peft's: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform with a = sqrt(5)), here from an explicit key,
and B = 0, so that at step 0 the merged weights are the base's bit for bit (W + 0 is W).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from miles_fn import optim, prng
from miles_fn.model import Params
from state.train_state import TrainState

# Target names of the flags (and peft's *_proj names) -> the model's weight names (miles_fn.model).
TARGETS = (("q", "wq"), ("k", "wk"), ("v", "wv"), ("o", "wo"), ("gate", "w_gate"), ("up", "w_up"),
           ("down", "w_down"))
ALL_TARGETS = tuple(t for t, _ in TARGETS)
_WEIGHT = dict(TARGETS)

Adapters = dict[str, Any]
LossFn = Callable[[Any, Any, prng.Key], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = 0  # 0 = off: the whole model trains
    alpha: float = 16.0  # the update is scaled by alpha / rank
    targets: tuple[str, ...] = ALL_TARGETS  # of ALL_TARGETS

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def parse_targets(text: str) -> tuple[str, ...]:
    """"q,v" or "q_proj,v_proj" -> ("q", "v") in model order; ValueError names an unknown or missing target."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    short = [n[: -len("_proj")] if n.endswith("_proj") else n for n in names]
    unknown = [n for n, s in zip(names, short, strict=True) if s not in _WEIGHT]
    if unknown or not short:
        raise ValueError(f"unknown LoRA target(s) {unknown or names!r}; choose from {','.join(ALL_TARGETS)} "
                         f"(or their *_proj names)")
    return tuple(t for t in ALL_TARGETS if t in short)


def init_adapters(base: Params, cfg: LoraConfig, key: prng.Key) -> Adapters:
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) from fold_in(key, i) for the i-th (layer, target), B = 0; float32."""
    layers = []
    i = 0
    for layer in base["layers"]:
        entry = {}
        for t in cfg.targets:
            w = layer[_WEIGHT[t]]
            out_dim, in_dim = w.shape
            bound = 1.0 / math.sqrt(in_dim)
            a = (prng.uniform(prng.fold_in(key, i), (cfg.rank, in_dim), torch.float64) * 2.0 - 1.0) * bound
            entry[_WEIGHT[t]] = {"a": a.to(torch.float32).to(w.device),
                                 "b": torch.zeros(out_dim, cfg.rank, dtype=torch.float32, device=w.device)}
            i += 1
        layers.append(entry)
    return {"layers": layers}


def merge(base: Params, adapters: Adapters, cfg: LoraConfig) -> Params:
    """The params the forward runs on: base with W + scale * B @ A in each adapted weight (in W's dtype).

    A new tree; the base's tensors are shared, never written. Differentiable in the adapters.
    """
    layers = []
    for lb, la in zip(base["layers"], adapters["layers"], strict=True):
        merged = dict(lb)
        for name, ab in la.items():
            w = lb[name]
            delta = (ab["b"] @ ab["a"]) * cfg.scale
            merged[name] = (w.to(delta.dtype) + delta).to(w.dtype)
        layers.append(merged)
    return {**base, "layers": layers}


def init_state(base: Params, cfg: LoraConfig, adapter_key: prng.Key, run_key: prng.Key) -> TrainState:
    """A TrainState training only the adapters: params = adapters, AdamW moments of their shapes, base beside."""
    adapters = init_adapters(base, cfg, adapter_key)
    return TrainState(params=adapters, opt_state=optim.adamw_init(adapters), step=torch.zeros((), dtype=torch.int64),
                      key=run_key, base=base)


def adapted_loss(loss_fn: LossFn, base: Params, cfg: LoraConfig) -> LossFn:
    """loss_fn over the adapters: loss_fn(merge(base, adapters), batch, key), for train_step on a LoRA state."""

    def loss(adapters: Adapters, batch: Any, key: prng.Key) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return loss_fn(merge(base, adapters, cfg), batch, key)

    return loss


def loss_for(loss_fn: LossFn, state: Any, cfg: LoraConfig | None) -> LossFn:
    """The loss a train step of `state` differentiates: adapted to its base under LoRA, else loss_fn itself."""
    base = getattr(state, "base", None)
    if base is None:
        return loss_fn
    if cfg is None or not cfg.enabled:
        raise ValueError("a LoRA train state (with a frozen base) needs an enabled LoraConfig (--lora_rank > 0)")
    return adapted_loss(loss_fn, base, cfg)


def full_params(params: Any, base: Params | None, cfg: LoraConfig | None) -> Params:
    """The full model of trained `params`: themselves, or with a base (LoRA) the base merged with them."""
    if base is None:
        return params
    with torch.no_grad():
        return merge(base, params, cfg)


def model_params(state: Any, cfg: LoraConfig | None) -> Params:
    """The full model a state stands for (what the engine serves, what is exported): merged under LoRA."""
    return full_params(state.params, getattr(state, "base", None), cfg)


def trainable_count(cfg: LoraConfig, layer_shapes: list[dict[str, tuple[int, ...]]]) -> int:
    """Adapter parameters: r * (out + in) per targeted weight, from the model's shapes (model.param_shapes)."""
    return sum(cfg.rank * sum(layer[_WEIGHT[t]]) for layer in layer_shapes for t in cfg.targets)
