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
from optree import tree_flatten, tree_map, tree_unflatten
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


def rank_buffer(buf: Any, rank: int, world: int) -> Any:
    """Rank's whole groups of buf (`rank_rows`), carrying the whole batch's loss-token and sample counts: the
    loss divides by the global counts and its metrics are this rank's shares of the global means
    (packing.token_share), so losses, gradients and metrics sum over ranks to the whole batch's."""
    from miles_fn import packing
    from miles_fn.rollout_buffer import _ROW_FIELDS

    num_tokens, num_samples = packing.whole_batch_counts(buf)
    rows = rank_rows(buf.group_ids, rank, world)
    return buf._replace(num_tokens=num_tokens, num_samples=num_samples,
                        **{f: getattr(buf, f)[rows] for f in _ROW_FIELDS if getattr(buf, f) is not None})


def rank_batch(buf: Any, rank: int, world: int) -> Any:
    """`rank_buffer` as one PackedBatch (one sample a row, the batch's full width)."""
    from miles_fn import packing

    local = rank_buffer(buf, rank, world)
    (mb,) = packing.pad(local, local.tokens.shape[1] * local.tokens.shape[0])
    return mb


def dp_train_step(state: Any, buf: Any, key: Any, loss_fn: Callable[..., Any], optim_cfg: Any,
                  mesh: DeviceMesh) -> tuple[Any, dict[str, torch.Tensor]]:
    """One data-parallel update of a TrainState on the whole batch buf: train.train_step's update, to rounding.

    Takes and returns sharded params / AdamW moments (plain leaves are sharded first, so a replicated
    state works too). The loss runs on this rank's groups over the gathered params (`sharded_loss`);
    DTensor's backward reduce-scatters the partial gradients into the shards; clipping's global norm
    is the DTensor sum over shards; AdamW runs elementwise on the shards. The loss and metrics are
    all-reduced before the finiteness check, so every rank takes the same branch. The reduction
    order follows the backend (`dp_train_step_tiles` is the bitwise one).
    """
    from miles_fn import train

    state = shard_state(state, mesh)
    mb = rank_batch(buf, mesh.get_local_rank(), mesh.size())
    grads, (loss, aux) = train.loss_and_grad(state.params, mb, key, sharded_loss(loss_fn))
    return _apply_reduced(state, grads, loss, aux, {}, optim_cfg, mesh)


def dp_train_step_accumulated(state: Any, micro_batches: Any, key: Any, loss_fn: Callable[..., Any], optim_cfg: Any,
                              mesh: DeviceMesh, max_oom_splits: int = 0,
                              log: Callable[[str], None] | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """One data-parallel update from this rank's micro-batches (packed from its `rank_buffer`: global counts).

    The params are gathered once and the micro-batches' gradients summed locally (train.accumulate_gradients,
    OOM halving included), then reduce-scattered once (a Partial -> Shard(0) DTensor redistribute): no
    collective runs per micro-batch, so ranks may pack their slices into different numbers of them.
    """
    from miles_fn import train

    state = shard_state(state, mesh)
    full = gather_tree(state.params)
    grads, loss, aux, stats = train.accumulate_gradients(full, micro_batches, key, loss_fn, max_oom_splits, log)
    del full
    grads = tree_map(lambda g, p: _reduce_scatter(g, p, mesh), grads, state.params)
    return _apply_reduced(state, grads, loss, aux, stats, optim_cfg, mesh)


def _reduce_scatter(g: torch.Tensor, like: Any, mesh: DeviceMesh) -> Any:
    """This rank's partial full-size gradient summed over ranks into `like`'s placement (its shard)."""
    partial = DTensor.from_local(g, mesh, [Partial()], run_check=False, shape=g.shape, stride=g.stride())
    return partial.redistribute(mesh, like.placements)


def _apply_reduced(state: Any, grads: Any, loss: torch.Tensor, aux: dict[str, torch.Tensor],
                   stats: dict[str, torch.Tensor], optim_cfg: Any, mesh: DeviceMesh) -> tuple[Any, dict[str, Any]]:
    """The all-reduced loss and metrics, then `_apply_local` on the DTensor gradients' local shards."""
    reduced = all_reduce_metrics({"loss": loss, **aux, **stats}, mesh.get_group())
    loss = reduced.pop("loss")
    return _apply_local(state, tree_map(_local, grads), loss, reduced, optim_cfg, mesh)


def shard_state(state: Any, mesh: DeviceMesh) -> Any:
    """state with its params and optimizer moments sharded (already sharded leaves stay as they are)."""
    return state._replace(params=shard_tree(state.params, mesh), opt_state=shard_tree(state.opt_state, mesh))


def full_state(state: Any) -> Any:
    """state with its params and moments gathered: the state one process would hold (a collective)."""
    if not is_sharded(state):
        return state
    return state._replace(params=gather_tree(state.params), opt_state=gather_tree(state.opt_state))


def dp_train_step_tiles(state: Any, tiles: Any, key: Any, loss_fn: Callable[..., Any], optim_cfg: Any,
                        mesh: DeviceMesh) -> tuple[Any, dict[str, torch.Tensor]]:
    """The --true_on_policy update over the batch's fixed gradient tiles: bitwise the same state and
    metrics at every (power-of-two) world size, and as train.train_step_accumulated(fixed_order=True)
    in one process.

    Why a hand-written reduce-scatter: a ring or tree reduce-scatter (DTensor's, NCCL's, gloo's) sums
    the ranks' partial gradients in an order set by the world size, so the bits would move with it.
    Here the tiles' gradients are summed in the one balanced tree of train.balanced_sum: the T tiles
    sit in P = max(next power of two of T, W) slots, rank r sums its aligned block of P/W slots (a
    subtree), and one all_to_all hands rank r the rows it owns of every rank's block sum, which it
    adds in the same tree in rank order. The norm comes from per-row sums of squares, gathered
    (optim.norm_from_row_sums); the loss and metrics are the same tree over per-rank vectors.
    Communication: one all-gather of the params, one all_to_all of the gradient (a reduce-scatter's
    bytes), two small all-gathers.
    """
    from miles_fn import train

    rank, world = mesh.get_local_rank(), mesh.size()
    if world & (world - 1):
        raise ValueError(f"--true_on_policy across ranks sums the gradient tiles in a balanced tree, which needs a "
                         f"power-of-two world size, not {world}; run 1, 2, 4, 8, ... ranks")
    group = mesh.get_group()
    state = shard_state(state, mesh)
    n, block = len(tiles), _block_size(len(tiles), world)
    present = min(world, -(-n // block))  # ranks whose block holds a tile (the others send zeros)
    full = gather_tree(state.params)
    if rank < present:
        parts = (train.loss_and_grad(full, tiles[i], key, loss_fn) for i in range(rank * block,
                                                                                   min(n, (rank + 1) * block)))
        grads, loss, aux = train.balanced_sum(((g, lo, a) for g, (lo, a) in parts), train.add_grads_loss_aux)
    else:
        grads, loss, aux = tree_map(torch.zeros_like, full), torch.zeros(()), None
    del full
    keys = [None]
    if rank == 0:
        keys[0] = [("loss", loss.dtype)] + [(k, aux[k].dtype) for k in sorted(aux)]
    dist.broadcast_object_list(keys, src=dist.get_global_rank(group, 0), group=group)
    mine = {"loss": loss, **aux} if aux is not None else None
    reduced = _gather_tree_sum_scalars(mine, keys[0], world, present, group)
    loss, aux = reduced.pop("loss"), reduced
    local_grads = _reduce_scatter_balanced(grads, rank, world, present, group)
    new, metrics = _apply_local(state, local_grads, loss, aux, optim_cfg, mesh)
    metrics.update(micro_batches=torch.tensor(float(n)), oom_splits=torch.tensor(0.0))
    return new, metrics


def _apply_local(state: Any, local_grads: Any, loss: torch.Tensor, aux: dict[str, torch.Tensor], optim_cfg: Any,
                 mesh: DeviceMesh) -> tuple[Any, dict[str, torch.Tensor]]:
    """AdamW on this rank's shards from its rows of the summed gradient (plain tensors). The clipping norm
    comes from per-row sums gathered from every rank, so it is the same on all of them and does not
    depend on the world size; so is the finiteness check it implies (train.apply_gradients)."""
    from miles_fn import optim, train

    shapes = [x.shape for x in tree_flatten(state.params)[0]]
    norm = optim.norm_from_row_sums(_gathered_row_sums(local_grads, shapes, mesh.size(), mesh.get_group()))
    local_state = state._replace(params=tree_map(_local, state.params), opt_state=tree_map(_local, state.opt_state))
    new_local, metrics = train.apply_gradients(local_state, local_grads, loss, aux, optim_cfg, norm)
    new = new_local._replace(params=_like(state.params, new_local.params),
                             opt_state=_like(state.opt_state, new_local.opt_state))
    return new, metrics


def _gather_tree_sum_scalars(mine: dict[str, torch.Tensor] | None, keys: list[tuple[str, torch.dtype]], world: int,
                             present: int, group: Any) -> dict[str, torch.Tensor]:
    """Each scalar summed over the present ranks in balanced_sum's tree (keys ending in _max: the max), in its
    own dtype, so the bits are those of one process summing the same block sums."""
    from miles_fn import train

    out = {}
    for dtype in dict.fromkeys(d for _, d in keys):
        names = [k for k, d in keys if d == dtype]
        vec = torch.stack([mine[k] for k in names]) if mine is not None else torch.zeros(len(names), dtype=dtype)
        rows = [torch.empty_like(vec) for _ in range(world)]
        dist.all_gather(rows, vec.contiguous(), group=group)
        summed, maxed = train.balanced_sum(rows[:present], torch.add), torch.stack(rows[:present]).amax(dim=0)
        out.update({k: (maxed if k.endswith("_max") else summed)[i] for i, k in enumerate(names)})
    return out


def _block_size(n: int, world: int) -> int:
    slots = max(1 << max(n - 1, 0).bit_length(), world)
    return slots // world


def _row_range(rows: int, rank: int, world: int) -> tuple[int, int]:
    """The rows of a dim-0 size `rows` that rank holds: torch.chunk's (and DTensor Shard(0)'s) split."""
    size = -(-rows // world) if rows else 0
    lo = min(rows, rank * size)
    return lo, min(rows, lo + size)


def _reduce_scatter_balanced(grads: Any, rank: int, world: int, present: int, group: Any) -> Any:
    """This rank's Shard(0) rows of the sum over ranks of their full-size `grads`, added in rank order in
    train.balanced_sum's tree (ranks >= present hold no tiles and are left out of the sum)."""
    from miles_fn import train

    leaves, spec = tree_flatten(grads)
    out = []
    for g in leaves:
        if g.dim() == 0:  # a 0-d leaf is replicated: every rank gets the whole sum
            pieces = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(pieces, g.contiguous(), group=group)
            out.append(train.balanced_sum(pieces[:present], torch.add))
            continue
        rows = g.shape[0]
        send = [g[slice(*_row_range(rows, j, world))].reshape(-1) for j in range(world)]
        lo, hi = _row_range(rows, rank, world)
        mine = (hi - lo) * (g.numel() // rows)
        recv = g.new_empty(mine * world)
        dist.all_to_all_single(recv, torch.cat(send), [mine] * world, [s.numel() for s in send], group=group)
        pieces = [p.reshape(hi - lo, *g.shape[1:]) for p in recv.split(mine)] if mine else [
            g.new_empty((0, *g.shape[1:]))] * world
        out.append(train.balanced_sum(pieces[:present], torch.add))
    return tree_unflatten(spec, out)


def _gathered_row_sums(local_grads: Any, full_shapes: list[torch.Size], world: int, group: Any) -> list[torch.Tensor]:
    """Every leaf's whole vector of per-row float64 sums of squares, gathered from the ranks' row slices
    (one all_gather of a vector padded to the longest rank's)."""
    from miles_fn import optim

    leaves, _ = tree_flatten(local_grads)
    mine = [optim.row_sums_of_squares(g) for g in leaves]

    def length(shape: torch.Size, j: int) -> int:  # rows rank j holds of a leaf (a 0-d leaf: its one value)
        if len(shape) == 0:
            return 1
        lo, hi = _row_range(shape[0], j, world)
        return hi - lo

    width = max(sum(length(sh, j) for sh in full_shapes) for j in range(world))
    vec = torch.zeros(max(width, 1), dtype=torch.float64)
    if mine:
        flat = torch.cat(mine)
        vec[: flat.numel()] = flat
    gathered = [torch.empty_like(vec) for _ in range(world)]
    dist.all_gather(gathered, vec, group=group)
    out, offsets = [], [0] * world
    for i, sh in enumerate(full_shapes):
        parts = []
        for j in range(world):
            parts.append(gathered[j][offsets[j]: offsets[j] + length(sh, j)])
            offsets[j] += length(sh, j)
        out.append(mine[i] if len(sh) == 0 else torch.cat(parts))
    return out


def _local(x: Any) -> Any:
    return x.to_local() if isinstance(x, DTensor) else x


def _like(template: Any, local: Any) -> Any:
    """local's tensors as DTensors placed as template's (plain template leaves stay plain)."""
    return tree_map(lambda t, x: DTensor.from_local(x, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                                    stride=t.stride()) if isinstance(t, DTensor) else x,
                    template, local)
