"""--profile_steps and the per-phase timings, as a user runs them."""

import json
import os
import subprocess
import sys

import pytest

from launch.profiling import PHASES, PhaseTimer, parse_profile_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num_steps=3", "--sft_warmup_steps=1", "--eval_every=0", "--eval_size=4", "--prompts_per_step=2",
        "--group_size=2", "--hidden_size=16", "--intermediate_size=16", "--noprogress", "--notensorboard",
        "--num_threads=1"]


def run_main(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.main", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def timing_rows(out) -> list[dict]:
    """Rows that carry the time_* keys: timings.jsonl where the writer splits them off, else metrics.jsonl."""
    path = out / "timings.jsonl"
    if not path.exists():
        path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_traces_for_exactly_the_chosen_steps_and_phase_timings_every_step(tmp_path):
    out = tmp_path / "run"
    p = run_main(*TINY, "--kl_coef=0.1", "--profile_steps=2:3", f"--output_dir={out}")
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(os.listdir(out / "profile")) == ["step_00000002.trace.json", "step_00000003.trace.json"]
    for name in os.listdir(out / "profile"):
        trace = json.loads((out / "profile" / name).read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert set(PHASES) <= names, set(PHASES) - names  # each phase is a range in the trace
        assert any(str(n).startswith("aten::mm") for n in names)  # and the ops inside it
    rows = timing_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for phase in PHASES:
            assert r[f"time_{phase}"] >= 0.0, phase
        # kl_coef > 0: the reference log-probs are recomputed, and generation and training do real work
        assert r["time_rollout"] > 0 and r["time_train"] > 0 and r["time_logprob_recompute"] > 0


@pytest.mark.parametrize("value", ["5:2", "abc", "0:1", "3", "2:x", "-1:2"])
def test_bad_profile_steps_exit_nonzero_naming_the_flag(tmp_path, value):
    p = run_main(f"--profile_steps={value}", f"--output_dir={tmp_path}", timeout=60)
    assert p.returncode != 0
    assert "--profile_steps" in p.stderr


def test_profile_steps_past_the_run_is_refused(tmp_path):
    p = run_main(*TINY, "--profile_steps=2:4", f"--output_dir={tmp_path}", timeout=60)
    assert p.returncode != 0
    assert "--profile_steps=2:4" in p.stderr and "--num_steps=3" in p.stderr and "Traceback" not in p.stderr


def test_parse_profile_steps():
    assert parse_profile_steps("") is None
    assert parse_profile_steps("3:5") == (3, 5)
    assert parse_profile_steps("4:4") == (4, 4)
    for bad in ("5:2", "abc", "1:", ":2", "0:0", "1.5:2"):
        with pytest.raises(ValueError, match="A:B"):
            parse_profile_steps(bad)


def test_phase_timer_accumulates_and_rejects_unknown_phases():
    timer = PhaseTimer()
    with timer("reward"):
        pass
    with timer("reward"):
        sum(range(10000))
    m = timer.metrics()
    assert sorted(m) == sorted(f"time_{p}" for p in PHASES)
    assert m["time_reward"] > 0 and m["time_train"] == 0.0
    with pytest.raises(KeyError, match="bogus"):
        with timer("bogus"):
            pass
