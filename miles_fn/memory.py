"""Training memory: an activation estimate, the token-budget planner, and host offload of state.

The planner is pure: the caller measures free memory (launch.memory does, with
torch.cuda.mem_get_info on CUDA and MemAvailable on CPU) and passes it in.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from miles_fn.config import ModelConfig
from state.tree import tree_map

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """How a step's batch is cut and kept in memory (the --max_tokens_per_micro_batch block of flags)."""

    max_tokens_per_micro_batch: int = 0  # 0 = the whole batch in one step, right-padded
    pack_row_len: int = 0  # 0 = the longest sample of the step
    recompute: bool = False
    memory_margin_gb: float = 0.0
    offload_train_state: bool = False
    max_oom_splits: int = 3
    # --true_on_policy: padded tokens per fixed gradient tile (0 = off). Micro-batches are then these
    # tiles, which do not depend on the token budget, so neither do the update's bits (launch.memory).
    grad_tile_tokens: int = 0


def activation_bytes_per_token(cfg: ModelConfig, row_len: int, recompute: bool, dtype_bytes: int = 4) -> int:
    """Estimated bytes kept for the backward pass per packed token, for rows of row_len tokens.

    Per layer: x, normed x, q, k, v, rotated q and k, attention out, residual, normed residual (7H + 3KV),
    the MLP's gate, silu(gate), up and product (4I), and attention weights over the row (heads * row_len)
    when attention keeps them; plus logits, their log-softmax and the scaled logits (3V) and the bool mask
    row (row_len bytes). With recompute a layer keeps only its input (H) and one layer is live at a time.
    """
    h, kv, i = cfg.hidden_size, cfg.num_kv_heads * cfg.dim_head, cfg.intermediate_size
    layer = 7 * h + 3 * kv + 4 * i + cfg.num_heads * row_len
    kept = cfg.num_layers * h + layer if recompute else cfg.num_layers * layer
    return dtype_bytes * (kept + 3 * cfg.vocab_size) + row_len


def plan_token_budget(requested: int, free_bytes: int, margin_gb: float, bytes_per_token: int) -> int:
    """The largest budget <= requested whose estimated activations fit in free memory less the margin.

    budget = min(requested, floor((free - margin) / bytes_per_token)).
    """
    usable = free_bytes - int(margin_gb * GIB)
    if usable <= 0:
        raise ValueError(
            f"--memory_margin_gb={margin_gb} leaves no memory: only {free_bytes / GIB:.2f} GiB is free"
        )
    return max(0, min(requested, usable // max(bytes_per_token, 1)))


def offload(tree: Any) -> Any:
    """A copy of tree with every tensor in host memory; tree itself is untouched.

    From CUDA: pinned host buffers filled by non_blocking copies, then one synchronize, so the
    caller may drop the device tree at once and the transfers overlap one another. On CPU the
    copies are plain clones (the same semantics: a host copy independent of the original).
    """
    cuda = [False]

    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.device.type != "cuda":
            return x.detach().clone()
        cuda[0] = True
        host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
        return host.copy_(x.detach(), non_blocking=True)

    out = tree_map(one, tree)
    if cuda[0]:
        torch.cuda.synchronize()
    return out


def reload(tree: Any, device: torch.device | str) -> Any:
    """A copy of an offloaded tree on device (non_blocking from pinned memory on CUDA, then synchronize)."""
    device = torch.device(device)

    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if device.type == "cpu":
            return x.detach().clone()
        return x.to(device, non_blocking=x.is_pinned())

    out = tree_map(one, tree)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out
