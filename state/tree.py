"""Pytree helpers over optree; every function returns a new tree and mutates nothing."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import optree
import torch

tree_map = optree.tree_map
tree_leaves = optree.tree_leaves
tree_flatten_with_path = optree.tree_flatten_with_path


def zeros_like(tree: Any) -> Any:
    return tree_map(torch.zeros_like, tree)


def tree_add_scaled(a: Any, b: Any, scale: float) -> Any:
    """a + scale * b, leafwise."""
    return tree_map(lambda x, y: x + scale * y, a, b)


def global_norm(tree: Any) -> torch.Tensor:
    """sqrt(sum of squares) over all leaves, accumulated in float32 in leaf order."""
    leaves = [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]
    if not leaves:
        return torch.zeros(())
    return torch.sqrt(sum(x.to(torch.float32).pow(2).sum() for x in leaves))


def path_name(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def tree_hash(tree: Any) -> str:
    """A SHA-256 over structure, leaf paths, dtypes, shapes and exact bytes: equal iff bitwise equal."""
    h = hashlib.sha256()
    paths, leaves, spec = tree_flatten_with_path(tree)
    h.update(str(spec).encode())
    for path, leaf in zip(paths, leaves):
        h.update(path_name(path).encode())
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().contiguous().cpu().reshape(-1)
            h.update(f"{t.dtype}{tuple(leaf.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(leaf).encode())
    return h.hexdigest()


def tree_all_finite(tree: Any) -> bool:
    return all(bool(torch.isfinite(x).all()) for x in tree_leaves(tree) if isinstance(x, torch.Tensor))


def tree_cast(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, tree)
