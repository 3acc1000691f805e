"""The job under torchrun (gloo on 127.0.0.1, 2 ranks) against the same flags in one process, and the
world-size-independent gradient fold at 1, 2 and 4 ranks against the single-process step.

References are independent of the distributed path: the single-process run of the same flags (its
metrics.jsonl and state hash), train.train_step_accumulated in one process, and hand-written trees.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles_fn import model, optim, packing, prng, sharding, train
from state.tree import tree_hash
from tests.test_determinism import ROOT, TINY
from tests.test_distributed import CFG, LOSS
from tests.test_packing import make_buffer

EXACT = ["--true_on_policy", "--max_tokens_per_micro_batch=256", "--invariant_grad_tile_tokens=64"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _main(out, *args: str, ranks: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    launcher = [] if ranks == 1 else ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                                      "--master_addr=127.0.0.1", f"--master_port={_free_port()}"]
    cmd = [sys.executable, *launcher, "-m", "launch.main", *TINY, f"--output_dir={out}", *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def _ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-4000:])
    return p


def _rows(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]


def _hash(p: subprocess.CompletedProcess) -> str:
    (h,) = [w for w in p.stdout.split() if w.startswith("state_hash=")]
    return h


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: the exact flags in one process, 4 RL steps."""
    out = tmp_path_factory.mktemp("one") / "run"
    return out, _hash(_ok(_main(out, *EXACT)))


def test_two_ranks_true_on_policy_equal_one_process_bit_for_bit(one_process, tmp_path):
    ref_out, ref_hash = one_process
    p = _ok(_main(tmp_path / "two", *EXACT, "--snapshot_steps=3", ranks=2))
    assert _rows(tmp_path / "two") == _rows(ref_out) and len(_rows(ref_out)) == 4
    assert _hash(p) == ref_hash
    # the summary comes once (rank 0), and each rank holds half of the params and moments
    assert p.stdout.count("state_hash=") == 1 and "world_size=2" in p.stdout
    for r in (0, 1):
        assert f"rank {r} of 2: params + optimizer state" in p.stderr and "(0.50 of it)" in p.stderr
    # the checkpoint's params and moments are torch.distributed.checkpoint shards, one file per rank
    shards = tmp_path / "two" / "checkpoints" / "step_00000006" / "shards"
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(os.listdir(shards))
    # a 2-rank snapshot replays bit for bit in one process (no process group)
    snap = tmp_path / "two" / "snapshots" / "rl_00000003"
    r = subprocess.run([sys.executable, "-m", "launch.replay", f"--snapshot={snap}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "bit-exact match" in r.stdout + r.stderr, (r.stdout, r.stderr[-2000:])


def test_resume_across_world_sizes_is_exact(one_process, tmp_path):
    ref_out, ref_hash = one_process
    a, b = tmp_path / "two_then_one", tmp_path / "one_then_two"
    _ok(_main(a, *EXACT, "--num_steps=2", ranks=2))
    resumed = _ok(_main(a, *EXACT, "--resume"))
    _ok(_main(b, *EXACT, "--num_steps=2"))
    resumed2 = _ok(_main(b, *EXACT, "--resume", ranks=2))
    for out, p in ((a, resumed), (b, resumed2)):
        assert _rows(out) == _rows(ref_out) and _hash(p) == ref_hash


def test_a_corrupted_shard_is_refused_naming_it(tmp_path):
    out = tmp_path / "run"
    _ok(_main(out, *EXACT, "--num_steps=2", ranks=2))
    step = sorted((out / "checkpoints").iterdir())[-1]
    shard = step / "shards" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    p = _main(out, *EXACT, "--num_steps=4", "--resume")
    assert p.returncode != 0 and "__1_0.distcp: checksum mismatch" in p.stderr, p.stderr[-2000:]


def test_default_flags_at_two_ranks_agree_with_one_process_to_rounding(tmp_path):
    ref = tmp_path / "one"
    _ok(_main(ref))
    for name, extra in (("whole", ()), ("packed", ("--max_tokens_per_micro_batch=40",))):
        _ok(_main(tmp_path / name, *extra, ranks=2))
        for x, y in zip(_rows(ref), _rows(tmp_path / name), strict=True):
            for k, v in x.items():
                if k in ("micro_batches", "token_budget", "pack_efficiency"):  # a packing, not the math
                    continue
                assert y[k] == pytest.approx(v, rel=1e-4, abs=1e-6), (name, x["step"], k)


def test_a_killed_rank_ends_the_job_naming_it(tmp_path):
    t0 = time.monotonic()
    p = _main(tmp_path / "run", *EXACT, "--debug_exit_rank=1:3", "--dist_timeout_s=60", ranks=2, timeout=200)
    assert p.returncode != 0 and time.monotonic() - t0 < 120
    err = p.stderr
    assert "debug: rank 1 exits at RL step 3" in err
    root_cause = err[err.index("Root Cause"):]
    assert "rank      : 1" in root_cause and "SIGKILL" in root_cause, err[-3000:]


def test_flags_that_cannot_run_across_ranks_are_refused_by_name(tmp_path):
    p = _main(tmp_path / "run", "--true_on_policy", ranks=2)
    assert p.returncode != 0 and "--true_on_policy across 2 ranks" in p.stderr
    assert "--max_tokens_per_micro_batch" in p.stderr


def test_balanced_sum_is_the_padded_power_of_two_tree():
    def tree(n):
        return train.balanced_sum([str(i) for i in range(n)], lambda a, b: f"({a}+{b})")

    assert [tree(n) for n in (1, 2, 3, 5, 6)] == ["0", "(0+1)", "((0+1)+2)", "(((0+1)+(2+3))+4)",
                                                  "(((0+1)+(2+3))+(4+5))"]
    with pytest.raises(ValueError):
        train.balanced_sum([], lambda a, b: a)


OPT = optim.OptimConfig(lr=1e-2, weight_decay=0.01, max_grad_norm=0.05)  # clipping active


def _tiles():
    buf = make_buffer()
    return packing.pack(buf, 34, 17)


def _tile_worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        state = train.init_state(model.init_params(CFG, prng.key(0), std=0.3), prng.key(2))
        loss_fn = train.make_grpo_loss(CFG, LOSS)
        ms = []
        for _ in range(2):
            state, m = sharding.dp_train_step_tiles(state, _tiles(), prng.key(1), loss_fn, OPT, mesh)
            ms.append(m)
        full = sharding.full_state(state)
        if rank == 0:
            torch.save({"hash": tree_hash(full), "metrics": ms}, os.path.join(out, f"w{world}.pt"))
    finally:
        dist.destroy_process_group()


def test_gradient_tiles_give_the_same_bits_at_1_2_and_4_ranks(tmp_path):
    state = train.init_state(model.init_params(CFG, prng.key(0), std=0.3), prng.key(2))
    loss_fn = train.make_grpo_loss(CFG, LOSS)
    assert len(_tiles()) == 3  # not a power of two: ranks 1..3 of 4 hold fewer tiles than rank 0's block
    ms = []
    for _ in range(2):
        state, m = train.train_step_accumulated(state, _tiles(), prng.key(1), loss_fn, OPT, 0, None, fixed_order=True)
        ms.append(m)
    assert float(ms[0]["grad_norm"]) > OPT.max_grad_norm
    for world in (1, 2, 4):
        mp.spawn(_tile_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
        res = torch.load(tmp_path / f"w{world}.pt", weights_only=False)
        assert res["hash"] == tree_hash(state), world
        for mr, m in zip(res["metrics"], ms, strict=True):
            assert {k: float(v) for k, v in mr.items()} == {k: float(v) for k, v in m.items()}, world
    shutil.rmtree(tmp_path, ignore_errors=True)
