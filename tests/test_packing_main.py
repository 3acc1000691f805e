"""The main job with packing, recomputation, offload and the memory margin on: same numbers, clear errors."""

import json

from tests.test_main import TINY, run_main

# all rows trained, so that the batch is several micro-batches
MEMORY_FLAGS = ["--noskip_zero_advantage_rows", "--max_tokens_per_micro_batch=24", "--recompute",
                "--offload_train_state", "--memory_margin_gb=0.1"]


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_packed_run_reports_the_whole_batch_numbers(tmp_path):
    base = run_main(*TINY, "--num_steps=1", "--eval_size=4", "--noskip_zero_advantage_rows",
                    f"--output_dir={tmp_path}/base")
    packed = run_main(*TINY, "--num_steps=1", "--eval_size=4", *MEMORY_FLAGS, f"--output_dir={tmp_path}/packed")
    assert base.returncode == 0, base.stderr[-2000:]
    assert packed.returncode == 0, packed.stderr[-2000:]
    (b,), (p,) = rows(tmp_path / "base"), rows(tmp_path / "packed")
    assert p["micro_batches"] >= 2 and p["oom_splits"] == 0 and p["token_budget"] == 24.0
    assert 0.5 < p["pack_efficiency"] <= 1.0
    # step 1 trains on the same rollout from the same weights: the same loss and metrics
    for k in ("loss", "grad_norm", "entropy_proxy", "ratio_mean", "clip_frac", "reward_mean"):
        assert abs(p[k] - b[k]) <= 1e-5 * max(1.0, abs(b[k])), (k, p[k], b[k])


def test_memory_flags_that_cannot_work_are_named(tmp_path):
    p = run_main("--max_tokens_per_micro_batch=16", "--pack_row_len=32", f"--output_dir={tmp_path}", timeout=60)
    assert p.returncode != 0 and "--pack_row_len must not exceed --max_tokens_per_micro_batch" in p.stderr
    p = run_main(*TINY, "--max_tokens_per_micro_batch=32", "--memory_margin_gb=100000", f"--output_dir={tmp_path}/m")
    assert p.returncode != 0 and "--memory_margin_gb=100000" in p.stderr and "Traceback" not in p.stderr
    # without a token budget the margin and row length would shape nothing: refused, not ignored
    p = run_main("--memory_margin_gb=2", f"--output_dir={tmp_path}/n", timeout=60)
    assert p.returncode != 0 and "--memory_margin_gb and --pack_row_len shape the micro-batches" in p.stderr
