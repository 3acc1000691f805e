"""Exact resume: what a run's checkpoint holds, and the checks made before continuing from one.

A run checkpoint (under <output_dir>/checkpoints/step_<state.step>) is the tree
    {"state": TrainState, "ref_params": the KL reference params, or None}
with metadata
    step          state.step (SFT and RL updates applied)
    cursor        Cursor: SFT steps done, whether the warm-up is over, RL steps done, evals so far
    flags         every flag of launch.flags
    code_version  sha256 over the sources of miles_fn/, ops/, state/, launch/
Every draw of step s derives from (state.key, s), so the cursor is the whole data and
sampling position: continuing from a checkpoint computes what the straight run computed.
The synchronous loop carries no rollout buffer across steps (each step rolls out its own); --async_rollout
carries the next step's buffer and --partial_rollouts its unfinished samples, both saved in the tree.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pathlib
import re
import shutil
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from state import checkpoint
from state.train_state import TrainState

# Flags that may differ on --resume: they change where outputs go, how often they are written,
# and when to stop, never what a step computes. Every other flag (threads included: a different
# thread count changes the order of float reductions) must equal the checkpoint's.
RESUMABLE_FLAGS = frozenset({
    "output_dir", "num_steps", "save_every", "tensorboard", "progress", "eval_every", "eval_size", "eval_pass_k",
    "eval_data",
    "resume", "snapshot_steps", "debug_nan_at_step", "debug_block_at", "debug_exit_rank", "dist_timeout_s",
    # where the rollout server is and how to recover it; host offload; OOM retries (only when memory runs out)
    "rollout_url", "sglang_url", "rollout_timeout_s", "rollout_max_restarts", "rollout_backoff_s",
    "debug_rollout_server_fault", "save_rollouts", "offload_train_state", "max_oom_splits", "profile_steps",
})
CODE_DIRS = ("miles_fn", "ops", "state", "launch")
_ROOT = pathlib.Path(__file__).resolve().parents[1]
_PARTIAL = re.compile(r"^step_\d+\.(tmp|old)-\d+$")  # state.checkpoint.save's temporaries


class ResumeError(Exception):
    """--resume cannot continue exactly: no checkpoint, a damaged one, or flags that change the math."""


@dataclasses.dataclass
class Cursor:
    """Where a run stands between two steps (mutable: the loop advances it)."""

    sft_step: int = 0
    sft_done: bool = False
    rl_step: int = 0
    last_eval: float = float("nan")
    summary: dict[str, float] = dataclasses.field(default_factory=dict)  # eval_success_init, sft_final_loss, ...


class Restored(NamedTuple):
    path: str
    state: TrainState
    ref_params: Any
    cursor: Cursor
    extra: dict[str, Any] = {}  # what save's `extra` held (the loop modes' carried rollouts)


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def code_version(root: pathlib.Path = _ROOT, dirs: tuple[str, ...] = CODE_DIRS) -> str:
    """sha256 over the relative path and bytes of every .py file under `dirs`, in sorted order."""
    h = hashlib.sha256()
    for d in dirs:
        for f in sorted((root / d).rglob("*.py")):
            if "__pycache__" in f.parts:
                continue
            h.update(str(f.relative_to(root)).encode() + b"\0")
            h.update(f.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def running_code_version() -> str:
    """The code version of the sources as this process first read them (edits made during a run do not count)."""
    return code_version()


def save(
    output_dir: str,
    state: TrainState,
    ref_params: Any,
    cursor: Cursor,
    flags: dict[str, Any],
    before_commit: Callable[[], None] | None = None,
    extra: dict[str, Any] | None = None,
) -> str:
    """`extra`: more of the loop's state to carry (--async_rollout's rollout generated ahead, --partial_rollouts'
    unfinished samples), returned by restore as Restored.extra."""
    step = int(state.step)
    path = checkpoint.step_dir(checkpoint_root(output_dir), step)
    meta = {"step": step, "cursor": dataclasses.asdict(cursor), "flags": flags,
            "code_version": running_code_version()}
    checkpoint.save(path, {"state": state, "ref_params": ref_params, **(extra or {})}, meta,
                    before_commit=before_commit)
    return path


def check_flags(saved: dict[str, Any], now: dict[str, Any], path: str) -> None:
    """Refuse to continue under flags that change the math, naming the first such flag."""
    absent = "<absent>"
    for name in sorted(set(saved) | set(now)):
        if name in RESUMABLE_FLAGS:
            continue
        was, is_ = saved.get(name, absent), now.get(name, absent)
        if was != is_:
            raise ResumeError(
                f"--resume: --{name}={is_} differs from --{name}={was} of the checkpoint {path}; it changes the math, "
                f"so the run would not continue the checkpointed one. Pass --{name}={was}, or start a new --output_dir."
            )


def remove_partial_writes(root: str) -> list[str]:
    """Clean up after checkpoint writes that a killed job left unfinished: delete their temporaries, and put
    back a replaced checkpoint (`.old-`) whose replacement never landed. Returns the names dealt with."""
    if not os.path.isdir(root):
        return []
    found = sorted(n for n in os.listdir(root) if _PARTIAL.match(n))
    for n in found:
        final = os.path.join(root, n.split(".")[0])
        if ".old-" in n and not os.path.exists(final):
            os.rename(os.path.join(root, n), final)
        else:
            shutil.rmtree(os.path.join(root, n))
    return found


def restore(output_dir: str, flags: dict[str, Any], mesh: Any = None) -> Restored:
    """The latest checkpoint under <output_dir>/checkpoints, verified, checked against the current flags.

    Under a mesh (torchrun) every rank calls it: rank 0 cleans up partial writes, then each rank loads
    the sharded leaves as its own shards of this mesh, whatever world size wrote them."""
    root = checkpoint_root(output_dir)
    if mesh is None or mesh.get_local_rank() == 0:
        remove_partial_writes(root)
    if mesh is not None:
        import torch.distributed as dist

        dist.barrier(group=mesh.get_group())
    path = checkpoint.latest(root)
    if path is None:
        raise ResumeError(f"--resume: no checkpoint under {root} (checkpoints are written every --save_every steps "
                          "and at the end of the run and of the SFT warm-up)")
    try:
        loaded = checkpoint.load(path, mesh)
    except checkpoint.CheckpointError as e:
        raise ResumeError(f"--resume: {e}") from e
    meta = loaded.metadata
    if not {"cursor", "flags"} <= set(meta) or not isinstance(loaded.tree, dict) or "state" not in loaded.tree:
        raise ResumeError(f"--resume: {path} is not a run checkpoint of launch.main (no cursor or flags in it)")
    check_flags(meta["flags"], flags, path)
    now = running_code_version()
    if meta.get("code_version") != now:
        sys.stderr.write(f"warning: {path} was written by other code (code_version {meta.get('code_version')}, now "
                         f"{now}); the resumed run is exact only if the change left the math alone\n")
    extra = {k: v for k, v in loaded.tree.items() if k not in ("state", "ref_params")}
    return Restored(path, loaded.tree["state"], loaded.tree["ref_params"], Cursor(**meta["cursor"]), extra)
