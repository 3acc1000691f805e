"""Data-parallel sharding of the state pytrees as DTensor `Shard(0)` leaves on a 1-D ("dp",) mesh.

Why DTensor leaves at the pytree's edge and not FSDP2's `fully_shard`: `fully_shard` owns an
nn.Module's parameters through forward hooks, which unshard the module's own FSDPParams and ignore
params passed in (design notes A.2, experiment 2b), so a pure `loss_fn(params, batch, key)` could not
take the sharded tree as an argument. Here the params and AdamW moments stay the same pytrees, each
leaf a `Shard(0)` DTensor (Hugging Face `[out, in]` rows stay whole); `sharded_loss` gathers every leaf
with `full_tensor(grad_placements=[Partial()])` and calls the unchanged loss, and DTensor's autograd
issues the all-gathers forward and the reduce-scatters backward. The default grad_placements
(Replicate) silently gives wrong gradients (each rank's partial gradient is taken as the whole one):
tests/test_distributed.py checks against a single-process float64 reference.

torch.func.grad does not compose with DTensor (functorch's wrapper hides the subclass): the sharded
path is the autograd path only, and `check_autograd` refuses the other by name.

No process-group setup lives here (that is launch/distributed.py): these functions take a mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from optree import tree_map
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


def is_sharded(tree: Any) -> bool:
    """Whether any leaf of tree is a DTensor."""
    return any(isinstance(x, DTensor) for x in _leaves(tree))


def shard_tree(tree: Any, mesh: DeviceMesh) -> Any:
    """Every tensor leaf as a `Shard(0)` DTensor (0-d leaves `Replicate`), cut locally without communication.

    Every rank must hold the same full tree (as every rank of a data-parallel run does after the
    same init or load); rank r keeps rows `torch.chunk(x, W)[r]`, DTensor's own Shard(0) layout.
    """
    rank, world = mesh.get_local_rank(), mesh.size()

    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            return x
        if x.dim() == 0:
            return DTensor.from_local(x.clone(), mesh, [Replicate()], run_check=False)
        chunks = torch.chunk(x, world, dim=0)
        local = chunks[rank].clone() if rank < len(chunks) else x.new_empty((0, *x.shape[1:]))
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=x.shape, stride=x.stride())

    return tree_map(one, tree)


def unshard_tree(tree: Any) -> Any:
    """Every DTensor leaf gathered to a plain full tensor, differentiably: its gradient comes back `Partial`.

    grad_placements=[Partial()] declares that the gradient each rank computes from its own rows of
    the batch is a partial sum, so the backward reduce-scatters (sums) it into the shards. Without it
    DTensor treats each rank's gradient as already complete and keeps only the local rows.
    """
    return tree_map(lambda x: x.full_tensor(grad_placements=[Partial()]) if isinstance(x, DTensor) else x, tree)


def gather_tree(tree: Any) -> Any:
    """Every DTensor leaf as a plain full tensor, outside autograd (weights for the engine, checkpoints, hashes)."""
    return tree_map(lambda x: x.full_tensor().detach() if isinstance(x, DTensor) else x, tree)


def sharded_loss(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """loss_fn over a sharded params tree: gather the leaves (Partial grads), call the unchanged pure loss."""

    def wrapped(params: Any, batch: Any, key: Any) -> Any:
        return loss_fn(unshard_tree(params), batch, key)

    return wrapped


def check_autograd(params: Any, use_autograd: bool) -> None:
    """torch.func.grad over DTensor leaves fails inside functorch; say so before it does."""
    if not use_autograd and is_sharded(params):
        raise ValueError("use_autograd=False (torch.func.grad) does not compose with DTensor-sharded params "
                         "(functorch hides the DTensor subclass); use the autograd path (use_autograd=True) "
                         "under a device mesh")


def local_bytes(tree: Any) -> int:
    """Bytes this rank holds of tree's tensor leaves (a DTensor counts its local shard only)."""
    total = 0
    for x in _leaves(tree):
        if isinstance(x, DTensor):
            x = x.to_local()
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
    return total


def rank_rows(group_ids: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Row indices of the whole groups rank trains on: the sorted distinct groups dealt in contiguous
    blocks (`torch.chunk` of the group list), so the W slices partition the batch and each group's rows
    stay on one rank. Indices are in the batch's row order."""
    groups = torch.unique(group_ids, sorted=True)
    if world > groups.numel():
        raise ValueError(f"{groups.numel()} groups cannot be split over {world} data-parallel ranks: raise "
                         f"--prompts_per_step to at least the world size, or run fewer ranks")
    mine = torch.chunk(groups, world)[rank]
    return torch.nonzero(torch.isin(group_ids, mine)).squeeze(-1)


def all_reduce_metrics(metrics: dict[str, torch.Tensor], group: Any = None) -> dict[str, torch.Tensor]:
    """Each rank's metric shares summed over the ranks (keys ending in _max: the max), as float64 sums
    of float32 values so that the order of the W terms cannot move a float32 result."""
    out = {}
    for k in sorted(metrics):
        v = metrics[k]
        if isinstance(v, DTensor):
            out[k] = v.full_tensor()
            continue
        t = v.detach().to(torch.float64).clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX if k.endswith("_max") else dist.ReduceOp.SUM, group=group)
        out[k] = t.to(v.dtype)
    return out


def _leaves(tree: Any) -> list[Any]:
    from optree import tree_leaves

    return tree_leaves(tree)


def rank_batch(buf: Any, rank: int, world: int) -> Any:
    """Rank's whole groups of buf as one PackedBatch (one sample a row, the batch's full width) that
    carries the whole batch's loss-token and sample counts: the loss divides by the global counts and
    its metrics are this rank's shares of the global means (packing.token_share), so they sum over ranks."""
    from miles_fn import packing
    from miles_fn.rollout_buffer import _ROW_FIELDS

    num_tokens, num_samples = packing.whole_batch_counts(buf)
    rows = rank_rows(buf.group_ids, rank, world)
    local = buf._replace(num_tokens=num_tokens, num_samples=num_samples,
                         **{f: getattr(buf, f)[rows] for f in _ROW_FIELDS if getattr(buf, f) is not None})
    (mb,) = packing.pad(local, local.tokens.shape[1] * local.tokens.shape[0])
    return mb


def dp_train_step(state: Any, buf: Any, key: Any, loss_fn: Callable[..., Any], optim_cfg: Any,
                  mesh: DeviceMesh) -> tuple[Any, dict[str, torch.Tensor]]:
    """One data-parallel update of a TrainState: the same update as train.train_step on the whole batch.

    Takes and returns sharded params / AdamW moments (plain leaves are sharded first, so a replicated
    state works too). Rank r computes the loss of its groups against the gathered params; DTensor's
    backward reduce-scatters the partial gradients into the shards; clipping's global norm is the
    DTensor sum over shards; AdamW runs elementwise on the shards. The loss and metrics are all-reduced
    before the finiteness check, so every rank takes the same branch.
    """
    from miles_fn import train

    rank, world = mesh.get_local_rank(), mesh.size()
    state = state._replace(params=shard_tree(state.params, mesh), opt_state=shard_tree(state.opt_state, mesh))
    mb = rank_batch(buf, rank, world)
    grads, (loss, aux) = train.loss_and_grad(state.params, mb, key, sharded_loss(loss_fn), use_autograd=True)
    reduced = all_reduce_metrics({"loss": loss, **aux}, mesh.get_group())
    loss = reduced.pop("loss")
    state, metrics = train.apply_gradients(state, grads, loss, reduced, optim_cfg)
    metrics = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in metrics.items()}
    metrics["state_bytes_per_rank"] = torch.tensor(float(local_bytes((state.params, state.opt_state))))
    return state, metrics
