"""One step's rollouts: which prompts, how they are generated, how they are scored.

Prompts come from the task (default) or from `--prompt_data` (JSONL, seeded epoch order);
generation is one engine batch or `--custom_generate_fn` (multi-turn, tools, with a loss mask);
rewards come from the task, exact match against the dataset label, or `--custom_reward_fn`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from launch import data, plugins
from launch.data import DataError
from launch.engines.base import Batch, Engine, generate_batch, make_requests
from launch.engines.config import RolloutConfig
from miles_fn import prng
from miles_fn.sampling import SamplingConfig

__all__ = ["Collected", "DataError", "collect", "step_prompts"]

DATA_ORDER_STREAM = 0xDA7A  # fold_in(root key, this): the key of the dataset's epoch orders


class Collected(NamedTuple):
    prompts: list[list[int]]  # one per sample (each prompt repeated group times)
    batch: Batch
    loss_masks: list[list[int]] | None  # None = every response token is trained on
    rewards: list[float]
    reward_errors: int
    informative_groups: int = 0  # groups whose rewards are not all equal (they carry a GRPO signal)


def select_groups(rewards: Sequence[float], group: int, keep: int) -> list[int]:
    """Indices of the `keep` groups to train on out of an over-sampled batch: groups whose rewards
    differ first (a constant group has zero GRPO advantage), then constant ones, each in order."""
    n = len(rewards) // group
    informative = [g for g in range(n) if len(set(rewards[g * group : (g + 1) * group])) > 1]
    rest = [g for g in range(n) if g not in set(informative)]
    return sorted((informative + rest)[:keep])


def step_prompts(task: Any, rcfg: RolloutConfig, data_key: prng.Key, root_key: prng.Key, start: int, n: int
                 ) -> tuple[list[list[int]], list[Any]]:
    """(prompt ids, labels) of n prompts: from the task (drawn with data_key), or dataset samples
    start .. start+n-1 of the run's seeded stream."""
    if not rcfg.prompt_data:
        pairs = task.sample_pairs(data_key, n)
        return [task.prompt_ids(*p) for p in pairs], pairs
    rows = data.cached_jsonl(rcfg.prompt_data, rcfg.input_key, rcfg.label_key)
    picked = data.rows_at(rows, prng.fold_in(root_key, DATA_ORDER_STREAM), start, n)
    ids = []
    for r in picked:
        try:
            ids.append(data.encode_prompt(r.prompt, task.tokenizer))
        except (ValueError, DataError) as e:
            raise DataError(f"{rcfg.prompt_data}:{r.line}: {e}") from None
    return ids, [r.label for r in picked]


def collect(engine: Engine, task: Any, rcfg: RolloutConfig, sampling: SamplingConfig, data_key: prng.Key,
            rollout_key: prng.Key, root_key: prng.Key, step: int, n_prompts: int, group: int) -> Collected:
    n_drawn = math.ceil(n_prompts * rcfg.over_sampling) if rcfg.over_sampling > 1 else n_prompts
    base, labels = step_prompts(task, rcfg, data_key, root_key, step * n_drawn, n_drawn)
    prompts = [p for p in base for _ in range(group)]
    sample_labels = [lab for lab in labels for _ in range(group)]
    masks = None
    if rcfg.custom_generate_fn:
        fn = plugins.load_function(rcfg.custom_generate_fn, "custom_generate_fn")
        tok = task.tokenizer
        ctx = plugins.GenerateContext(decode=tok.decode, encode=tok.encode, eos_id=tok.eos_id)
        trajs = plugins.run_custom_generate(fn, engine, make_requests(prompts, rollout_key), sampling, ctx)
        batch = Batch([t.tokens for t in trajs], [t.logprobs for t in trajs], [t.finish_reason for t in trajs],
                      [t.weight_version for t in trajs])
        masks = [list(t.loss_mask) for t in trajs]
    else:
        batch = generate_batch(engine, prompts, rollout_key, sampling)
    errors = 0
    if rcfg.custom_reward_fn:
        fn = plugins.load_function(rcfg.custom_reward_fn, "custom_reward_fn")
        inputs = [plugins.RewardInput(i, p, r, task.tokenizer.decode(p), task.tokenizer.decode(r), lab)
                  for i, (p, r, lab) in enumerate(zip(prompts, batch.tokens, sample_labels, strict=True))]
        rewards, errors = plugins.compute_rewards(fn, inputs, rcfg.reward_errors)
    elif rcfg.prompt_data:
        rewards = [float(task.tokenizer.eos_id in r and task.tokenizer.decode(r).strip() == str(lab).strip())
                   for r, lab in zip(batch.tokens, sample_labels, strict=True)]
    else:
        rewards = [task.reward(r, lab) for r, lab in zip(batch.tokens, sample_labels, strict=True)]
    groups = select_groups(rewards, group, n_prompts)
    informative = sum(len(set(rewards[g * group : (g + 1) * group])) > 1 for g in groups)
    if n_drawn == n_prompts:
        return Collected(prompts, batch, masks, rewards, errors, informative)
    idx = [g * group + j for g in groups for j in range(group)]
    pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
    batch = Batch(*(pick(col) for col in batch))
    return Collected(pick(prompts), batch, pick(masks) if masks is not None else None, pick(rewards), errors,
                     informative)


def score(task: Any, rcfg: RolloutConfig, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
          labels: Sequence[Any]) -> tuple[list[float], int]:
    """(rewards, reward errors) of finished samples, scored as `collect` scores them."""
    tok = task.tokenizer
    if rcfg.custom_reward_fn:
        fn = plugins.load_function(rcfg.custom_reward_fn, "custom_reward_fn")
        inputs = [plugins.RewardInput(i, list(p), list(r), tok.decode(list(p)), tok.decode(list(r)), lab)
                  for i, (p, r, lab) in enumerate(zip(prompts, responses, labels, strict=True))]
        return plugins.compute_rewards(fn, inputs, rcfg.reward_errors)
    if rcfg.prompt_data:
        return [float(tok.eos_id in r and tok.decode(list(r)).strip() == str(lab).strip())
                for r, lab in zip(responses, labels, strict=True)], 0
    return [task.reward(list(r), lab) for r, lab in zip(responses, labels, strict=True)], 0
