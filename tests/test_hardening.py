"""Bad input and misuse get an error that names the flag, file, row or sample, and nothing is lost (issue 16).

Each case here crashed with a traceback, hung, or went on silently with wrong data before.
"""

import fractions
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from absl import flags

from launch import flags as run_flags  # noqa: F401 (defines the run's flags and their validators)
from launch import memory as launch_memory
from launch import plugins, rl, run_dir
from launch.metrics import MetricsFileError, truncate_jsonl
from miles_fn.config import ModelConfig
from miles_fn.memory import MemoryConfig
from miles_fn.objective import ObjectiveConfig
from tests.test_main import TINY, run_main

FLAGS = flags.FLAGS


def flag_error(*argv: str) -> str:
    """The message absl gives for argv, parsed in this process; '' if it parses."""
    FLAGS.unparse_flags()
    try:
        FLAGS(["main", *argv])
    except flags.Error as e:
        return str(e)
    finally:
        FLAGS.unparse_flags()
    return ""


@pytest.mark.parametrize("args,needle", [
    (["--top_p=0"], "--top_p"),
    (["--hidden_size=12", "--num_heads=4", "--num_kv_heads=2"], "head size"),
    (["--temperature=nan"], "--temperature must be a finite"),
    (["--temperature=inf"], "--temperature must be a finite"),
    (["--lr=nan"], "--lr must be a finite"),
    (["--max_grad_norm=nan"], "--max_grad_norm must be a finite"),
    (["--rollout_timeout_s=nan"], "--rollout_timeout_s must be a finite"),
    (["--group_size=1"], "--group_size must be at least 2"),
    (["--group_size=1", "--advantage_estimator=rloo"], "--group_size must be at least 2"),
    (["--adam_beta2=1.0"], "--adam_beta2 must be < 1"),
    (["--lr=1e-4", "--min_lr=1e-3"], "--min_lr must not exceed --lr"),
    (["--eps_clip_high=-0.5"], "--eps_clip_high"),
    (["--mis_low=2", "--mis_high=1"], "--mis_low must be below --mis_high"),
    (["--reward_timeout_s=-1"], "reward_timeout_s"),
])
def test_bad_flag_values_are_refused_by_name(args, needle):
    assert needle in flag_error(*args)


def test_good_neighbours_of_the_refused_values_still_parse():
    assert flag_error("--top_p=0.01", "--hidden_size=16", "--num_heads=4", "--num_kv_heads=2", "--temperature=0",
                      "--lr=0", "--max_grad_norm=0") == ""
    assert flag_error("--group_size=1", "--advantage_estimator=reinforce") == ""
    assert flag_error("--group_size=1", "--advantage_estimator=reinforce_pp") == ""
    assert flag_error("--eps_clip_high=-1") == "" and flag_error("--eps_clip_high=0.28") == ""


def test_a_refused_flag_ends_the_run_without_a_traceback(tmp_path):
    p = run_main("--top_p=0", f"--output_dir={tmp_path}", timeout=60)
    assert p.returncode != 0 and "--top_p" in p.stderr and "Traceback" not in p.stderr


def test_max_new_tokens_past_the_models_positions_is_named(tmp_path):
    p = run_main(*TINY, "--max_new_tokens=100", f"--output_dir={tmp_path}", timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    # the task's prompts are 7 tokens (`<bos>99+99=`): 7 + 100 > 64 positions, so at most 57
    assert "--max_new_tokens=100" in p.stderr and "(64)" in p.stderr and "at most 57" in p.stderr


def test_a_garbage_safetensors_file_is_named(tmp_path):
    from tests.conftest import make_hf_model

    _, path = make_hf_model("llama", True, str(tmp_path))
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "wb") as f:
        f.write(b"\x00garbage, not a safetensors header" * 10)
    p = run_main(f"--hf_checkpoint={path}", "--num_steps=1", f"--output_dir={tmp_path}/o", timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert f"{weights}: not a readable safetensors file" in p.stderr


# --- --output_dir --------------------------------------------------------------------------------------------


def test_an_output_dir_that_is_a_file_or_sits_under_one_is_named(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(run_dir.RunDirError, match=f"--output_dir={f} is a file"), run_dir.held(str(f)):
        pass
    with pytest.raises(run_dir.RunDirError, match="a part of it is a file"), run_dir.held(str(f / "sub")):
        pass
    assert f.read_text() == "x"


def test_a_save_rollouts_dir_under_a_file_is_named(tmp_path):
    (tmp_path / "afile").write_text("x")
    p = run_main(*TINY, f"--save_rollouts={tmp_path}/afile/r", f"--output_dir={tmp_path}/o", timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert f"--save_rollouts={tmp_path}/afile/r cannot be created" in p.stderr


def test_an_output_dir_that_cannot_be_written_is_named():
    # root may write anywhere on disk; /proc refuses everyone
    with pytest.raises(run_dir.RunDirError, match="--output_dir=/proc/miles_fn_out"), run_dir.held(
            "/proc/miles_fn_out"):
        pass


def test_one_run_at_a_time_holds_an_output_dir(tmp_path):
    out = str(tmp_path / "run")
    with run_dir.held(out):
        with pytest.raises(run_dir.RunDirError, match=f"in use by another run \\(pid {os.getpid()}"), \
                run_dir.held(out):
            pass
        # a second process (a second `--resume` of the same run) is refused before it writes anything
        p = run_main(*TINY, "--resume", f"--output_dir={out}", timeout=120)
        assert p.returncode != 0 and "in use by another run" in p.stderr and "Traceback" not in p.stderr
        assert sorted(os.listdir(out)) == [run_dir.LOCK_NAME]
    with run_dir.held(out):  # released at the end of the first
        pass


def test_the_lock_is_released_when_its_holder_is_killed(tmp_path):
    out = str(tmp_path / "run")
    code = f"from launch import run_dir; import time\nwith run_dir.held({out!r}):\n    print('held', flush=True)\n" \
           "    time.sleep(60)\n"
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(run_dir.RunDirError, match=f"pid {holder.pid}"), run_dir.held(out):
            pass
    finally:
        holder.kill()
        holder.wait()
    with run_dir.held(out):
        pass


# --- metrics.jsonl on --resume -------------------------------------------------------------------------------


def _rows(path, steps):
    path.write_text("".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in steps))


def test_resume_keeps_the_checkpoints_rows_and_drops_later_and_torn_ones(tmp_path):
    p = tmp_path / "metrics.jsonl"
    _rows(p, [1, 2, 3, 4])
    with open(p, "a") as f:
        f.write('{"step": 5, "lo')  # killed mid-write
    truncate_jsonl(str(p), 3, required=True)
    assert [json.loads(line)["step"] for line in p.read_text().splitlines()] == [1, 2, 3]


def test_resume_refuses_a_missing_cut_or_malformed_metrics_file(tmp_path):
    p = tmp_path / "metrics.jsonl"
    with pytest.raises(MetricsFileError, match=f"{p} is missing, but the checkpoint has 3 RL steps"):
        truncate_jsonl(str(p), 3, required=True)
    truncate_jsonl(str(p), 0, required=True)  # resumed before the first RL step: nothing to keep
    _rows(p, [1, 3])
    with pytest.raises(MetricsFileError, match=r"missing \[2\]"):
        truncate_jsonl(str(p), 3, required=True)
    p.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(MetricsFileError, match=f"{p} line 2 is not a metrics row"):
        truncate_jsonl(str(p), 2, required=True)
    p.write_bytes(b'{"step": 1}\n\xff\xfe\n')
    with pytest.raises(MetricsFileError, match="line 2"):
        truncate_jsonl(str(p), 1, required=True)
    assert p.read_bytes() == b'{"step": 1}\n\xff\xfe\n'  # refused, not rewritten
    truncate_jsonl(str(tmp_path / "timings.jsonl"), 3)  # timings are not the run's record: absent is fine


def test_resume_after_metrics_jsonl_was_deleted_stops_naming_it(tmp_path):
    out = tmp_path / "run"
    first = run_main(*TINY, "--num_steps=2", "--save_every=1", "--notensorboard", f"--output_dir={out}")
    assert first.returncode == 0, first.stderr[-2000:]
    (out / "metrics.jsonl").unlink()
    p = run_main(*TINY, "--num_steps=3", "--save_every=1", "--notensorboard", "--resume", f"--output_dir={out}")
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert f"{out}/metrics.jsonl is missing" in p.stderr
    assert not (out / "metrics.jsonl").exists()


# --- reward functions ----------------------------------------------------------------------------------------


def _inputs(n):
    return [plugins.RewardInput(i, [1], [5], "p", f"r{i}", i) for i in range(n)]


@pytest.mark.parametrize("value,expected", [
    (np.float32(0.25), 0.25), (np.float64(-1.5), -1.5), (np.int64(2), 2.0), (fractions.Fraction(1, 4), 0.25),
    (torch.tensor(0.75), 0.75), (torch.tensor([0.5]), 0.5), (np.array([0.125]), 0.125), (3, 3.0),
])
def test_any_real_number_is_a_reward(value, expected):
    assert plugins.compute_rewards(lambda s: value, _inputs(1)) == ([expected], 0)


@pytest.mark.parametrize("value,needle", [
    (float("nan"), "returned nan, expected a finite number"), (float("inf"), "returned inf"),
    (np.float32("nan"), "returned nan"), (torch.tensor(float("-inf")), "returned -inf"),
    (True, "returned bool True"), (np.bool_(True), "returned bool True"), ("1.0", "returned str"),
    (torch.tensor([0.5, 0.5]), "returned Tensor"), (None, "returned NoneType"),
])
def test_non_finite_or_non_numeric_rewards_fail_their_sample(value, needle, capsys):
    with pytest.raises(plugins.RewardError, match="sample 0") as e:
        plugins.compute_rewards(lambda s: value, _inputs(1))
    assert needle in str(e.value)
    assert plugins.compute_rewards(lambda s: value, _inputs(2), on_error="zero") == ([0.0, 0.0], 2)


def test_a_hanging_reward_function_times_out_under_either_policy(capsys):
    calls = []

    def rew(s):
        calls.append(s.index)
        if s.index == 1:
            threading.Event().wait(30)  # hangs; the test does not wait for it
        return 1.0

    t0 = time.monotonic()
    with pytest.raises(plugins.RewardError, match=r"sample 1 .*--reward_timeout_s=0.2"):
        plugins.compute_rewards(rew, _inputs(3), timeout_s=0.2)
    calls.clear()
    # under --reward_errors=zero the hung sample scores 0 and the next ones are still scored, in order
    assert plugins.compute_rewards(rew, _inputs(4), on_error="zero", timeout_s=0.2) == ([1.0, 0.0, 1.0, 1.0], 1)
    assert calls == [0, 1, 2, 3] and time.monotonic() - t0 < 5
    assert "did not return within --reward_timeout_s=0.2" in capsys.readouterr().err


def test_a_hanging_async_reward_function_times_out():
    async def rew(s):
        import asyncio

        if s.index == 0:
            await asyncio.sleep(30)
        return 0.5

    assert plugins.compute_rewards(rew, _inputs(2), on_error="zero", timeout_s=0.2) == ([0.0, 0.5], 1)


def test_a_nan_reward_stops_the_run_naming_the_sample(tmp_path):
    p = run_main(*TINY, "--custom_reward_fn=tests.hardening_plugins:nan_reward", f"--output_dir={tmp_path}")
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "reward function failed on sample 0" in p.stderr and "returned nan" in p.stderr


def test_a_hanging_reward_stops_the_run_within_its_timeout(tmp_path):
    t0 = time.monotonic()
    p = run_main(*TINY, "--custom_reward_fn=tests.hardening_plugins:hanging_reward", "--reward_timeout_s=0.5",
                 f"--output_dir={tmp_path}", timeout=50)
    assert p.returncode != 0 and "--reward_timeout_s=0.5" in p.stderr and "Traceback" not in p.stderr
    assert time.monotonic() - t0 < 45


# --- --custom_loss and micro-batch budgets -------------------------------------------------------------------


def test_a_custom_loss_factory_that_raises_or_returns_no_function_is_named():
    cfg = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1)
    with pytest.raises(ValueError, match=r"--custom_loss=tests.hardening_plugins:raising_factory: the factory "
                                         r"raised RuntimeError: boom in the factory at .*hardening_plugins.py"):
        rl.build_custom_loss("tests.hardening_plugins:raising_factory", cfg, ObjectiveConfig())
    with pytest.raises(ValueError, match="returned int, not a loss function"):
        rl.build_custom_loss("tests.hardening_plugins:non_callable_factory", cfg, ObjectiveConfig())


def test_a_raising_custom_loss_factory_ends_the_run_naming_the_flag(tmp_path):
    p = run_main(*TINY, "--custom_loss=tests.hardening_plugins:raising_factory", f"--output_dir={tmp_path}")
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "--custom_loss=tests.hardening_plugins:raising_factory: the factory raised RuntimeError" in p.stderr


def test_a_micro_batch_budget_below_one_sample_names_that_flag():
    cfg = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1)
    mem = MemoryConfig(max_tokens_per_micro_batch=6)
    with pytest.raises(launch_memory.MemoryPlanError, match=r"--max_tokens_per_micro_batch=6 is less than the "
                                                            r"longest sample's 9 tokens.*at least 9"):
        launch_memory.plan_budget(mem, cfg, [4, 9, 5], torch.device("cpu"))
    assert launch_memory.plan_budget(MemoryConfig(max_tokens_per_micro_batch=9), cfg, [4, 9], torch.device("cpu")) \
        == (9, 9)
