"""Step snapshots: everything one train step read, and what it produced, in one verified checkpoint.

A step is a pure function (state, batch, key) -> (state, metrics) under a loss and optimizer
fixed by the run's flags, so these four things re-execute it exactly:
    state    the input TrainState          batch    what the step trained on (a RolloutBuffer)
    key      the key the step was given    flags    the run's flags (they rebuild loss and optimizer)
`recorded` is the outcome the run saw; `launch.replay` re-executes the step and compares bit for bit.
Stored with `state.checkpoint` (atomic write, checksums verified on load).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from state import checkpoint
from state.train_state import TrainState


class Outcome(NamedTuple):
    """What one execution of a step produced. A step that raised has only `error`."""

    loss: torch.Tensor | None  # 0-d, exact bits
    grad_norm: torch.Tensor | None  # 0-d, exact bits, before clipping
    finite: bool
    new_state_hash: str | None  # state.tree.tree_hash of the returned state
    error: str | None  # "TypeName: message" when the step raised


class Snapshot(NamedTuple):
    state: TrainState
    batch: Any
    key: torch.Tensor
    flags: dict[str, Any]
    recorded: Outcome
    info: dict[str, Any]  # phase ("rl" | "sft"), index (1-based in its phase), reason, code_version, model


checkpoint.register_namedtuple(Outcome)
checkpoint.register_namedtuple(Snapshot)
_KIND = "miles-fn step snapshot"


def save(path: str, snap: Snapshot) -> None:
    checkpoint.save(path, snap, {"kind": _KIND})


def load(path: str) -> Snapshot:
    """Read and verify a snapshot; CheckpointError names the bad file or says what the directory is instead."""
    loaded = checkpoint.load(path)
    if loaded.metadata.get("kind") != _KIND or not isinstance(loaded.tree, Snapshot):
        raise checkpoint.CheckpointError(f"{path}: a checkpoint, but not a step snapshot (written by --snapshot_steps "
                                         "or on a failed step under <output_dir>/snapshots/)")
    return loaded.tree


def bitwise_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Same dtype, shape and bytes; a NaN equals a NaN of the same bit pattern."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    x, y = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    return torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def compare(recorded: Outcome, replayed: Outcome) -> dict[str, bool]:
    """Field by field: does the replayed outcome equal the recorded one bit for bit."""
    return {
        "loss": bitwise_equal(recorded.loss, replayed.loss),
        "grad_norm": bitwise_equal(recorded.grad_norm, replayed.grad_norm),
        "finite": recorded.finite == replayed.finite,
        "new_state_hash": recorded.new_state_hash == replayed.new_state_hash,
        "error": recorded.error == replayed.error,
    }
