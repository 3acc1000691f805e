"""Atomic, verified checkpoints of any pytree of tensors and plain values.

Layout of one checkpoint directory:
    tensors.safetensors   every tensor leaf, named by its tree path
    meta.msgpack          {"body": msgpack(structure, metadata, tensor sha256), "sha256": of body}
A checkpoint is written into a temporary directory, fsynced and renamed into
place, so a reader sees a whole checkpoint or none. Loading verifies both checksums
and names the file that fails.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Callable
from typing import Any, NamedTuple

import msgpack
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from state import train_state

FORMAT_VERSION = 1
_TENSORS, _META = "tensors.safetensors", "meta.msgpack"
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


def _encode(tree: Any, tensors: dict[str, torch.Tensor], path: str) -> Any:
    if isinstance(tree, torch.Tensor):
        tensors[path] = tree.detach().contiguous().cpu()
        return {"__t__": path}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        name = type(tree).__name__
        if name not in _NAMEDTUPLES:
            raise TypeError(f"checkpoint: NamedTuple {name} is not registered (state.checkpoint.register_namedtuple)")
        return {"__nt__": name, "f": {k: _encode(v, tensors, f"{path}.{k}") for k, v in tree._asdict().items()}}
    if isinstance(tree, dict):
        if not all(isinstance(k, str) for k in tree):
            raise TypeError(f"checkpoint: dict keys at {path or '<root>'} must be strings")
        return {"__d__": {k: _encode(v, tensors, f"{path}.{k}") for k, v in tree.items()}}
    if isinstance(tree, (list, tuple)):
        tag = "__l__" if isinstance(tree, list) else "__tu__"
        return {tag: [_encode(v, tensors, f"{path}.{i}") for i, v in enumerate(tree)]}
    if tree is None or isinstance(tree, (bool, int, float, str, bytes)):
        return tree
    raise TypeError(f"checkpoint: cannot store a {type(tree).__name__} at {path or '<root>'}")


def _decode(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, dict):
        if "__t__" in node:
            return tensors[node["__t__"]]
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

    `before_commit` runs when the temporary directory is complete and not yet renamed
    into place: a hook for tests that kill the writer in the middle of a write.
    """
    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(tree, tensors, "")
    storages: set[int] = set()
    for name, t in tensors.items():  # safetensors refuses shared memory (e.g. a KL reference aliasing params)
        ptr = t.untyped_storage().data_ptr()
        if ptr in storages:
            tensors[name] = t.clone()
        storages.add(ptr)
    blob = st_save(tensors) if tensors else b""
    body = msgpack.packb(
        {
            "format": FORMAT_VERSION,
            "structure": structure,
            "metadata": metadata or {},
            "tensors_sha256": hashlib.sha256(blob).hexdigest(),
        },
        use_bin_type=True,
    )
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    _fsync_write(os.path.join(tmp, _TENSORS), blob)
    _fsync_write(os.path.join(tmp, _META), msgpack.packb({"body": body, "sha256": hashlib.sha256(body).hexdigest()}))
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


def _read(path: str) -> bytes:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing (not a complete checkpoint)")
    with open(path, "rb") as f:
        return f.read()


class Loaded(NamedTuple):
    tree: Any
    metadata: dict[str, Any]


def load(path: str) -> Loaded:
    """Read and verify a checkpoint written by `save`; raises CheckpointError naming the bad file."""
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
    return Loaded(_decode(meta["structure"], tensors), meta["metadata"])


_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def latest(root: str) -> str | None:
    """The newest complete checkpoint directory under root (temporary ones are ignored)."""
    if not os.path.isdir(root):
        return None
    steps = [(int(m.group(1)), n) for n in os.listdir(root) if (m := _STEP_DIR.match(n))]
    return os.path.join(root, max(steps)[1]) if steps else None
