"""One step's rollouts: which prompts, how they are generated, how they are scored.

Prompts come from the task (default) or from `--prompt_data` (JSONL, seeded epoch order);
generation is one engine batch or `--custom_generate_fn` (multi-turn, tools, with a loss mask);
rewards come from the task, exact match against the dataset label, or `--custom_reward_fn`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from launch import data, plugins
from launch.data import DataError
from launch.engines.base import Batch, Engine, generate_batch, make_requests
from launch.engines.config import RolloutConfig
from miles_fn import dapo, prng
from miles_fn.sampling import SamplingConfig

__all__ = ["Collected", "DataError", "GroupSelection", "check_prompt_lengths", "collect", "step_prompts"]

DATA_ORDER_STREAM = 0xDA7A  # fold_in(root key, this): the key of the dataset's epoch orders


class Collected(NamedTuple):
    prompts: list[list[int]]  # one per sample (each prompt repeated group times)
    batch: Batch
    loss_masks: list[list[int]] | None  # None = every response token is trained on
    rewards: list[float]
    reward_errors: int
    informative_groups: int = 0  # groups whose rewards are not all equal (they carry a GRPO signal)
    stats: dict[str, float] | None = None  # dynamic sampling's ds_* metrics (when GroupSelection.fill is off)


@dataclasses.dataclass(frozen=True)
class GroupSelection:
    """Which groups of samples a step trains on: one loop for --over_sampling and DAPO's --dynamic_sampling.

    Each round draws ceil(prompts_per_step * over_sampling) prompts and keeps, in order, the groups
    whose rewards differ (a constant group has zero GRPO advantage), until prompts_per_step are
    kept or `rounds` rounds ran. After the last round, `fill` tops the batch up with that round's
    constant groups, keeping its order (over-sampling); without it the step trains on what was kept,
    or, with nothing kept, on the whole last round (DAPO: never an empty batch).
    """

    rounds: int = 1
    fill: bool = True


def select_groups(rewards: Sequence[float], group: int, keep: int) -> list[int]:
    """Indices of the `keep` groups to train on out of an over-sampled batch: groups whose rewards
    differ first (a constant group has zero GRPO advantage), then constant ones, each in order."""
    informative = informative_group_ids(rewards, group)
    rest = [g for g in range(len(rewards) // group) if g not in set(informative)]
    return sorted((informative + rest)[:keep])


def informative_group_ids(rewards: Sequence[float], group: int) -> list[int]:
    """Groups (consecutive runs of `group` samples) whose rewards are not all equal, in order."""
    ids = torch.arange(len(rewards)) // group
    return torch.nonzero(dapo.informative_groups(torch.tensor(rewards, dtype=torch.float64), ids)).flatten().tolist()


def step_prompts(task: Any, rcfg: RolloutConfig, data_key: prng.Key, root_key: prng.Key, start: int, n: int
                 ) -> tuple[list[list[int]], list[Any]]:
    """(prompt ids, labels) of n prompts: from the task (drawn with data_key), or dataset samples
    start .. start+n-1 of the run's seeded stream."""
    if not rcfg.prompt_data:
        pairs = task.sample_pairs(data_key, n)
        return [task.prompt_ids(*p) for p in pairs], pairs
    rows = data.cached_jsonl(rcfg.prompt_data, rcfg.input_key, rcfg.label_key, "--prompt_data")
    return encode_rows(data.rows_at(rows, prng.fold_in(root_key, DATA_ORDER_STREAM), start, n), task, rcfg.prompt_data)


def encode_rows(rows: Sequence[data.PromptRow], task: Any, path: str) -> tuple[list[list[int]], list[Any]]:
    """(prompt ids, labels) of dataset rows; a row that cannot be encoded is named by file and line."""
    ids = []
    for r in rows:
        try:
            ids.append(data.encode_prompt(r.prompt, task.tokenizer))
        except (ValueError, DataError) as e:
            raise DataError(f"{path}:{r.line}: {e}") from None
        if not ids[-1]:
            raise DataError(f"{path}:{r.line}: the prompt encodes to no tokens (generation needs at least one)")
    return ids, [r.label for r in rows]


def check_prompt_lengths(task: Any, rcfg: RolloutConfig, max_new_tokens: int, max_positions: int) -> None:
    """Before the first step: every --prompt_data and --eval_data prompt plus --max_new_tokens fits the model's
    positions, else a DataError naming the file, the row and both lengths (generation would fail mid-run).

    It encodes each file once; --prompt_data is skipped under --load_rollouts (nothing is generated from it).
    """
    files = [("--prompt_data", rcfg.prompt_data)] if not rcfg.load_rollouts else []
    for flag, path in [*files, ("--eval_data", rcfg.eval_data)]:
        if not path:
            continue
        rows = data.cached_jsonl(path, rcfg.input_key, rcfg.label_key, flag)
        ids, _ = encode_rows(rows, task, path)
        for r, p in zip(rows, ids, strict=True):
            if len(p) + max_new_tokens > max_positions:
                fix = (f"lower --max_new_tokens to at most {max_positions - len(p)} or shorten the prompt"
                       if len(p) < max_positions else "shorten the prompt or drop the row")
                raise DataError(f"{path}:{r.line}: the prompt is {len(p)} tokens, and with --max_new_tokens="
                                f"{max_new_tokens} it needs {len(p) + max_new_tokens} positions, more than the model's "
                                f"max_position_embeddings ({max_positions}); {fix}")


def collect(engine: Engine, task: Any, rcfg: RolloutConfig, sampling: SamplingConfig, data_key: prng.Key,
            rollout_key: prng.Key, root_key: prng.Key, step: int, n_prompts: int, group: int,
            selection: GroupSelection = GroupSelection(),
            round_keys: Callable[[int], tuple[prng.Key, prng.Key]] | None = None) -> Collected:
    """One step's samples, n_prompts groups of `group` (fewer only under DAPO's selection, see GroupSelection).

    Round 0 uses data_key and rollout_key; round r > 0 the keys round_keys(r). With --prompt_data,
    round r of step s reads the dataset from (s * rounds + r) * prompts-per-round on.
    """
    n_drawn = math.ceil(n_prompts * rcfg.over_sampling) if rcfg.over_sampling > 1 else n_prompts
    parts: list[tuple[Collected, list[int]]] = []  # (a round, the groups kept from it)
    have = informative = rounds = 0
    while True:
        keys = (data_key, rollout_key) if rounds == 0 else round_keys(rounds)  # type: ignore[misc]
        rnd = _round(engine, task, rcfg, sampling, *keys, root_key, (step * selection.rounds + rounds) * n_drawn,
                     n_drawn, group)
        rounds += 1
        take = informative_group_ids(rnd.rewards, group)[: n_prompts - have]
        informative += len(take)
        done = have + len(take) >= n_prompts or rounds >= selection.rounds
        if done and selection.fill:
            take = select_groups(rnd.rewards, group, n_prompts - have)
        have += len(take)
        parts.append((rnd, take))
        if done:
            break
    stats = None
    if not selection.fill:
        stats = {"ds_rounds": float(rounds), "ds_kept_groups": float(have), "ds_kept_frac": have / (rounds * n_drawn),
                 "ds_batch_full": float(have >= n_prompts)}
        if have == 0:
            parts = [(rnd, list(range(n_drawn)))]
    if len(parts) == 1 and parts[0][1] == list(range(n_drawn)):
        return rnd._replace(informative_groups=informative, stats=stats)
    picked = [_pick(c, [g * group + j for g in take for j in range(group)]) for c, take in parts]
    return Collected(
        [p for c in picked for p in c.prompts],
        Batch(*(None if any(getattr(c.batch, f) is None for c in picked)  # routed_experts may be absent
                else [x for c in picked for x in getattr(c.batch, f)] for f in Batch._fields)),
        None if rnd.loss_masks is None else [m for c in picked for m in c.loss_masks],  # type: ignore[union-attr]
        [r for c in picked for r in c.rewards],
        sum(c.reward_errors for c, _ in parts),
        informative,
        stats,
    )


def _pick(c: Collected, rows: list[int]) -> Collected:
    pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
    batch = Batch(*(None if col is None else pick(col) for col in c.batch))  # routed_experts may be None
    return c._replace(prompts=pick(c.prompts), batch=batch, rewards=pick(c.rewards),
                      loss_masks=None if c.loss_masks is None else pick(c.loss_masks))


def _round(engine: Engine, task: Any, rcfg: RolloutConfig, sampling: SamplingConfig, data_key: prng.Key,
           rollout_key: prng.Key, root_key: prng.Key, start: int, n: int, group: int) -> Collected:
    """n prompts (dataset rows start.. with --prompt_data), `group` samples each, generated and scored."""
    base, labels = step_prompts(task, rcfg, data_key, root_key, start, n)
    prompts = [p for p in base for _ in range(group)]
    return generate_and_score(engine, task, rcfg, sampling, rollout_key, prompts,
                              [lab for lab in labels for _ in range(group)])


def generate_and_score(engine: Engine, task: Any, rcfg: RolloutConfig, sampling: SamplingConfig,
                       rollout_key: prng.Key, prompts: Sequence[Sequence[int]], labels: Sequence[Any]) -> Collected:
    """One sample per prompt (request i keyed fold_in(rollout_key, i)), generated by the engine or
    --custom_generate_fn and scored by `score`: what a rollout does, and what evaluation reuses."""
    prompts = [list(p) for p in prompts]
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
    rewards, errors = score(task, rcfg, prompts, batch.tokens, labels)
    return Collected(prompts, batch, masks, rewards, errors)


def eval_prompts(task: Any, rcfg: RolloutConfig) -> tuple[list[list[int]], list[Any]]:
    """(prompt ids, labels) of every --eval_data row; a row that cannot be encoded is named by file and line."""
    rows = data.cached_jsonl(rcfg.eval_data, rcfg.input_key, rcfg.label_key, "--eval_data")
    return encode_rows(rows, task, rcfg.eval_data)


def score(task: Any, rcfg: RolloutConfig, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
          labels: Sequence[Any]) -> tuple[list[float], int]:
    """(rewards, reward errors) of finished samples, scored as `collect` scores them."""
    tok = task.tokenizer
    if rcfg.custom_reward_fn:
        fn = plugins.load_function(rcfg.custom_reward_fn, "custom_reward_fn")
        inputs = [plugins.RewardInput(i, list(p), list(r), tok.decode(list(p)), tok.decode(list(r)), lab)
                  for i, (p, r, lab) in enumerate(zip(prompts, responses, labels, strict=True))]
        return plugins.compute_rewards(fn, inputs, rcfg.reward_errors, rcfg.reward_timeout_s)
    if rcfg.prompt_data:
        return [float(tok.eos_id in r and tok.decode(list(r)).strip() == str(lab).strip())
                for r, lab in zip(responses, labels, strict=True)], 0
    return [task.reward(list(r), lab) for r, lab in zip(responses, labels, strict=True)], 0
