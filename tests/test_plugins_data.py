"""Plugins (reward and multi-turn generate functions), the calculator example's loss mask, JSONL data."""

import json
import os
import subprocess
import sys

import pytest
import torch

from examples import calculator_tool
from launch import data, plugins
from launch.engines.base import Sample, make_requests
from miles_fn import prng
from miles_fn.rollout_buffer import build_rollout_buffer
from miles_fn.sampling import SamplingConfig
from miles_fn.tokenizer import CharTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = CharTokenizer()
CTX = plugins.GenerateContext(TOK.decode, TOK.encode, TOK.eos_id)


class ScriptedEngine:
    """Answers each call from a script keyed by the prompt text, recording what it was asked."""

    version = 3

    def __init__(self, script):
        self.script, self.calls = script, []

    def generate(self, requests, sampling):
        self.calls.append(([r.input_ids for r in requests], sampling))
        out = []
        for r in requests:
            text = self.script[TOK.decode(r.input_ids)]
            toks = TOK.encode(text.replace("$", "")) + ([TOK.eos_id] if text.endswith("$") else [])
            out.append(Sample(toks, [-0.5] * len(toks), "stop", self.version))
        return out


def test_calculator_tool_trajectory_and_loss_mask():
    engine = ScriptedEngine({"17+25=": "17+25?", "17+25=17+25?42:": "42$", "3+4=": "7$"})
    reqs = make_requests([[TOK.bos_id] + TOK.encode("17+25="), [TOK.bos_id] + TOK.encode("3+4=")], prng.key(0))
    sampling = SamplingConfig(max_new_tokens=8, stop_token_ids=(TOK.eos_id,))
    trajs = plugins.run_custom_generate(calculator_tool.generate, engine, reqs, sampling, CTX)
    t0, t1 = trajs
    assert t0.tokens == TOK.encode("17+25?") + TOK.encode("42:") + TOK.encode("42") + [TOK.eos_id]
    assert t0.loss_mask == [1] * 6 + [0] * 3 + [1] * 3
    assert t0.logprobs == [-0.5] * 6 + [0.0] * 3 + [-0.5] * 3
    assert t1.tokens == TOK.encode("7") + [TOK.eos_id] and t1.loss_mask == [1, 1]
    assert t0.weight_version == 3
    # Turn 1 may stop on "?"; turn 2 continues from prompt + call + tool output, with a fresh seed.
    assert engine.calls[0][1].stop_token_ids == (TOK.eos_id, TOK.encode("?")[0])
    (turn2_ids,), _ = engine.calls[1]
    assert turn2_ids == reqs[0].input_ids + TOK.encode("17+25?42:")
    # The loss mask reaches the trainer's buffer: tool tokens are excluded, the model's are kept.
    buf = build_rollout_buffer([r.input_ids for r in reqs], [t.tokens for t in trajs], [t.logprobs for t in trajs],
                               [1.0, 0.0], [0, 0], loss_masks=[t.loss_mask for t in trajs])
    p0 = len(reqs[0].input_ids)
    expected = torch.zeros(buf.loss_mask.shape[1])
    expected[p0 - 1 : p0 - 1 + 12] = torch.tensor([1.0] * 6 + [0.0] * 3 + [1.0] * 3)
    assert torch.equal(buf.loss_mask[0], expected)
    assert buf.loss_mask[1].sum() == 2
    samples = [plugins.RewardInput(0, reqs[0].input_ids, t0.tokens, "17+25=", TOK.decode(t0.tokens), (17, 25)),
               plugins.RewardInput(1, reqs[1].input_ids, t1.tokens, "3+4=", TOK.decode(t1.tokens), (3, 5))]
    assert plugins.compute_rewards(calculator_tool.reward, samples) == ([1.0, 0.0], 0)


def test_calculator_never_evaluates_anything_but_arithmetic():
    assert calculator_tool.calculator("12*3") == "36" and calculator_tool.calculator("5-9") == "-4"
    assert calculator_tool.calculator("__import__('os')") == "err" and calculator_tool.calculator("1+") == "err"


def _inputs(n):
    return [plugins.RewardInput(i, [1], [5], "p", f"r{i}", i) for i in range(n)]


def test_async_reward_functions_are_awaited_together():
    async def rew(s):
        return float(s.label) / 2

    assert plugins.compute_rewards(rew, _inputs(3)) == ([0.0, 0.5, 1.0], 0)


def test_a_failing_reward_function_is_reported_with_its_sample(capsys):
    def rew(s):
        if s.index == 1:
            raise KeyError("no such field")
        return 1.0

    with pytest.raises(plugins.RewardError, match=r"sample 1 \(prompt 'p', response 'r1', label 1\): KeyError"):
        plugins.compute_rewards(rew, _inputs(3))
    assert plugins.compute_rewards(rew, _inputs(3), on_error="zero") == ([1.0, 0.0, 1.0], 1)
    assert "sample 1" in capsys.readouterr().err
    with pytest.raises(plugins.RewardError, match="returned str 'x', expected a float"):
        plugins.compute_rewards(lambda s: "x", _inputs(1))


def test_load_function_names_the_flag():
    assert plugins.load_function("examples.calculator_tool:reward", "f") is calculator_tool.reward
    for spec, needle in [("nocolon", "expected module:function"), ("no.such.mod:f", "cannot import"),
                         ("examples.calculator_tool:nothing", "no function 'nothing'")]:
        with pytest.raises(plugins.PluginError, match=needle):
            plugins.load_function(spec, "custom_reward_fn")


def test_jsonl_rows_and_errors_with_line_numbers(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"q": "1+1=", "a": "2"}\n\n{"q": "2+2=", "a": "4"}\n')
    rows = data.load_jsonl(str(p), "q", "a")
    assert [(r.prompt, r.label, r.line) for r in rows] == [("1+1=", "2", 1), ("2+2=", "4", 3)]
    for text, needle in [('{"q": "x", "a": 1}\n{"q": \n', ":2: not valid JSON"),
                         ('{"q": "x", "a": 1}\n{"a": 1}\n', ":2: no 'q' field"),
                         ('[1]\n', ":1: a row must be a JSON object"),
                         ('{"q": "x"}\n', ":1: no 'a' field"),
                         ('{"q": "", "a": 1}\n', ":1: 'q' must be a non-empty string")]:
        p.write_text(text)
        with pytest.raises(data.DataError, match=needle):
            data.load_jsonl(str(p), "q", "a")


def test_invalid_utf8_a_bom_and_malformed_prompts_are_named_by_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"q": "1+1=", "a": "2"}\n{"q": "caf\xe9", "a": "x"}\n')  # latin-1 e-acute, the 11th byte: not UTF-8
    with pytest.raises(data.DataError, match=r":2: not valid UTF-8 \(byte 0xe9 at byte 11 of the line\)"):
        data.load_jsonl(str(p), "q", "a")
    with pytest.raises(data.DataError, match="--eval_data files must be UTF-8"):
        data.load_jsonl(str(p), "q", "a", "--eval_data")
    p.write_bytes(b'\xef\xbb\xbf{"q": "1+1=", "a": "2"}\r\n')  # a UTF-8 BOM and CRLF, as editors write
    assert [(r.prompt, r.line) for r in data.load_jsonl(str(p), "q", "a")] == [("1+1=", 1)]
    with pytest.raises(data.DataError, match=f"--eval_data={tmp_path}/none.jsonl: No such file"):
        data.load_jsonl(str(tmp_path / "none.jsonl"), "q", "a", "--eval_data")
    for prompt, needle in [(5, "got number"), (None, "got null"), ({"role": "user"}, "got object"),
                           ([], "got an empty list"), (["hi"], "message 0 is string, not an object"),
                           ([{"role": "user", "content": "x"}, {"role": "user"}],
                            "message 1 needs a string 'content' \\(got missing\\)"),
                           ([{"role": 1, "content": "x"}], "message 0 needs a string 'role' \\(got number\\)"),
                           ([{"role": "assistant", "content": None}], "'content' \\(got null\\)")]:
        p.write_text('{"q": "1+1=", "a": 1}\n\n' + json.dumps({"q": prompt, "a": 1}) + "\n")
        with pytest.raises(data.DataError, match=":3: 'q' must be a non-empty string or a list of .*" + needle):
            data.load_jsonl(str(p), "q", "a")
    p.write_text("null\n")
    with pytest.raises(data.DataError, match=":1: a row must be a JSON object, got null"):
        data.load_jsonl(str(p), "q", "a")


def test_a_failing_chat_template_or_an_empty_encoding_is_named_by_line():
    from launch import rollout

    class Tok:  # a template that refuses system messages, as many checkpoints' do
        chat_template = "x"

        def apply_chat_template(self, messages, **kw):
            import jinja2

            raise jinja2.exceptions.TemplateError("System role not supported")

    class Task:
        tokenizer = Tok()

    rows = [data.PromptRow([{"role": "system", "content": "x"}], 1, 4)]
    with pytest.raises(data.DataError, match="d.jsonl:4: the tokenizer's chat template refused the prompt "
                                             r"\(TemplateError: System role not supported\)"):
        rollout.encode_rows(rows, Task(), "d.jsonl")

    class Empty:
        tokenizer = type("T", (), {"encode": staticmethod(lambda text: [])})()

    with pytest.raises(data.DataError, match="d.jsonl:7: the prompt encodes to no tokens"):
        rollout.encode_rows([data.PromptRow(" ", 1, 7)], Empty(), "d.jsonl")


def test_prompts_longer_than_the_positions_are_refused_naming_row_and_lengths(tmp_path):
    from launch import rollout
    from launch.engines.config import RolloutConfig
    from miles_fn.tasks.addition import AdditionTask

    train, ev = tmp_path / "t.jsonl", tmp_path / "e.jsonl"
    train.write_text('{"input": "1+1=", "label": 2}\n' + json.dumps({"input": "1" * 60, "label": 1}) + "\n")
    ev.write_text('{"input": "2+2=", "label": 4}\n' * 2 + json.dumps({"input": "2" * 70, "label": 1}) + "\n")
    task = AdditionTask()
    # BOS + 60 characters = 61 tokens; 61 + 4 new tokens > 64 positions, 61 + 3 fits
    with pytest.raises(data.DataError, match=f"{train}:2: the prompt is 61 tokens, and with --max_new_tokens=4 it "
                                             r"needs 65 positions, more than the model's max_position_embeddings "
                                             r"\(64\); lower --max_new_tokens to at most 3"):
        rollout.check_prompt_lengths(task, RolloutConfig(prompt_data=str(train)), 4, 64)
    rollout.check_prompt_lengths(task, RolloutConfig(prompt_data=str(train)), 3, 64)
    with pytest.raises(data.DataError, match=f"{ev}:3: the prompt is 71 tokens.*shorten the prompt or drop the row"):
        rollout.check_prompt_lengths(task, RolloutConfig(prompt_data=str(train), eval_data=str(ev)), 3, 64)
    # under --load_rollouts nothing is generated from --prompt_data
    rollout.check_prompt_lengths(task, RolloutConfig(prompt_data=str(train), load_rollouts="dir"), 4, 64)


def test_main_names_bad_data_files_without_a_traceback(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"input": "1+2=", "label": 3}\n')
    utf = tmp_path / "latin1.jsonl"
    utf.write_bytes(b'{"input": "1+2=", "label": 3}\n{"input": "\xff", "label": 3}\n')
    long = tmp_path / "long.jsonl"
    long.write_text('{"input": "1+2=", "label": 3}\n' + json.dumps({"input": "9" * 70, "label": 1}) + "\n")
    base = ["--num_steps=1", "--sft_warmup_steps=0", "--prompts_per_step=1", "--group_size=2", "--hidden_size=32",
            "--intermediate_size=48", "--noprogress", "--notensorboard", "--num_threads=1"]
    for extra, needle in [([f"--prompt_data={utf}"], f"{utf}:2: not valid UTF-8"),
                          ([f"--prompt_data={good}", f"--eval_data={utf}"], f"{utf}:2: not valid UTF-8"),
                          ([f"--prompt_data={long}"], f"{long}:2: the prompt is 71 tokens"),
                          ([f"--prompt_data={good}", f"--eval_data={long}"], f"{long}:2: the prompt is 71 tokens")]:
        p = subprocess.run([sys.executable, "-m", "launch.main", *base, *extra, f"--output_dir={tmp_path / 'o'}"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert p.returncode != 0 and needle in p.stderr and "Traceback" not in p.stderr, (extra, p.stderr[-2000:])


def test_epoch_order_is_a_seeded_permutation_per_epoch():
    rows = tuple(data.PromptRow(str(i), i, i + 1) for i in range(7))
    key = prng.key(4)
    stream = [r.label for r in data.rows_at(rows, key, 0, 21)]
    for e in range(3):
        assert stream[7 * e : 7 * e + 7] == prng.permutation(prng.fold_in(key, e), 7).tolist()
        assert sorted(stream[7 * e : 7 * e + 7]) == list(range(7))
    assert stream[:7] != stream[7:14]  # reshuffled each epoch
    assert [r.label for r in data.rows_at(rows, key, 9, 4)] == stream[9:13]  # any window, same stream


def test_chat_template_is_applied_when_the_tokenizer_has_one():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["<unk>", "<s>", "</s>", "u", "a", ":", "|", "h", "i"])}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}" \
                        "{% if add_generation_prompt %}a:{% endif %}"
    expected = [vocab[c] for c in "u:hi|a:"]
    assert data.encode_prompt("hi", tok) == expected
    assert data.encode_prompt([{"role": "user", "content": "hi"}], tok) == expected
    assert data.encode_prompt("12+3=", TOK) == [TOK.bos_id] + TOK.encode("12+3=")


def test_main_runs_a_jsonl_dataset_with_the_calculator_plugins(tmp_path):
    d = tmp_path / "d.jsonl"
    d.write_text("".join(json.dumps({"input": f"{a}+{b}=", "label": [a, b]}) + "\n" for a, b in [(1, 2), (30, 4),
                                                                                                    (5, 66)]))
    args = ["--num_steps=2", "--sft_warmup_steps=0", "--eval_every=0", "--eval_size=4", "--prompts_per_step=2",
            "--group_size=2", "--hidden_size=32", "--intermediate_size=48", "--noprogress", "--notensorboard",
            "--num_threads=1", f"--prompt_data={d}", "--custom_generate_fn=examples.calculator_tool:generate",
            "--custom_reward_fn=examples.calculator_tool:reward", "--over_sampling=1.5",
            f"--output_dir={tmp_path / 'run'}"]
    p = subprocess.run([sys.executable, "-m", "launch.main", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["reward_errors"] == 0 for r in rows)
    d.write_text('{"input": "1+2=", "label": [1, 2]}\n{"input": 5}\n')
    p = subprocess.run([sys.executable, "-m", "launch.main", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode != 0 and f"{d}:2:" in p.stderr and "Traceback" not in p.stderr


def test_eval_data_is_evaluated_as_the_runs_rollouts_are_scored(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"input": f"{a}+{b}=", "label": 1}) + "\n" for a, b in [(1, 2), (3, 4)]))
    base = ["--num_steps=1", "--sft_warmup_steps=0", "--eval_every=0", "--eval_size=3", "--prompts_per_step=2",
            "--group_size=2", "--hidden_size=32", "--intermediate_size=48", "--noprogress", "--notensorboard",
            "--num_threads=1", f"--prompt_data={train}", "--custom_reward_fn=tests.loop_mode_plugins:label_is_one"]

    def run(name, *extra):
        return subprocess.run([sys.executable, "-m", "launch.main", *base, f"--output_dir={tmp_path / name}", *extra],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)

    def evals(p):
        assert p.returncode == 0, p.stderr[-2000:]
        vals = dict(kv.split("=", 1) for kv in p.stdout.strip().splitlines()[-1].split())
        return vals["eval_success_init"], vals["eval_success_final"]

    # the reward is the row's label: the eval set's labels decide the score, through the run's reward fn
    for label, want in ((1, "1.0000"), (0, "0.0000")):
        ev = tmp_path / f"eval{label}.jsonl"
        ev.write_text("".join(json.dumps({"input": f"{a}+{a}=", "label": label}) + "\n" for a in range(5)))
        assert evals(run(f"e{label}", f"--eval_data={ev}", "--eval_pass_k=2")) == (want, want)
    assert evals(run("none")) == ("nan", "nan")  # no held-out data: no made-up number
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "1+1=", "label": 1}\n{"label": 1}\n')
    p = run("bad", f"--eval_data={bad}")
    assert p.returncode != 0 and f"{bad}:2:" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "launch.main", f"--eval_data={bad}", f"--output_dir={tmp_path}/x"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "--eval_data needs --prompt_data" in p.stderr


def test_training_from_saved_rollouts_reproduces_the_run(tmp_path):
    base = ["--num_steps=2", "--sft_warmup_steps=1", "--eval_every=0", "--eval_size=4", "--prompts_per_step=2",
            "--group_size=2", "--hidden_size=32", "--intermediate_size=48", "--noprogress", "--notensorboard",
            "--num_threads=1"]

    def run(*extra):
        return subprocess.run([sys.executable, "-m", "launch.main", *base, *extra], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)

    saved = tmp_path / "rollouts"
    a = run(f"--output_dir={tmp_path / 'a'}", f"--save_rollouts={saved}")
    assert a.returncode == 0, a.stderr[-2000:]
    assert sorted(os.listdir(saved)) == ["step_00000001", "step_00000002"]
    b = run(f"--output_dir={tmp_path / 'b'}", f"--load_rollouts={saved}")
    assert b.returncode == 0, b.stderr[-2000:]
    hash_of = lambda p: p.stdout.split("state_hash=")[1].split()[0]  # noqa: E731
    assert hash_of(a) == hash_of(b)
    c = run(f"--output_dir={tmp_path / 'c'}", f"--load_rollouts={saved}", "--num_steps=3")
    assert c.returncode != 0 and "no saved rollout for RL step 3" in c.stderr and "Traceback" not in c.stderr


def test_pass_at_k_matches_brute_force_over_subsets():
    import itertools

    from launch.evaluation import pass_at_k

    for n, c, k in [(5, 0, 1), (5, 2, 1), (5, 2, 3), (6, 3, 4), (4, 4, 2), (7, 1, 7)]:
        outcomes = [1] * c + [0] * (n - c)
        subsets = list(itertools.combinations(range(n), k))
        brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
        assert abs(pass_at_k(n, c, k) - brute) < 1e-12


def test_sampled_pass_at_k_counts_passing_samples_per_prompt():
    from launch.evaluation import sampled_pass_at_k

    class Alternating:
        """Sample j of every prompt passes iff j is even (n=4: c=2 per prompt)."""
        version = 0

        def generate(self, requests, sampling):
            return [Sample([r.rid % 4 % 2], [0.0], "stop", 0) for r in requests]

    out = sampled_pass_at_k(Alternating(), [[1], [1, 2]], [None, None],
                            lambda ps, rs, labs: [float(r == [0]) for r in rs], SamplingConfig(), 4, (1, 2))
    assert out == {"eval_pass@1": 0.5, "eval_pass@2": 1 - 1 / 6}


def test_over_sampling_keeps_groups_with_differing_rewards_first():
    from launch.rollout import select_groups

    #            g0 const   g1 mixed  g2 const  g3 mixed  g4 mixed
    rewards = [1, 1, 1, 0, 0, 0, 0, 1, 1, 0]
    assert select_groups(rewards, 2, 2) == [1, 3]
    assert select_groups(rewards, 2, 3) == [1, 3, 4]
    assert select_groups(rewards, 2, 4) == [0, 1, 3, 4]  # filled with the first constant group, in order
