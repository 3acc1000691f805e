"""The default task: exact rewards, a held-out split never trained on, and the character tokenizer."""

import pytest

from miles_fn import prng
from miles_fn.batching import pack_right_padded
from miles_fn.tasks.addition import AdditionTask
from miles_fn.tokenizer import CharTokenizer


def test_tokenizer_round_trip_and_errors():
    tok = CharTokenizer()
    ids = tok.encode("17+25=")
    assert tok.decode(ids + [tok.eos_id] + tok.encode("99")) == "17+25="
    with pytest.raises(ValueError, match="'#'"):
        tok.encode("1#2")


@pytest.mark.parametrize("reverse", [False, True])
def test_reward_is_exact(reverse):
    task = AdditionTask(digits=2, reverse_answer=reverse)
    tok = task.tokenizer
    good = "24" if reverse else "42"
    assert task.reward(tok.encode(good) + [tok.eos_id], (17, 25)) == 1.0
    assert task.reward(tok.encode(good), (17, 25)) == 0.0  # no EOS: the answer never ended
    assert task.reward(tok.encode(good + "0") + [tok.eos_id], (17, 25)) == 0.0
    assert task.reward(tok.encode(good[::-1]) + [tok.eos_id], (17, 25)) == 0.0
    assert task.answer_ids(99, 99) == tok.encode("891" if reverse else "198") + [tok.eos_id]


def test_heldout_pairs_are_never_sampled_for_training():
    task = AdditionTask(digits=2)
    held = set(task.heldout_pairs(200))
    assert len(held) > 150 and all(task.is_heldout(a, b) for a, b in held)
    train = task.sample_pairs(prng.key(3), 5000)
    assert not held & set(train)
    frac = sum(task.is_heldout(a, b) for a in range(100) for b in range(100)) / 10_000
    assert 0.08 < frac < 0.12
    assert task.sample_pairs(prng.key(3), 5000) == train  # a function of the key


def test_pack_right_padded_marks_exactly_the_response_predictions():
    tokens, positions, seg, mask = pack_right_padded([[1, 5, 6], [1, 7]], [[8, 2], [9, 9, 2]])
    assert tokens.tolist() == [[1, 5, 6, 8, 2], [1, 7, 9, 9, 2]]
    assert seg.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    # column t predicts token t+1: responses start at token 3 (row 0) and token 2 (row 1)
    assert mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    tokens, positions, seg, mask = pack_right_padded([[1, 5]], [[2]])
    assert mask.tolist() == [[0, 1]] and positions.tolist() == [[0, 1, 2]]


def test_fixed_width_prompts_and_answers():
    task = AdditionTask(digits=2, fixed_width=True)
    tok = task.tokenizer
    assert task.prompt_ids(7, 25) == [tok.bos_id] + tok.encode("07+25=")
    assert task.answer_ids(7, 25) == tok.encode("032") + [tok.eos_id]
    assert task.reward(tok.encode("032") + [tok.eos_id], (7, 25)) == 1.0
    assert task.reward(tok.encode("32") + [tok.eos_id], (7, 25)) == 0.0
    assert task.max_answer_tokens == 4
