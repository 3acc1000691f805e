"""How the loop runs its rollouts: standalone debug modes, partial rollouts, one-step-off-policy async.

The modes change the order of work, never what a step computes from its inputs: every mode is a
function of the flags (no wall-clock decides which sample lands in which step). `check` refuses
the combinations that have no meaning, naming the flags, before anything is built.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class LoopModes:
    debug_rollout_only: bool = False  # rollouts + rewards each step; never train or sync weights
    debug_train_only: bool = False  # train from --load_rollouts; no engine is built
    partial_rollouts: bool = False  # unfinished samples carry over to the next step (launch/partial.py)
    partial_rollout_tokens: int = 0  # new tokens per sample per generation round (0 = max_new_tokens / 4)
    async_rollout: bool = False  # step k+1's rollout runs during step k's update (one step off-policy)


def check(cfg: Any) -> None:
    """ValueError naming the flags when cfg's modes cannot run together (cfg: launch.flags.RunConfig)."""
    m, r = cfg.modes, cfg.rollout
    if cfg.tokenizer and not r.prompt_data:
        raise ValueError(f"--tokenizer={cfg.tokenizer} encodes --prompt_data prompts; without --prompt_data the "
                         "task's own tokenizer is used. Set --prompt_data=FILE.jsonl or drop --tokenizer")
    if m.debug_rollout_only and m.debug_train_only:
        raise ValueError("--debug_rollout_only and --debug_train_only exclude each other: the first never trains, "
                         "the second never rolls out. Run --debug_rollout_only --save_rollouts=DIR, then "
                         "--debug_train_only --load_rollouts=DIR")
    if m.debug_train_only and not r.load_rollouts:
        raise ValueError("--debug_train_only trains without a rollout engine, so its batches must come from "
                         "--load_rollouts=DIR (written by a run with --save_rollouts=DIR, e.g. "
                         "--debug_rollout_only --save_rollouts=DIR)")
    if (m.debug_rollout_only or m.debug_train_only) and cfg.sft:
        flag = "--debug_rollout_only" if m.debug_rollout_only else "--debug_train_only"
        raise ValueError(f"{flag} is a mode of the RL loop; --sft runs no rollouts. Drop one of them")
    if m.debug_rollout_only:
        if r.load_rollouts:
            raise ValueError(f"--debug_rollout_only generates each step's rollouts; --load_rollouts={r.load_rollouts} "
                             "would replace them. Drop --load_rollouts (or use --debug_train_only with it)")
        if cfg.sft_warmup_steps:
            raise ValueError(f"--debug_rollout_only never trains, so --sft_warmup_steps={cfg.sft_warmup_steps} "
                             "cannot run: pass --sft_warmup_steps=0 (roll out a trained policy with --hf_checkpoint)")
        if cfg.repro.resume:
            raise ValueError("--debug_rollout_only writes no checkpoints and would truncate the checkpointed run's "
                             "metrics.jsonl: use a new --output_dir without --resume (and --hf_checkpoint for "
                             "trained weights)")
    if m.async_rollout:
        if m.debug_rollout_only or m.debug_train_only or r.load_rollouts:
            raise ValueError("--async_rollout overlaps rollout and training, so it needs both: drop "
                             "--debug_rollout_only / --debug_train_only / --load_rollouts, or --async_rollout")
        if cfg.memory.offload_train_state:
            raise ValueError("--async_rollout trains while the engine generates, so the train state cannot be "
                             "parked on the host: drop --offload_train_state or --async_rollout")
    if m.partial_rollouts:
        if r.over_sampling <= 1.0:
            raise ValueError("--partial_rollouts carries unfinished samples over when a step has enough finished "
                             "groups, which needs more groups in flight than a step trains on: set "
                             f"--over_sampling > 1 (now {r.over_sampling})")
        if r.load_rollouts or m.debug_train_only:
            raise ValueError("--partial_rollouts shapes generation; with --load_rollouts / --debug_train_only "
                             "nothing is generated. Drop --partial_rollouts")
        if r.custom_generate_fn:
            raise ValueError(f"--partial_rollouts cannot resume a multi-turn --custom_generate_fn="
                             f"{r.custom_generate_fn} mid-trajectory; drop one of them")
        if cfg.shaping.dynamic_sampling or cfg.shaping.overlong_buffer:
            raise ValueError("--partial_rollouts is a form of --over_sampling and cannot be combined with "
                             "--dynamic_sampling or --overlong_buffer yet")
