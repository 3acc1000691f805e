"""The main job as a user runs it: flags, outputs, and errors that name the bad input."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num_steps=3", "--sft_warmup_steps=2", "--eval_every=1", "--eval_size=8", "--prompts_per_step=4",
        "--group_size=2", "--save_every=2", "--hidden_size=32", "--intermediate_size=48", "--noprogress"]


def run_main(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.main", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_short_run_writes_metrics_tensorboard_checkpoints_and_plot(tmp_path):
    out = tmp_path / "run"
    p = run_main(*TINY, f"--output_dir={out}")
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("reward_mean", "loss", "grad_norm", "eval_success", "lr"):
        assert all(key in r for r in rows), key
    timings = [json.loads(line) for line in (out / "timings.jsonl").read_text().splitlines()]
    assert all({"step", "time_rollout", "time_train"} <= set(t) for t in timings) and len(timings) == 3
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(out / "tensorboard"))
    # end of SFT (2), then 2 SFT + RL steps 2, 3
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000002", "step_00000004", "step_00000005"]
    png = (out / "reward_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "eval_success_final=" in p.stdout


def test_shipped_flagfile_parses(tmp_path):
    p = run_main("--flagfile=launch/flags/cpu_tiny.flags", "--num_steps=0", "--sft_warmup_steps=0",
                 "--eval_size=4", f"--output_dir={tmp_path}", "--noprogress")
    assert p.returncode == 0, p.stderr[-2000:]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--bogus_flag=1"], "bogus_flag"),
        (["--flagfile=/no/such/file.flags"], "/no/such/file.flags"),
        (["--lr=fast"], "--lr=fast"),
        (["--group_size=0"], "--group_size=0"),
        (["--num_heads=3"], "num_heads"),
        (["--task_digits=9"], "--task_digits=9"),
        (["stray_positional"], "stray_positional"),
    ],
)
def test_bad_input_exits_nonzero_naming_it(tmp_path, args, needle):
    p = run_main(*args, f"--output_dir={tmp_path}", timeout=60)
    assert p.returncode != 0
    assert needle in p.stderr + p.stdout


def test_missing_hf_checkpoint_is_named(tmp_path):
    p = run_main(f"--hf_checkpoint={tmp_path}/nothing", "--num_steps=1", f"--output_dir={tmp_path}/o", timeout=60)
    assert p.returncode != 0
    assert f"{tmp_path}/nothing" in p.stderr and "Traceback" not in p.stderr
