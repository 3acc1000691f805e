"""DAPO's dynamic sampling loop (launch.rl.collect) against a scripted engine whose rewards are known."""

import dataclasses
import types

import torch

from launch import rl
from launch.engines.base import Sample
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


def _job(engine, max_rounds=8, overlong_buffer=0):
    shaping = rl.RolloutShaping(dynamic_sampling=True, dynamic_sampling_max_rounds=max_rounds,
                                overlong_buffer=overlong_buffer)
    cfg = types.SimpleNamespace(prompts_per_step=6, group_size=3, shaping=shaping,
                                sampling=SamplingConfig(max_new_tokens=4))
    return types.SimpleNamespace(cfg=cfg, task=TASK, engine=engine)


def test_keeps_only_informative_groups_until_the_batch_is_full():
    engine = ScriptedEngine(3)
    c = rl.collect(_job(engine), prng.key(0), 0, 1)
    assert c.stats["ds_batch_full"] == 1.0 and c.stats["ds_kept_groups"] == 6.0
    assert sorted(set(c.group_ids)) == list(range(6)) and len(c.rewards) == 18
    for gid in range(6):
        r = [c.rewards[i] for i in range(18) if c.group_ids[i] == gid]
        assert r == [1.0, 0.0, 0.0]  # every kept group has a signal
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
    lengths = torch.tensor([len(r) for r in c.responses])
    want = [r + (0.0 if n <= 2 else (2 - n) / 2) for r, n in zip(plain.rewards, lengths.tolist(), strict=True)]
    assert c.rewards == want and c.stats["task_reward_mean"] == sum(plain.rewards) / len(plain.rewards)
    assert dataclasses.is_dataclass(c)
