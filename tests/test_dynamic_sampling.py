"""DAPO's dynamic sampling loop (launch.rl.collect) against a scripted engine whose rewards are known."""

import types

import torch

from launch import rl
from launch.engines.base import Sample
from launch.engines.config import RolloutConfig
from miles_fn import prng
from miles_fn.sampling import SamplingConfig
from miles_fn.tasks.addition import AdditionTask

TASK = AdditionTask(digits=2)


class ScriptedEngine:
    """Answers the first sample of a group right when a + b is even (an informative group), else all wrong."""

    def __init__(self, group_size, solvable=True):
        self.g, self.solvable, self.calls = group_size, solvable, 0

    def generate(self, requests, sampling):
        self.calls += 1
        out = []
        for i, p in enumerate(r.input_ids for r in requests):
            a, b = (int(x) for x in TASK.tokenizer.decode(p[1:]).rstrip("=").split("+"))
            right = self.solvable and (a + b) % 2 == 0 and i % self.g == 0
            out.append(TASK.answer_ids(a, b) if right else TASK.tokenizer.encode("0") + [TASK.tokenizer.eos_id])
        return [Sample(r, [-0.1] * len(r), "stop", 0) for r in out]


def _job(engine, max_rounds=8, overlong_buffer=0, over_sampling=1.0, dynamic=True):
    shaping = rl.RolloutShaping(dynamic_sampling=dynamic, dynamic_sampling_max_rounds=max_rounds,
                                overlong_buffer=overlong_buffer)
    cfg = types.SimpleNamespace(prompts_per_step=6, group_size=3, shaping=shaping,
                                sampling=SamplingConfig(max_new_tokens=4),
                                rollout=RolloutConfig(over_sampling=over_sampling))
    return types.SimpleNamespace(cfg=cfg, task=TASK, engine=engine)


def test_keeps_only_informative_groups_until_the_batch_is_full():
    engine = ScriptedEngine(3)
    c = rl.collect(_job(engine), prng.key(0), 0, 1)
    assert c.stats["ds_batch_full"] == 1.0 and c.stats["ds_kept_groups"] == 6.0
    assert len(c.prompts) == len(c.rewards) == 18 and c.informative_groups == 6
    for gid in range(6):
        assert c.rewards[3 * gid : 3 * gid + 3] == [1.0, 0.0, 0.0]  # every kept group has a signal
    assert c.stats["ds_rounds"] == engine.calls > 1  # it had to oversample
    again = rl.collect(_job(ScriptedEngine(3)), prng.key(0), 0, 1)
    assert again.prompts == c.prompts  # deterministic in the key


def test_bounded_rounds_and_never_an_empty_batch():
    engine = ScriptedEngine(3, solvable=False)
    c = rl.collect(_job(engine, max_rounds=3), prng.key(1), 0, 1)
    assert engine.calls == 3 and c.stats["ds_rounds"] == 3.0 and c.stats["ds_kept_groups"] == 0.0
    assert c.stats["ds_batch_full"] == 0.0 and len(c.rewards) == 18  # the last round, all zero advantage


def test_overlong_shaping_adds_the_penalty_to_the_rewards():
    c = rl.collect(_job(ScriptedEngine(3), overlong_buffer=2), prng.key(0), 0, 1)
    plain = rl.collect(_job(ScriptedEngine(3)), prng.key(0), 0, 1)
    lengths = torch.tensor([len(r) for r in c.batch.tokens])
    want = [r + (0.0 if n <= 2 else (2 - n) / 2) for r, n in zip(plain.rewards, lengths.tolist(), strict=True)]
    assert c.rewards == want and c.stats["task_reward_mean"] == sum(plain.rewards) / len(plain.rewards)


def _informative(pairs):
    return [(a + b) % 2 == 0 for a, b in pairs]  # the scripted engine's rule


def test_over_sampling_is_the_same_loop_with_fill_and_one_round():
    """--over_sampling=2 alone: one round of 12 prompts; the 6 trained on are the informative ones
    first, then constant ones, in draw order (hand-derived from the scripted engine's rule)."""
    key = prng.key(4)
    pairs = TASK.sample_pairs(prng.fold_in(key, 0), 12)
    good = _informative(pairs)
    want = sorted(([i for i in range(12) if good[i]] + [i for i in range(12) if not good[i]])[:6])
    engine = ScriptedEngine(3)
    c = rl.collect(_job(engine, over_sampling=2.0, dynamic=False), key, 0, 1)
    assert engine.calls == 1 and c.stats is None
    assert c.prompts == [TASK.prompt_ids(*pairs[i]) for i in want for _ in range(3)]
    assert c.informative_groups == min(6, sum(good))


def test_dynamic_sampling_with_over_sampling_draws_more_per_round():
    key = prng.key(4)
    pairs = TASK.sample_pairs(prng.fold_in(key, 0), 12)
    good = _informative(pairs)
    assert sum(good) >= 6  # this key fills the batch in one round of 12
    engine = ScriptedEngine(3)
    c = rl.collect(_job(engine, over_sampling=2.0), key, 0, 1)
    kept = [i for i in range(12) if good[i]][:6]
    assert engine.calls == 1 and c.stats["ds_rounds"] == 1.0 and c.stats["ds_kept_frac"] == 6 / 12
    assert c.prompts == [TASK.prompt_ids(*pairs[i]) for i in kept for _ in range(3)]
