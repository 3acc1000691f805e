"""The chat arithmetic task: its reward on hand-written replies, its held-out split, its prompts."""

import pytest

from miles_fn import prng
from miles_fn.tasks.chat_arith import ChatArithTask, last_integer


class WordTokenizer:
    """A stand-in for a Hugging Face tokenizer: one id per character, id 0 is EOS, a toy chat template."""

    eos_id = 0
    chat_template = "<user>{content}<assistant>"

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        ids = ids[: ids.index(0)] if 0 in ids else ids
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize and [m["role"] for m in messages] == ["user"]
        return {"input_ids": self.encode(self.chat_template.format(content=messages[0]["content"]))}


TOK = WordTokenizer()


@pytest.mark.parametrize("text,expected", [
    ("55", 55), ("47 + 8 = 55.", 55), ("The answer is 55", 55), ("-3", -3), ("5 - 8 = -3", -3),
    ("1,234", 1234), ("12, 34", 34), ("no number", None), ("", None), ("55 or 56", 56),
])
def test_last_integer(text, expected):
    assert last_integer(text) == expected


def test_reward_needs_the_answer_as_last_integer_of_an_ended_reply():
    task = ChatArithTask(TOK, digits=2, second_digits=1)
    say = lambda text, end=True: TOK.encode(text) + ([TOK.eos_id] if end else [])  # noqa: E731
    q = (47, 8, "+")
    assert task.reward(say("55"), q) == 1.0
    assert task.reward(say("47 + 8 = 55."), q) == 1.0
    assert task.reward(say("55", end=False), q) == 0.0  # cut off: the number may be half written
    assert task.reward(say("55 is wrong, it is 56"), q) == 0.0
    assert task.reward(say("5"), q) == 0.0
    assert ChatArithTask(TOK, ops="-").reward(say("-3"), (5, 8, "-")) == 1.0
    assert ChatArithTask(TOK, ops="*").reward(say("7 * 9 = 63"), (7, 9, "*")) == 1.0


def test_prompt_is_the_question_through_the_chat_template():
    task = ChatArithTask(TOK)
    assert TOK.decode(task.prompt_ids(47, 8)) == "<user>What is 47+8? Answer with the number only.<assistant>"
    prompt, answer = task.sft_example((47, 8, "+"))
    assert TOK.decode(answer) == "55" and answer[-1] == TOK.eos_id


def test_heldout_questions_are_never_sampled_for_training():
    task = ChatArithTask(TOK, digits=2, second_digits=1, ops="+-")
    held = set(task.heldout_pairs(100))
    assert len(held) > 60 and all(task.is_heldout(*q) for q in held)
    train = task.sample_pairs(prng.key(3), 3000)
    assert not held & set(train)
    assert all(10 > b >= 0 and 100 > a >= 0 and op in "+-" for a, b, op in train)
    assert {op for _, _, op in train} == {"+", "-"}
    space = [(a, b, op) for a in range(100) for b in range(10) for op in "+-"]
    assert 0.07 < sum(task.is_heldout(*q) for q in space) / len(space) < 0.13
    assert task.sample_pairs(prng.key(3), 3000) == train  # a function of the key


def test_refuses_what_it_cannot_pose():
    with pytest.raises(ValueError, match="ops"):
        ChatArithTask(TOK, ops="/")

    class NoTemplate(WordTokenizer):
        chat_template = None

    with pytest.raises(ValueError, match="chat template"):
        ChatArithTask(NoTemplate())


@pytest.mark.parametrize("args,needle", [
    (["--task=chat_arith"], "--task=chat_arith needs --hf_checkpoint"),
    (["--task=chat_arith", "--hf_checkpoint=smollm2-135m-instruct", "--task_ops=/"], "--task_ops"),
    (["--hf_checkpoint=/no/such/model.gguf"], "/no/such/model.gguf: no such GGUF file"),
])
def test_bad_flags_exit_naming_them(tmp_path, args, needle):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "launch.main", *args, f"--output_dir={tmp_path}"], capture_output=True,
                       text=True, timeout=120, cwd=__file__.rsplit("/tests/", 1)[0])
    assert p.returncode != 0 and needle in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
