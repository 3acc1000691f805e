"""Each benchmark runs end to end in its seconds-long --quick mode (no timing is asserted here)."""

import importlib.util
import json

import pytest

from bench import rl_step, rollout, train_throughput

HAVE_TRL = importlib.util.find_spec("trl") is not None


def test_rollout_quick(tmp_path):
    out = rollout.main(["--quick", f"--out={tmp_path / 'r.json'}"])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["results"][0]["miles_fn_tokens_per_s"] > 0 and saved["results"][0]["transformers_tokens_per_s"] > 0
    assert "| batch |" in out["table"]


@pytest.mark.parametrize("with_trl", [False, pytest.param(True, marks=pytest.mark.skipif(
    not HAVE_TRL, reason="trl is not installed (pip install 'miles-fn[bench]')"))])
def test_rl_step_quick(tmp_path, with_trl):
    out = rl_step.main(["--quick", f"--out={tmp_path / 'rl.json'}", *([] if with_trl else ["--no_trl"])])
    saved = json.loads((tmp_path / "rl.json").read_text())
    for name in ("miles_fn", "miles_fn_all_rows"):
        assert saved[name]["steps"] >= 1 and saved[name]["seconds_per_step"] > 0
    assert 0 < saved["miles_fn"]["train_rows_frac_mean"] <= 1
    assert saved["miles_fn_all_rows"]["train_rows_frac_mean"] == 1
    assert saved["trl_skipped"] is (not with_trl)
    if with_trl:
        assert saved["trl"]["steps"] >= 1 and saved["step_ratio"] > 0 and saved["step_ratio_all_rows"] > 0
    assert "miles-fn" in out["table"]


def test_train_throughput_quick(tmp_path):
    out = train_throughput.main(["--quick", f"--out={tmp_path / 't.json'}"])
    r = out["results"][0]
    assert r["fwd_bwd_tokens_per_s"] > 0 and 0 < r["fraction_of_peak"]
    assert out["matmul_peak_flops_per_s"] > 0
