"""--save_rollouts / --load_rollouts: each RL step's RolloutBuffer and rollout stats on disk.

DIR/step_00000001 .. are checkpoints (state.checkpoint: safetensors + msgpack, checksummed), so a
run can train from saved rollouts with no engine, and a rollout can be inspected or replayed.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from state import checkpoint
from state.train_state import RolloutBuffer


class RolloutFileError(Exception):
    """A missing or corrupted saved rollout: the message names the directory."""


def step_path(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def save_rollout(root: str, step: int, buf: RolloutBuffer, stats: dict[str, torch.Tensor]) -> None:
    checkpoint.save(step_path(root, step), {"buffer": buf, "stats": dict(stats)}, {"step": step})


def load_rollout(root: str, step: int) -> tuple[RolloutBuffer, dict[str, torch.Tensor]]:
    path = step_path(root, step)
    if not os.path.isdir(path):
        raise RolloutFileError(f"--load_rollouts={root}: no saved rollout for RL step {step} ({path} is missing)")
    try:
        tree: Any = checkpoint.load(path).tree
    except checkpoint.CheckpointError as e:
        raise RolloutFileError(f"--load_rollouts={root}: {e}") from None
    return tree["buffer"], tree["stats"]
