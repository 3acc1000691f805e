"""Atomic, verified checkpoints of any pytree of tensors and plain values.

Layout of one checkpoint directory:
    tensors.safetensors   every tensor leaf, named by its tree path
    shards/               DTensor leaves (a sharded train state under torchrun), through
                          torch.distributed.checkpoint: each rank writes its own rows
    meta.msgpack          {"body": msgpack(structure, metadata, sha256 of every file), "sha256": of body}
A checkpoint is written into a temporary directory, fsynced and renamed into
place, so a reader sees a whole checkpoint or none. Loading verifies every checksum
and names the file that fails. A sharded checkpoint loads under any sharding: with a mesh
its DTensor leaves come back as this mesh's shards (dcp reshards), without one as plain
full tensors in a single process with no process group (a 2-rank run resumed in 1, a
2-rank snapshot replayed in 1).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import msgpack
import torch
import torch.distributed as dist
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from state import train_state

FORMAT_VERSION = 1
_TENSORS, _META, _SHARDS = "tensors.safetensors", "meta.msgpack", "shards"
_NAMEDTUPLES: dict[str, type] = {
    "TrainState": train_state.TrainState,
    "AdamWState": train_state.AdamWState,
    "RolloutBuffer": train_state.RolloutBuffer,
    "ActorCriticState": train_state.ActorCriticState,
    "SpeculativeState": train_state.SpeculativeState,
}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted: missing, truncated, corrupted or of another format."""


def register_namedtuple(cls: type) -> type:
    """Let checkpoints hold another NamedTuple type (by its class name)."""
    _NAMEDTUPLES[cls.__name__] = cls
    return cls


def _is_dtensor(x: Any) -> bool:
    """isinstance(x, DTensor) without importing DTensor (~0.6 s) where none can exist yet."""
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def _encode(tree: Any, tensors: dict[str, torch.Tensor], path: str, sharded: dict[str, Any]) -> Any:
    if _is_dtensor(tree):
        sharded[path] = tree.detach()
        return {"__dt__": path, "shape": list(tree.shape), "dtype": str(tree.dtype).removeprefix("torch.")}
    if isinstance(tree, torch.Tensor):
        tensors[path] = tree.detach().contiguous().cpu()
        return {"__t__": path}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        name = type(tree).__name__
        if name not in _NAMEDTUPLES:
            raise TypeError(f"checkpoint: NamedTuple {name} is not registered (state.checkpoint.register_namedtuple)")
        fields = tree._asdict().items()
        return {"__nt__": name, "f": {k: _encode(v, tensors, f"{path}.{k}", sharded) for k, v in fields}}
    if isinstance(tree, dict):
        if not all(isinstance(k, str) for k in tree):
            raise TypeError(f"checkpoint: dict keys at {path or '<root>'} must be strings")
        return {"__d__": {k: _encode(v, tensors, f"{path}.{k}", sharded) for k, v in tree.items()}}
    if isinstance(tree, (list, tuple)):
        tag = "__l__" if isinstance(tree, list) else "__tu__"
        return {tag: [_encode(v, tensors, f"{path}.{i}", sharded) for i, v in enumerate(tree)]}
    if tree is None or isinstance(tree, (bool, int, float, str, bytes)):
        return tree
    raise TypeError(f"checkpoint: cannot store a {type(tree).__name__} at {path or '<root>'}")


def _decode(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, dict):
        if "__t__" in node:
            return tensors[node["__t__"]]
        if "__dt__" in node:
            return tensors[node["__dt__"]]
        if "__nt__" in node:
            return _NAMEDTUPLES[node["__nt__"]](**{k: _decode(v, tensors) for k, v in node["f"].items()})
        if "__d__" in node:
            return {k: _decode(v, tensors) for k, v in node["__d__"].items()}
        if "__l__" in node:
            return [_decode(v, tensors) for v in node["__l__"]]
        if "__tu__" in node:
            return tuple(_decode(v, tensors) for v in node["__tu__"])
    return node


def _fsync_write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    path: str, tree: Any, metadata: dict[str, Any] | None = None, before_commit: Callable[[], None] | None = None
) -> None:
    """Write `tree` (and msgpack-able `metadata`) to directory `path`, atomically.

    A tree with DTensor leaves is a collective: every rank calls save at the same point, each writes
    its shards (torch.distributed.checkpoint), rank 0 writes the rest, checksums it all and renames.
    `before_commit` runs when the temporary directory is complete and not yet renamed
    into place: a hook for tests that kill the writer in the middle of a write.
    """
    tensors: dict[str, torch.Tensor] = {}
    sharded: dict[str, Any] = {}  # path -> DTensor
    structure = _encode(tree, tensors, "", sharded)
    storages: set[int] = set()
    for name, t in tensors.items():  # safetensors refuses shared memory (e.g. a KL reference aliasing params)
        ptr = t.untyped_storage().data_ptr()
        if ptr in storages:
            tensors[name] = t.clone()
        storages.add(ptr)
    collective = bool(sharded) and dist.is_initialized()
    main = not collective or dist.get_rank() == 0
    parent = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp-{os.getpid()}"
    if collective:  # one temporary directory for all ranks: rank 0's
        box = [tmp]
        dist.broadcast_object_list(box, src=0)
        tmp = box[0]
    if main:
        os.makedirs(parent, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    shard_sums: dict[str, str] = {}
    if sharded:
        if collective:
            dist.barrier()
        import torch.distributed.checkpoint as dcp  # only sharded states pay its import

        dcp.save(sharded, checkpoint_id=os.path.join(tmp, _SHARDS), no_dist=not collective)
        if collective:
            dist.barrier()
        if main:
            shard_dir = os.path.join(tmp, _SHARDS)
            shard_sums = {n: _sha256_file(os.path.join(shard_dir, n)) for n in sorted(os.listdir(shard_dir))}
            _fsync_dir(shard_dir)
    if main:
        blob = st_save(tensors) if tensors else b""
        body = msgpack.packb(
            {
                "format": FORMAT_VERSION,
                "structure": structure,
                "metadata": metadata or {},
                "tensors_sha256": hashlib.sha256(blob).hexdigest(),
                "shards_sha256": shard_sums,
            },
            use_bin_type=True,
        )
        _fsync_write(os.path.join(tmp, _TENSORS), blob)
        _fsync_write(os.path.join(tmp, _META),
                     msgpack.packb({"body": body, "sha256": hashlib.sha256(body).hexdigest()}))
        _fsync_dir(tmp)
        if before_commit is not None:
            before_commit()
        if os.path.exists(path):
            old = f"{path}.old-{os.getpid()}"
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old)
        else:
            os.rename(tmp, path)
        _fsync_dir(parent)
    if collective:
        dist.barrier()  # no rank goes on (or reads the checkpoint) before it is in place


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read(path: str) -> bytes:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing (not a complete checkpoint)")
    with open(path, "rb") as f:
        return f.read()


class Loaded(NamedTuple):
    tree: Any
    metadata: dict[str, Any]


def load(path: str, mesh: Any = None) -> Loaded:
    """Read and verify a checkpoint written by `save`; raises CheckpointError naming the bad file.

    Sharded leaves load as `mesh`'s Shard(0) DTensors when a mesh is given (a collective: every rank
    calls load), else as plain full tensors with no process group.
    """
    meta_path, tensor_path = os.path.join(path, _META), os.path.join(path, _TENSORS)
    try:
        outer = msgpack.unpackb(_read(meta_path), raw=False)
        body = outer["body"]
        ok = hashlib.sha256(body).hexdigest() == outer["sha256"]
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{meta_path}: unreadable ({type(e).__name__}: {e}); the checkpoint is corrupted") from e
    if not ok:
        raise CheckpointError(f"{meta_path}: checksum mismatch; the checkpoint is corrupted")
    meta = msgpack.unpackb(body, raw=False)
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: format {meta.get('format')} is not {FORMAT_VERSION}")
    blob = _read(tensor_path)
    if hashlib.sha256(blob).hexdigest() != meta["tensors_sha256"]:
        raise CheckpointError(f"{tensor_path}: checksum mismatch (truncated or corrupted); refusing to load it")
    tensors = {k: v.clone() for k, v in st_load(blob).items()} if blob else {}
    specs: dict[str, tuple[list[int], str]] = {}
    _sharded_specs(meta["structure"], specs)
    if specs:
        tensors.update(_load_shards(os.path.join(path, _SHARDS), meta.get("shards_sha256") or {}, specs, mesh))
    return Loaded(_decode(meta["structure"], tensors), meta["metadata"])


def _sharded_specs(node: Any, out: dict[str, tuple[list[int], str]]) -> None:
    if isinstance(node, dict):
        if "__dt__" in node:
            out[node["__dt__"]] = (node["shape"], node["dtype"])
            return
        for v in node.values():
            _sharded_specs(v, out)
    elif isinstance(node, list):
        for v in node:
            _sharded_specs(v, out)


def _load_shards(shard_dir: str, sums: dict[str, str], specs: dict[str, tuple[list[int], str]],
                 mesh: Any) -> dict[str, torch.Tensor]:
    present = sorted(os.listdir(shard_dir)) if os.path.isdir(shard_dir) else []
    if not sums or present != sorted(sums):
        raise CheckpointError(f"{shard_dir}: holds {present}, not the shard files {sorted(sums)} the checkpoint "
                              "lists; it is incomplete or corrupted")
    for name, want in sums.items():
        if _sha256_file(os.path.join(shard_dir, name)) != want:
            raise CheckpointError(f"{os.path.join(shard_dir, name)}: checksum mismatch (truncated or corrupted); "
                                  "refusing to load it")
    out = {k: _template(shape, getattr(torch, dtype), mesh) for k, (shape, dtype) in specs.items()}
    import torch.distributed.checkpoint as dcp

    dcp.load(out, checkpoint_id=shard_dir, no_dist=mesh is None)
    return out


def _template(shape: list[int], dtype: torch.dtype, mesh: Any) -> torch.Tensor:
    """An empty leaf for dcp.load to fill: full and plain, or this rank's torch.chunk rows as a Shard(0) DTensor."""
    if mesh is None:
        return torch.empty(shape, dtype=dtype)
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not shape:
        return DTensor.from_local(torch.empty((), dtype=dtype), mesh, [Replicate()], run_check=False)
    rows, world, rank = shape[0], mesh.size(), mesh.get_local_rank()
    size = -(-rows // world) if rows else 0
    mine = max(0, min(rows, (rank + 1) * size) - rank * size) if size else 0
    local = torch.empty((mine, *shape[1:]), dtype=dtype)
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)


_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def latest(root: str) -> str | None:
    """The newest complete checkpoint directory under root (temporary ones are ignored)."""
    if not os.path.isdir(root):
        return None
    steps = [(int(m.group(1)), n) for n in os.listdir(root) if (m := _STEP_DIR.match(n))]
    return os.path.join(root, max(steps)[1]) if steps else None
