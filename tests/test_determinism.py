"""The job is a function of its flags: same flags, same bytes; resumed after SIGKILL, same bytes;
any snapshotted step replays bit for bit, a planted NaN included. Each case runs the real job."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import torch

from launch.debug import BLOCK_MARKER
from state import checkpoint, snapshot
from state.tree import tree_hash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# kl_coef > 0: from RL step 2 on the loss and gradients are non-zero even though a 2-step SFT
# model earns no reward, and the KL reference must survive a resume.
TINY = ["--num_steps=4", "--sft_warmup_steps=2", "--save_every=2", "--eval_every=2", "--eval_size=8",
        "--prompts_per_step=4", "--group_size=2", "--hidden_size=32", "--intermediate_size=48", "--kl_coef=0.5",
        "--num_threads=1", "--noprogress", "--notensorboard"]


def run_module(module: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def run_main(out, *args: str) -> subprocess.CompletedProcess:
    return run_module("launch.main", *TINY, f"--output_dir={out}", *args)


def state_hash(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.split("state_hash=")[1].split()[0]


def run_until_blocked_then_kill(out, point: str, *args: str) -> None:
    """Start the job, wait until it blocks at `point`, SIGKILL it there."""
    cmd = [sys.executable, "-m", "launch.main", *TINY, f"--output_dir={out}", f"--debug_block_at={point}", *args]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(240, p.kill)
    watchdog.start()
    seen = []
    for line in p.stderr:
        seen.append(line)
        if BLOCK_MARKER in line:
            break
    p.send_signal(signal.SIGKILL)
    p.wait()
    watchdog.cancel()
    assert any(BLOCK_MARKER in s for s in seen), "".join(seen)[-3000:]
    assert p.returncode == -signal.SIGKILL


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    p = run_main(out, "--snapshot_steps=3")
    return out, state_hash(p)


def test_same_flags_give_identical_metrics_and_state(straight, tmp_path):
    out, h = straight
    assert state_hash(run_main(tmp_path / "again", "--snapshot_steps=3")) == h
    assert (tmp_path / "again" / "metrics.jsonl").read_bytes() == (out / "metrics.jsonl").read_bytes()
    r = rows(out)
    assert [x["step"] for x in r] == [1, 2, 3, 4]
    assert r[-1]["loss"] != 0.0 and r[-1]["kl"] > 0.0  # the steps did train
    assert not any(k.startswith("time_") for x in r for k in x)
    timings = [json.loads(line) for line in (out / "timings.jsonl").read_text().splitlines()]
    assert [t["step"] for t in timings] == [1, 2, 3, 4] and all(t["time_train"] > 0 for t in timings)


def test_another_seed_gives_another_run(straight, tmp_path):
    out, h = straight
    assert state_hash(run_main(tmp_path / "seed1", "--seed=1")) != h
    assert [x["entropy_proxy"] for x in rows(tmp_path / "seed1")] != [x["entropy_proxy"] for x in rows(out)]


@pytest.mark.parametrize(
    "point,extra,resumes_from,rows_before",
    [
        ("rl_step:4", [], "step_00000004", 3),  # mid step 4: row 3 is past the checkpoint and must go
        ("checkpoint_write:4", [], "step_00000002", 2),  # mid write after RL step 2: back to the end of SFT
        ("sft_step:2", ["--save_every=1"], "step_00000001", 0),  # mid SFT; --save_every may differ
    ],
)
def test_sigkill_then_resume_equals_the_straight_run(straight, tmp_path, point, extra, resumes_from, rows_before):
    out, h = straight
    mine = tmp_path / "killed"
    run_until_blocked_then_kill(mine, point, *extra)
    assert checkpoint.latest(str(mine / "checkpoints")).endswith(resumes_from)
    assert len(rows(mine)) == rows_before if rows_before else not (mine / "metrics.jsonl").read_text()
    partial = [n for n in os.listdir(mine / "checkpoints") if ".tmp-" in n]
    assert len(partial) == (point.startswith("checkpoint_write"))
    p = run_main(mine, "--resume")
    assert not any(".tmp-" in n for n in os.listdir(mine / "checkpoints"))
    assert f"resumed from {mine / 'checkpoints' / resumes_from}" in p.stderr
    assert state_hash(p) == h
    assert (mine / "metrics.jsonl").read_bytes() == (out / "metrics.jsonl").read_bytes()


def test_resume_refuses_a_flipped_byte_naming_the_file(straight, tmp_path):
    mine = tmp_path / "run"
    shutil.copytree(straight[0], mine)
    victim = mine / "checkpoints" / "step_00000006" / "tensors.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    p = run_main(mine, "--resume")
    assert p.returncode != 0
    assert str(victim) in p.stderr and "checksum mismatch" in p.stderr and "Traceback" not in p.stderr


def test_resume_refuses_a_flag_that_changes_the_math(straight, tmp_path):
    mine = tmp_path / "run"
    shutil.copytree(straight[0], mine)
    p = run_main(mine, "--resume", "--lr=0.002")
    assert p.returncode != 0
    assert "--lr=0.002 differs from --lr=0.001" in p.stderr and "Traceback" not in p.stderr


def test_resume_without_a_checkpoint_names_the_directory(tmp_path):
    p = run_main(tmp_path / "empty", "--resume")
    assert p.returncode != 0
    assert f"no checkpoint under {tmp_path / 'empty' / 'checkpoints'}" in p.stderr


def test_replay_of_a_normal_step_matches_and_dumps_activations(straight, tmp_path):
    out, _ = straight
    snap_dir = out / "snapshots" / "rl_00000003"
    p = run_module("launch.replay", f"--snapshot={snap_dir}", f"--dump_activations={tmp_path / 'acts'}")
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert "replay: bit-exact match" in p.stdout
    # The snapshot agrees with the run's other records: its input is the checkpoint after RL step 2,
    # its loss is metrics row 3.
    snap = snapshot.load(str(snap_dir))
    assert tree_hash(snap.state) == tree_hash(checkpoint.load(str(out / "checkpoints" / "step_00000004")).tree["state"])
    assert float(snap.recorded.loss) == rows(out)[2]["loss"] != 0.0
    from safetensors.torch import load_file

    acts = load_file(str(tmp_path / "acts" / "activations.safetensors"))
    assert sorted(acts) == ["embed", "final_norm", "layer_00", "layer_01", "logits"]
    assert acts["layer_01"].shape == (*snap.batch.tokens.shape, 32)
    assert torch.equal(acts["embed"], snap.state.params["embed"][snap.batch.tokens])


def test_replay_reports_a_mismatch(straight, tmp_path):
    snap = snapshot.load(str(straight[0] / "snapshots" / "rl_00000003"))
    off_by_one_ulp = torch.nextafter(snap.recorded.loss, torch.tensor(1.0))
    snapshot.save(str(tmp_path / "tampered"), snap._replace(recorded=snap.recorded._replace(loss=off_by_one_ulp)))
    p = run_module("launch.replay", f"--snapshot={tmp_path / 'tampered'}")
    assert p.returncode == 1
    lines = {ln.split()[0]: ln for ln in p.stdout.splitlines() if ln.startswith("  ")}
    assert lines["loss"].endswith("MISMATCH") and lines["grad_norm"].endswith("match")
    assert lines["new_state_hash"].endswith("match")


def test_planted_nan_stops_the_run_with_a_snapshot_that_replays_the_nan(tmp_path):
    out = tmp_path / "run"
    p = run_main(out, "--debug_nan_at_step=3")
    snap_dir = out / "snapshots" / "rl_00000003"
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "non-finite" in p.stderr and f"--snapshot={snap_dir}" in p.stderr
    assert [x["step"] for x in rows(out)] == [1, 2]
    snap = snapshot.load(str(snap_dir))
    assert torch.isnan(snap.recorded.loss) and not snap.recorded.finite
    assert snap.recorded.new_state_hash == tree_hash(snap.state)  # the update was skipped
    r = run_module("launch.replay", f"--snapshot={snap_dir}")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.startswith("  ")}
    assert "recorded=nan" in lines["loss"] and "replayed=nan" in lines["loss"] and lines["loss"].endswith("match")
    assert lines["new_state_hash"].endswith("match")


def test_replay_of_a_damaged_snapshot_names_the_file(straight, tmp_path):
    mine = tmp_path / "snap"
    shutil.copytree(straight[0] / "snapshots" / "rl_00000003", mine)
    victim = mine / "meta.msgpack"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    p = run_module("launch.replay", f"--snapshot={mine}")
    assert p.returncode == 2 and str(victim) in p.stderr and "Traceback" not in p.stderr


def test_deterministic_mode_is_set_without_importing_inductor_or_dtensor():
    """ops.use_deterministic_algorithms sets torch's flag, and a one-process run's start imports neither
    inductor (torch's own setter imports it: ~1.3 s a process) nor DTensor/DCP (~0.7 s); with compile on,
    inductor's deterministic flag is set too."""
    code = """
import sys, torch, ops, launch.main, launch.rollout_server, launch.replay
ops.use_deterministic_algorithms(True)
print(torch.are_deterministic_algorithms_enabled(),
      [m for m in ("torch._inductor.config", "torch.distributed.tensor", "torch.distributed.checkpoint")
       if m in sys.modules])
ops.use_deterministic_algorithms(False)
print(torch.are_deterministic_algorithms_enabled())
ops.use_deterministic_algorithms(True, compile=True)
import torch._inductor.config as ic
print(torch.are_deterministic_algorithms_enabled(), ic.deterministic)
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split("\n")[:3] == ["True []", "False", "True True"], p.stdout
