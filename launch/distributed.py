"""The process group of a data-parallel run: torchrun's environment -> ranks and a ("dp",) DeviceMesh.

    torchrun --nproc_per_node=2 -m launch.main --flagfile=...        # one node, 2 ranks
    python -m launch.main --flagfile=...                              # one process, no process group

Who does what (docs/distributed.md): every rank runs the same loop over the same flags; rank 0 alone
holds the output directory (lock, metrics, checkpoint files other than its shards), builds the rollout
engine and generates each step's whole batch, which it broadcasts; each rank trains on its slice of
the groups with its shard of the params and AdamW moments (miles_fn/sharding.py). Every collective
has --dist_timeout_s, and torchrun stops the other ranks when one dies, so a lost rank ends the job.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist
from optree import tree_leaves
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclasses.dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    mesh: DeviceMesh | None = None  # None: one process, plain tensors everywhere

    @property
    def main(self) -> bool:
        return self.rank == 0


SINGLE = Ranks()


class DistributedError(Exception):
    """A collective failed or timed out (another rank died or hangs); the message names this rank and the phase."""


def from_env(timeout_s: float, env: dict[str, str] | None = None) -> Ranks:
    """torchrun's WORLD_SIZE > 1: join the process group (gloo on CPU, NCCL on GPU) and build the mesh."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    if world == 1:
        return SINGLE
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world,), mesh_dim_names=("dp",))
    return Ranks(dist.get_rank(), world, mesh)


def close(ranks: Ranks) -> None:
    if ranks.mesh is not None and dist.is_initialized():
        dist.destroy_process_group()


def check(cfg: Any, ranks: Ranks) -> None:
    """ValueError naming the flag when the run cannot train over `ranks.world` ranks (cfg: a RunConfig)."""
    if ranks.world == 1:
        return
    w = ranks.world
    unsupported = [
        ("--sft", cfg.sft), ("--partial_rollouts", cfg.modes.partial_rollouts),
        ("--async_rollout", cfg.modes.async_rollout), ("--offload_train_state", cfg.memory.offload_train_state),
        (f"--speculative_algorithm={cfg.speculative.algorithm}", cfg.speculative.algorithm != "none"),
        ("--advantage_estimator=gae", cfg.objective.uses_critic),
    ]
    for name, on in unsupported:
        if on:
            raise ValueError(f"{name} does not run across ranks yet (torchrun gave WORLD_SIZE={w}); drop it or run "
                             "one process (python -m launch.main)")
    if cfg.ops.invariant and not cfg.memory.max_tokens_per_micro_batch:
        raise ValueError(f"--true_on_policy across {w} ranks sums fixed gradient tiles (the same bits at any world "
                         "size), which --max_tokens_per_micro_batch=0 has none of: set --max_tokens_per_micro_batch "
                         "(e.g. 4096) or run one process")
    if cfg.ops.invariant and w & (w - 1):
        raise ValueError(f"--true_on_policy across ranks needs a power-of-two world size (the balanced tree of the "
                         f"gradient tiles), not {w}")
    if cfg.prompts_per_step < w:
        raise ValueError(f"--prompts_per_step={cfg.prompts_per_step} groups cannot be split over {w} ranks (each "
                         "rank trains on whole groups): raise it to at least the world size")


def broadcast(obj: Any, ranks: Ranks) -> Any:
    """Rank 0's obj on every rank (pickled: a rollout buffer, its stats, a path)."""
    if ranks.world == 1:
        return obj
    box = [obj if ranks.main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(ranks: Ranks) -> None:
    if ranks.world > 1:
        dist.barrier()


def dtensors_loaded() -> bool:
    """Whether DTensor's module is imported: no leaf can be a DTensor before it is. One process never imports
    it (miles_fn.sharding and torch.distributed.checkpoint cost ~0.7 s of every start)."""
    return "torch.distributed.tensor" in sys.modules


def shard(state: Any, ranks: Ranks) -> Any:
    """The train state with params and moments cut into this rank's Shard(0) rows (unchanged in one process)."""
    if ranks.mesh is None:
        return state
    from miles_fn import sharding

    return sharding.shard_state(state, ranks.mesh)


def full(tree: Any) -> Any:
    """tree with every sharded leaf gathered (a collective: every rank calls it at the same point)."""
    if not dtensors_loaded():
        return tree
    from miles_fn import sharding

    return sharding.gather_tree(tree) if sharding.is_sharded(tree) else tree


def full_state(state: Any) -> Any:
    """The state one process would hold: params and moments gathered (a collective under torchrun)."""
    if not dtensors_loaded():
        return state
    from miles_fn import sharding

    return sharding.full_state(state)


def state_bytes(state: Any) -> int:
    """Bytes of params + optimizer moments this rank holds."""
    if dtensors_loaded():
        from miles_fn import sharding

        return sharding.local_bytes((state.params, state.opt_state))
    leaves = [x for x in tree_leaves((state.params, state.opt_state)) if isinstance(x, torch.Tensor)]
    return sum(x.numel() * x.element_size() for x in leaves)


def is_collective_failure(e: BaseException) -> bool:
    """Whether e comes from a collective that another rank never joined (gloo/NCCL errors, timeouts)."""
    kinds = tuple(k for k in (getattr(dist, "DistError", None),) if k is not None)
    if kinds and isinstance(e, kinds):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in ("Connection closed by peer", "Timed out",
                                                                   "timed out", "Connection reset", "gloo", "NCCL"))


def failure(e: BaseException, ranks: Ranks, where: str, timeout_s: float) -> DistributedError:
    return DistributedError(
        f"rank {ranks.rank} of {ranks.world}: a collective failed during {where} ({type(e).__name__}: "
        f"{str(e).splitlines()[0] if str(e) else ''}); another rank stopped or hangs (its own error, or torchrun's "
        f"summary, names it). Collectives wait at most --dist_timeout_s={timeout_s:g}")


def exit_at(spec: str, ranks: Ranks, step: int) -> None:
    """--debug_exit_rank=RANK:STEP: this rank kills itself (SIGKILL, no cleanup) as RL step STEP starts."""
    if spec and spec == f"{ranks.rank}:{step}":
        sys.stderr.write(f"debug: rank {ranks.rank} exits at RL step {step} (--debug_exit_rank={spec})\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
