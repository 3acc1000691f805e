"""Each example flagfile of launch/flags/ runs to completion on a tiny config; --sft trains on the shipped JSONL."""

import json
import os
import subprocess
import sys

import pytest

from miles_fn.tasks.addition import AdditionTask

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num_steps=2", "--sft_warmup_steps=2", "--eval_every=0", "--eval_size=4", "--prompts_per_step=3",
        "--group_size=2", "--save_every=0", "--hidden_size=32", "--intermediate_size=48", "--noprogress",
        "--notensorboard", "--num_threads=1"]
# flagfile -> metrics that only that objective reports
EXAMPLES = {
    "grpo": ("pg_loss", "clip_frac"),
    "dr_grpo": ("pg_loss",),
    "ppo": ("critic_loss", "critic_value_mean"),
    "dapo": ("ds_rounds", "ds_kept_groups", "overlong_penalty_mean"),
    "gspo": ("clip_frac",),
    "reinforce_pp": ("pg_loss",),
    "qwen3_tiny": ("pg_loss",),
    "qwen3_moe_tiny": ("pg_loss", "router_aux_loss"),
}


def run_main(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.main", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_flagfile_runs_to_completion(name, tmp_path):
    p = run_main(f"--flagfile=launch/flags/{name}.flags", *TINY, f"--output_dir={tmp_path}")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in EXAMPLES[name]:
        assert all(key in r for r in rows), key
    assert all(r["finite"] == 1.0 for r in rows)
    assert "eval_success_final=" in p.stdout and os.listdir(tmp_path / "checkpoints")


def test_a_custom_loss_composed_from_the_pieces_runs(tmp_path):
    p = run_main("--flagfile=launch/flags/grpo.flags", "--advantage_estimator=rloo", "--kl_coef=0.01",
                 "--custom_loss=examples.composed_loss:make_loss", *TINY, f"--output_dir={tmp_path}")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("dual_clip_frac" in r and "kl" in r and "entropy" in r for r in rows)
    bad = run_main("--custom_loss=examples.nowhere:make_loss", *TINY, f"--output_dir={tmp_path}/bad")
    assert bad.returncode != 0 and "--custom_loss=examples.nowhere:make_loss" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_every_example_flagfile_is_tested():
    shipped = {f[: -len(".flags")] for f in os.listdir(os.path.join(ROOT, "launch", "flags")) if f.endswith(".flags")}
    # cpu_tiny: tests/test_main.py; smollm2_arith (the real model): tests/test_real_model.py
    assert shipped - {"cpu_tiny", "smollm2_arith"} == set(EXAMPLES)


def test_sft_mode_trains_on_the_jsonl_without_rollouts(tmp_path):
    p = run_main("--sft", "--sft_data=examples/addition_sft.jsonl", "--num_steps=20", "--sft_batch_size=16", *TINY[3:],
                 f"--output_dir={tmp_path}")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 21)) and all("reward_mean" not in r for r in rows)
    assert sum(r["loss"] for r in rows[-3:]) < sum(r["loss"] for r in rows[:3]) - 0.3  # it learns
    assert "sft_rows=2000" in p.stdout


@pytest.mark.parametrize("content,needle", [
    ('{"prompt": "1+1=", "response": "2"}\n{"prompt": "1+1="}\n', "row 2"),
    ('{"prompt": "1+1=", "response": "2"}\nnot json\n', "row 2"),
    ('{"prompt": "1+1=", "response": "2!"}\n', "row 1"),
])
def test_sft_mode_names_the_bad_row(tmp_path, content, needle):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    p = run_main("--sft", f"--sft_data={bad}", "--num_steps=1", *TINY[3:], f"--output_dir={tmp_path}/o")
    assert p.returncode != 0 and needle in p.stderr and str(bad) in p.stderr and "Traceback" not in p.stderr


def test_shipped_sft_jsonl_is_correct_and_never_held_out():
    task = AdditionTask(digits=2, fixed_width=True)  # the default job's format
    with open(os.path.join(ROOT, "examples", "addition_sft.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 2000
    for r in rows:
        a, b = (int(x) for x in r["prompt"].rstrip("=").split("+"))
        assert r["response"] == task.answer_text(a, b) and not task.is_heldout(a, b)
        assert task.prompt_ids(a, b) == [task.tokenizer.bos_id] + task.tokenizer.encode(r["prompt"])
