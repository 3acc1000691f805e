"""--partial_rollouts: samples that are unfinished when a step has enough groups carry over and are resumed.

A step keeps ceil(--over_sampling x prompts_per_step) groups in flight: the groups carried from the
previous step first (oldest first), then new prompts. Generation runs in rounds; in a round every
unfinished sample generates up to `round_tokens` more tokens, continuing from prompt + its partial
response. After each round, once prompts_per_step groups are complete, the step stops: it trains on
the first prompts_per_step complete groups (pool order) and every other group stays in the pool with
its partial responses (what SGLang's abort returns), to be continued next step, by then with newer
weights. The cut is a token count, never a wall-clock moment, so the run stays a function of its flags.

A resumed sample's tokens and log-probs are the concatenation of its segments, each log-prob from
the weights that sampled that token (the behaviour policy the loss needs); every response token is
trained on. Each segment's weight version is kept: a sample reports its first and last version.
Segment keys: the request seed of a segment is fold_in(sample key, tokens generated so far).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from launch import rollout as rollout_lib
from launch.engines.base import Batch, Engine, EngineError, Request, request_seed
from launch.engines.config import RolloutConfig
from miles_fn import prng
from miles_fn.sampling import SamplingConfig


@dataclasses.dataclass
class Slot:
    """One sample in flight."""

    prompt: list[int]
    label: Any
    key: list[int]  # the sample's key words (its segments' seeds derive from it)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)  # weight version of each segment
    finish: str = ""  # "" while unfinished, then "stop" or "length"
    started: int = -1  # the pool step in which its first tokens were generated


@dataclasses.dataclass
class Group:
    slots: list[Slot]

    @property
    def done(self) -> bool:
        return all(s.finish for s in self.slots)


@dataclasses.dataclass
class Pool:
    """The groups in flight between steps, and how many prompts the run has drawn so far."""

    groups: list[Group] = dataclasses.field(default_factory=list)
    drawn: int = 0
    step: int = 0  # collect calls so far


def round_tokens(flag: int, max_new_tokens: int) -> int:
    """Tokens per sample per round: --partial_rollout_tokens, or a quarter of max_new_tokens."""
    return flag if flag > 0 else max(1, max_new_tokens // 4)


def _generate_round(pool: Pool, engine: Engine, sampling: SamplingConfig, chunk: int) -> None:
    """Every unfinished sample generates up to `chunk` more tokens. Samples with the same budget share
    engine calls (one call shares its sampling parameters); order is pool order, so calls are fixed."""
    cap = sampling.max_new_tokens
    by_budget: dict[int, list[Slot]] = {}
    for g in pool.groups:
        for s in g.slots:
            if not s.finish:
                by_budget.setdefault(min(chunk, cap - len(s.tokens)), []).append(s)
    for budget, slots in by_budget.items():
        reqs = [Request(i, s.prompt + s.tokens, request_seed(prng.from_list(s.key), len(s.tokens)))
                for i, s in enumerate(slots)]
        samples = engine.generate(reqs, dataclasses.replace(sampling, max_new_tokens=budget))
        if len(samples) != len(slots):
            raise EngineError(f"engine returned {len(samples)} samples for {len(slots)} requests")
        for s, out in zip(slots, samples, strict=True):
            s.tokens += out.tokens
            s.logprobs += out.logprobs
            s.versions.append(out.weight_version)
            if s.started < 0:
                s.started = pool.step
            if out.finish_reason == "stop":
                s.finish = "stop"
            elif len(s.tokens) >= cap:
                s.finish = "length"


def collect(pool: Pool, engine: Engine, task: Any, rcfg: RolloutConfig, sampling: SamplingConfig,
            data_key: prng.Key, rollout_key: prng.Key, root_key: prng.Key, n_prompts: int, group: int,
            chunk: int) -> tuple[rollout_lib.Collected, list[int], dict[str, float]]:
    """This step's samples (first weight version in batch.weight_versions), each sample's last weight
    version, and stats: generation rounds, groups carried to the next step, and the fraction of the
    step's samples begun in an earlier step (resumed)."""
    n_inflight = math.ceil(n_prompts * rcfg.over_sampling)
    new = n_inflight - len(pool.groups)
    if new > 0:
        prompts, labels = rollout_lib.step_prompts(task, rcfg, data_key, root_key, pool.drawn, new)
        for j, (p, lab) in enumerate(zip(prompts, labels, strict=True)):
            keys = [prng.to_list(prng.fold_in(rollout_key, j * group + i)) for i in range(group)]
            pool.groups.append(Group([Slot(list(p), lab, k) for k in keys]))
        pool.drawn += new
    rounds = 0
    while sum(g.done for g in pool.groups) < n_prompts:
        _generate_round(pool, engine, sampling, chunk)
        rounds += 1
    picked = [g for g in pool.groups if g.done][:n_prompts]
    pool.groups = [g for g in pool.groups if all(g is not p for p in picked)]
    slots = [s for g in picked for s in g.slots]
    prompts = [s.prompt for s in slots]
    batch = Batch([list(s.tokens) for s in slots], [list(s.logprobs) for s in slots], [s.finish for s in slots],
                  [s.versions[0] for s in slots])
    rewards, errors = rollout_lib.score(task, rcfg, prompts, batch.tokens, [s.label for s in slots])
    informative = sum(len(set(rewards[i * group : (i + 1) * group])) > 1 for i in range(n_prompts))
    stats = {"partial_rounds": float(rounds), "partial_carried_groups": float(len(pool.groups)),
             "partial_resumed_frac": sum(s.started < pool.step for s in slots) / len(slots)}
    pool.step += 1
    col = rollout_lib.Collected(prompts, batch, None, rewards, errors, informative)
    return col, [s.versions[-1] for s in slots], stats


def to_tree(pool: Pool) -> dict[str, Any]:
    """The pool as a checkpointable tree (lists, tuples and scalars; labels keep their types)."""
    return dataclasses.asdict(pool)


def from_tree(tree: dict[str, Any]) -> Pool:
    groups = [Group([Slot(**s) for s in g["slots"]]) for g in tree["groups"]]
    return Pool(groups, int(tree["drawn"]), int(tree["step"]))
