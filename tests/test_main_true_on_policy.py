"""The main job's train/inference mismatch: exactly 0.0 at every step with --true_on_policy, non-zero without."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num_steps=3", "--sft_warmup_steps=2", "--eval_every=0", "--eval_size=4", "--prompts_per_step=4",
        "--group_size=4", "--hidden_size=32", "--intermediate_size=48", "--noprogress", "--notensorboard",
        "--num_threads=1"]


def run_main(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.main", *TINY, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def _mismatch(out) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    return [{k: r[k] for k in ("mismatch_mean", "mismatch_max", "mismatch_k3")} for r in rows]


def test_true_on_policy_mismatch_is_exactly_zero_and_fast_mode_is_not(tmp_path):
    on, off = tmp_path / "on", tmp_path / "off"
    p = run_main("--true_on_policy", f"--output_dir={on}")
    assert p.returncode == 0, p.stderr[-2000:]
    q = run_main("--noskip_zero_advantage_rows", f"--output_dir={off}")  # the mismatch over every row
    assert q.returncode == 0, q.stderr[-2000:]
    assert all(v == 0.0 for row in _mismatch(on) for v in row.values())
    fast = _mismatch(off)
    assert all(r["mismatch_mean"] > 0 and r["mismatch_max"] > 0 and r["mismatch_k3"] > 0 for r in fast), fast


def test_offpolicy_correction_runs_and_reports_weights(tmp_path):
    p = run_main("--offpolicy_correction=tis", "--tis_cap=1.5", f"--output_dir={tmp_path}")
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 < r["is_weight_mean"] <= 1.5 for r in rows)


@pytest.mark.parametrize("flag,package", [("--attention_backend=flash_attn", "flash-attn"),
                                          ("--attention_backend=flash_attn_3", "flash_attn_interface"),
                                          ("--gemm_backend=deep_gemm", "deep-gemm")])
def test_missing_gpu_backend_exits_naming_the_package(tmp_path, flag, package):
    p = run_main(flag, f"--output_dir={tmp_path}", timeout=120)
    assert p.returncode != 0
    assert package in p.stderr and "Traceback" not in p.stderr


def test_compile_with_true_on_policy_is_refused(tmp_path):
    p = run_main("--true_on_policy", "--compile", f"--output_dir={tmp_path}", timeout=60)
    assert p.returncode != 0 and "--compile" in p.stderr


def parity_reward(sample) -> float:
    """A reward that varies within a group from the first step (--custom_reward_fn), so gradients are non-zero."""
    return float(sum(sample.response_ids) % 2)


def test_true_on_policy_run_does_not_depend_on_the_token_budget(tmp_path):
    """Same metrics (token_budget aside) and the same final state hash at budgets of 1 tile and of the whole batch."""
    runs = {}
    for budget in (48, 100000):
        out = tmp_path / str(budget)
        p = run_main("--true_on_policy", f"--max_tokens_per_micro_batch={budget}", "--invariant_grad_tile_tokens=48",
                     "--custom_reward_fn=tests.test_main_true_on_policy:parity_reward", f"--output_dir={out}")
        assert p.returncode == 0, p.stderr[-2000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert all(r.pop("token_budget") == budget for r in rows)
        runs[budget] = rows, re.search(r"state_hash=(\w+)", p.stdout + p.stderr).group(1)
    (small, h_small), (whole, h_whole) = runs[48], runs[100000]
    assert all(r["micro_batches"] >= 3 for r in small) and any(r["grad_norm"] > 0 for r in small)
    assert small == whole and h_small == h_whole


def test_true_on_policy_holds_for_composed_objectives_too(tmp_path):
    """The non-default objectives (objective.make_policy_loss) train on the invariant ops as well."""
    p = run_main("--true_on_policy", "--policy_loss=dual_clip", "--entropy_coef=0.01", f"--output_dir={tmp_path}")
    assert p.returncode == 0, p.stderr[-2000:]
    assert all(v == 0.0 for row in _mismatch(tmp_path) for v in row.values())
