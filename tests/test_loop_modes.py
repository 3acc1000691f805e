"""Loop modes (launch/modes.py): rollout-only and train-only debugging, chat templates from --prompt_data,
partial rollouts and one-step-off-policy async rollout, each checked against an independent reference run."""

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from launch import modes
from launch.engines.config import RolloutConfig
from launch.flags import ReproConfig
from launch.rl import RolloutShaping
from miles_fn import model
from miles_fn.memory import MemoryConfig
from state import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--num_steps=3", "--eval_every=0", "--eval_size=4", "--prompts_per_step=4", "--group_size=2",
        "--hidden_size=32", "--intermediate_size=48", "--noprogress", "--notensorboard", "--num_threads=1"]
# No warm-up (rollout-only refuses one); a reward that differs within groups, so every step updates the weights.
RL = [*BASE, "--sft_warmup_steps=0", "--custom_reward_fn=tests.loop_mode_plugins:first_token_parity"]
ROLLOUT_STATS = ("reward_mean", "response_len", "truncated_frac", "informative_groups_frac", "reward_errors")


def run_main(out, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.main", *args, f"--output_dir={out}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def ok(p: subprocess.CompletedProcess) -> dict[str, str]:
    assert p.returncode == 0, p.stderr[-3000:]
    return dict(kv.split("=", 1) for kv in p.stdout.strip().splitlines()[-1].split())


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def saved(root, step):
    return checkpoint.load(os.path.join(root, f"step_{step:08d}")).tree


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    """The plain synchronous run every mode is compared with (its rollouts saved)."""
    out = tmp_path_factory.mktemp("sync")
    return ok(run_main(out, *RL, f"--save_rollouts={out / 'rollouts'}")), metrics(out), out


# --- flag validation -------------------------------------------------------------------------------------------

def _cfg(**kw):
    m = {k: kw.pop(k) for k in list(kw) if k in {f.name for f in modes.LoopModes.__dataclass_fields__.values()}}
    r = {k: kw.pop(k) for k in list(kw) if k in RolloutConfig.__dataclass_fields__}
    base = dict(modes=modes.LoopModes(**m), rollout=RolloutConfig(**r), sft=False, sft_warmup_steps=0,
                repro=ReproConfig(resume=kw.pop("resume", False)), memory=MemoryConfig(**kw.pop("memory", {})),
                shaping=RolloutShaping(**kw.pop("shaping", {})), tokenizer=kw.pop("tokenizer", ""))
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize("kw, needles", [
    (dict(debug_rollout_only=True, debug_train_only=True, load_rollouts="d"),
     ["--debug_rollout_only and --debug_train_only exclude each other"]),
    (dict(debug_train_only=True), ["--debug_train_only", "--load_rollouts=DIR", "--save_rollouts"]),
    (dict(debug_rollout_only=True, load_rollouts="d"), ["--debug_rollout_only", "--load_rollouts=d"]),
    (dict(debug_rollout_only=True, sft_warmup_steps=5), ["--sft_warmup_steps=5", "--sft_warmup_steps=0"]),
    (dict(debug_rollout_only=True, resume=True), ["--debug_rollout_only", "--resume"]),
    (dict(debug_train_only=True, load_rollouts="d", sft=True), ["--debug_train_only", "--sft"]),
    (dict(async_rollout=True, debug_rollout_only=True), ["--async_rollout", "--debug_rollout_only"]),
    (dict(async_rollout=True, memory=dict(offload_train_state=True)), ["--offload_train_state"]),
    (dict(async_rollout=True, resume=True), ["--resume with --async_rollout"]),
    (dict(partial_rollouts=True), ["--partial_rollouts", "--over_sampling > 1"]),
    (dict(partial_rollouts=True, over_sampling=2.0, custom_generate_fn="m:f"), ["--custom_generate_fn=m:f"]),
    (dict(partial_rollouts=True, over_sampling=2.0, shaping=dict(dynamic_sampling=True)), ["--dynamic_sampling"]),
    (dict(partial_rollouts=True, over_sampling=2.0, resume=True), ["--resume with --partial_rollouts"]),
    (dict(tokenizer="tok"), ["--tokenizer=tok", "--prompt_data"]),
])
def test_bad_mode_combinations_are_refused_naming_the_flags(kw, needles):
    with pytest.raises(ValueError) as e:
        modes.check(_cfg(**kw))
    for n in needles:
        assert n in str(e.value)


def test_good_mode_combinations_pass():
    for kw in [dict(), dict(debug_rollout_only=True, save_rollouts="d"), dict(debug_train_only=True, load_rollouts="d"),
               dict(async_rollout=True), dict(partial_rollouts=True, over_sampling=1.5),
               dict(partial_rollouts=True, over_sampling=1.5, async_rollout=True)]:
        modes.check(_cfg(**kw))


def test_the_refusal_reaches_the_user_as_one_line(tmp_path):
    p = run_main(tmp_path, *RL, "--debug_train_only")
    assert p.returncode != 0 and "error: --debug_train_only trains without a rollout engine" in p.stderr
    assert "Traceback" not in p.stderr


# --- debug modes -----------------------------------------------------------------------------------------------

def test_debug_rollout_only_rolls_out_every_step_from_the_same_weights_and_never_trains(sync_run, tmp_path):
    s_sum, s_rows, s_out = sync_run
    out = tmp_path / "ro"
    summary = ok(run_main(out, *RL, f"--save_rollouts={out / 'rollouts'}", "--debug_rollout_only"))
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("loss" not in r and "grad_norm" not in r for r in rows)  # nothing trained
    assert [r["weight_version"] for r in rows] == [0, 0, 0]  # nothing synced
    assert [r["weight_version"] for r in s_rows] == [0, 1, 2]
    # Step 1 is the training run's step 1 (same weights, same keys), stat for stat and token for token.
    assert {k: rows[0][k] for k in ROLLOUT_STATS} == {k: s_rows[0][k] for k in ROLLOUT_STATS}
    assert torch.equal(saved(out / "rollouts", 1)["buffer"].tokens, saved(s_out / "rollouts", 1)["buffer"].tokens)
    # Later steps draw new prompts (not step 1 again): the data cursor is the step, not the state's update count.
    assert not torch.equal(saved(out / "rollouts", 2)["buffer"].tokens, saved(out / "rollouts", 1)["buffer"].tokens)
    assert not (out / "checkpoints").exists()
    assert summary["state_hash"] == ok(run_main(tmp_path / "zero", *RL, "--num_steps=0"))["state_hash"]


def test_debug_train_only_trains_from_saved_rollouts_without_building_an_engine(sync_run, tmp_path):
    s_sum, s_rows, s_out = sync_run
    out = tmp_path / "to"
    # --rollout_backend=http would start a rollout server (and write its log) if any engine were built.
    summary = ok(run_main(out, *RL, "--debug_train_only", f"--load_rollouts={s_out / 'rollouts'}",
                          "--rollout_backend=http"))
    assert summary["state_hash"] == s_sum["state_hash"]
    assert summary["eval_success_final"] == "nan"
    assert not (out / "rollout_server.log").exists() and not (out / "rollout_weights").exists()
    drop_eval = lambda rows: [{k: v for k, v in r.items() if k != "eval_success"} for r in rows]  # noqa: E731
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]  # noqa: E731
    assert strip(metrics(out)) == drop_eval(strip(s_rows))
    assert all("eval_success" not in r for r in metrics(out))


# --- chat templates --------------------------------------------------------------------------------------------

def _tiny_chat_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["<unk>", "<s>", "</s>", "u", "a", ":", "|", "h", "i", "o", "1", "2", "+", "="]
    vocab = {c: i for i, c in enumerate(chars)}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = ("<s>{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}"
                         "{% if add_generation_prompt %}a:{% endif %}")
    tok.save_pretrained(path)
    return tok


def _engine_prompts(buf) -> list[list[int]]:
    """The prompt of each row: up to the column where the loss mask starts (it predicts the first response token)."""
    out = []
    for row, mask in zip(buf.tokens.tolist(), buf.loss_mask.tolist(), strict=True):
        out.append(row[: mask.index(1.0) + 1])
    return out


def test_prompt_data_goes_through_the_tokenizers_chat_template(tmp_path):
    from transformers import AutoTokenizer

    tok = _tiny_chat_tokenizer(tmp_path / "tok")
    data = tmp_path / "d.jsonl"
    rows = [{"input": "hi", "label": "2"}, {"input": [{"role": "user", "content": "1+1="}], "label": "2"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ref_tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    expected = sorted(list(ref_tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"])
                      for m in ([{"role": "user", "content": "hi"}], rows[1]["input"]))
    assert expected[0] != [1] + ref_tok.encode("hi", add_special_tokens=False)  # the template is visible in the ids
    args = [*BASE, "--num_steps=1", "--sft_warmup_steps=0", "--prompts_per_step=2", f"--prompt_data={data}",
            "--debug_rollout_only"]
    out = tmp_path / "run"
    ok(run_main(out, *args, f"--tokenizer={tmp_path / 'tok'}", f"--save_rollouts={out / 'r'}"))
    got = _engine_prompts(saved(out / "r", 1)["buffer"])
    assert sorted({tuple(p) for p in got}) == [tuple(e) for e in expected]
    # --hf_checkpoint's own tokenizer is used when the checkpoint directory holds one.
    from miles_fn import prng
    from miles_fn.config import ModelConfig
    from state import hf

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=64)
    ckpt = tmp_path / "ckpt"
    hf.save_hf(str(ckpt), cfg, model.init_params(cfg, prng.key(3), 0.02))
    tok.save_pretrained(ckpt)
    out2 = tmp_path / "run2"
    ok(run_main(out2, *args, f"--hf_checkpoint={ckpt}", f"--save_rollouts={out2 / 'r'}"))
    buf = saved(out2 / "r", 1)["buffer"]
    assert sorted({tuple(p) for p in _engine_prompts(buf)}) == [tuple(e) for e in expected]
    # The tokenizer's EOS stops generation: a response never runs past it.
    eos = ref_tok.eos_token_id
    for row, mask in zip(buf.tokens.tolist(), buf.loss_mask.tolist(), strict=True):
        resp = [t for t, m in zip(row[1:], mask, strict=True) if m]
        assert eos not in resp[:-1]
