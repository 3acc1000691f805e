"""The main job: prompts -> rollout -> rewards -> advantages -> update -> weight sync, repeated.

    python -m launch.main --flagfile=launch/flags/cpu_tiny.flags

Every random draw comes from the root key of --seed: step s uses fold_in(root, s),
split by purpose into data, rollout and train keys (K_* below).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from absl import app, flags

import ops
import third_party
from launch import data, debug, distributed, modes, partial, profiling, resume, rl, run_dir, steps
from launch import flags as run_flags
from launch import memory as launch_memory
from launch import rollout as rollout_lib
from launch import sft as sft_data
from launch import speculative as spec_launch
from launch.engines import Engine, EngineError, make_engine
from launch.engines.base import generate_batch
from launch.evaluation import sampled_pass_at_k
from launch.metrics import MetricsFileError, MetricsWriter, plot_curves, to_floats
from launch.plugins import PluginError
from launch.rollout import DataError
from launch.rollout_io import RolloutFileError, load_rollout, save_rollout
from miles_fn import lora, model, prng, routing, train
from miles_fn.batching import pack_right_padded
from miles_fn.rollout_buffer import build_rollout_buffer
from miles_fn.sampling import SamplingConfig
from miles_fn.tasks.addition import AdditionTask
from miles_fn.tasks.chat_arith import ChatArithTask
from state import gguf_import, hf
from state.train_state import RolloutBuffer, TrainState
from state.tree import tree_hash, tree_leaves

# Sub-keys of a step's key, by purpose. Fixed forever: changing one changes every run.
K_DATA, K_ROLLOUT, K_TRAIN = 0, 1, 2
INIT_STREAM, SFT_STREAM, EVAL_STREAM = 0x1417, 1 << 31, 0xE7A1
LORA_STREAM = 0x10AA


class UserError(Exception):
    """A bad input (file, checkpoint, flag combination): reported as one line, no traceback."""


@dataclasses.dataclass
class Job:
    cfg: run_flags.RunConfig
    task: AdditionTask | ChatArithTask
    state: TrainState
    engine: Engine
    eval_pairs: list[tuple[int, int]]
    cursor: resume.Cursor = dataclasses.field(default_factory=resume.Cursor)
    ref_params: Any = None  # the KL reference (the policy after the SFT warm-up), when --kl_coef > 0
    saved_step: int = -1  # state.step of the last checkpoint written or resumed from
    rollout_task: Any = None  # what rollouts draw prompts from: the task, or --prompt_data's tokenizer
    pool: partial.Pool | None = None  # --partial_rollouts: the unfinished groups carried between steps
    ahead_rollout: Any = None  # --async_rollout: (buffer, stats) of the next step, generated ahead
    eval_set: Any = None  # --eval_data: (prompt ids, labels) of its first --eval_size rows
    base_hash: str = ""  # --lora_rank: tree_hash of the frozen base, once (it never changes; seconds for a real model)
    ranks: distributed.Ranks = distributed.SINGLE  # torchrun: this process's rank, the world, the ("dp",) mesh
    where: str = "setup"  # what the loop is doing (named when a collective fails under torchrun)


class NoEngine:
    """--debug_train_only: no rollout engine exists; anything that would generate is a bug, said loudly."""

    version = 0

    def generate(self, requests: Any, sampling: Any) -> Any:
        raise EngineError("--debug_train_only: this run has no rollout engine (it trains on --load_rollouts)")

    def update_weights(self, version: int, params: Any) -> None:
        self.version = version

    def health(self) -> bool:
        return True

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def flush_cache(self) -> None:
        pass

    def close(self) -> None:
        pass


def setup_torch(cfg: run_flags.RunConfig) -> None:
    if cfg.deterministic:  # cuBLAS is deterministic only with a fixed workspace (set before CUDA starts)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(cfg.num_threads)
    ops.use_deterministic_algorithms(cfg.deterministic, cfg.ops.compile)


def build(cfg: run_flags.RunConfig, ranks: distributed.Ranks = distributed.SINGLE) -> Job:
    try:
        ops.require_backends(cfg.ops)
    except (third_party.MissingPackageError, ValueError) as e:
        raise UserError(str(e)) from e
    task = make_task(cfg)
    root = prng.key(cfg.seed)
    if cfg.hf_checkpoint:
        try:
            mcfg, params = hf.load_hf(cfg.hf_checkpoint)
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"--hf_checkpoint={cfg.hf_checkpoint}: {type(e).__name__}: {e}") from e
        if mcfg.vocab_size < task.tokenizer.vocab_size:
            raise UserError(f"--hf_checkpoint={cfg.hf_checkpoint}: vocab {mcfg.vocab_size} is smaller than the "
                            f"task tokenizer's {task.tokenizer.vocab_size}")
        cfg = dataclasses.replace(cfg, model=mcfg)
    else:
        params = model.init_params(cfg.model, prng.fold_in(root, INIT_STREAM), cfg.init_std)
    check_positions(cfg, task)
    # --lora_rank: the optimizer trains adapters of the frozen params (their A from their own stream of the seed)
    state = (lora.init_state(params, cfg.lora, prng.fold_in(root, LORA_STREAM), root) if cfg.lora.enabled
             else train.init_state(params, root))
    rollout_task: Any = task
    if cfg.tokenizer:
        try:
            tok = data.load_tokenizer(cfg.tokenizer)
        except DataError as e:
            raise UserError(str(e)) from e
        if tok.vocab_size > cfg.model.vocab_size:
            raise UserError(f"--tokenizer={cfg.tokenizer}: {tok.vocab_size} tokens, more than the model's vocabulary "
                            f"of {cfg.model.vocab_size}")
        rollout_task = data.DatasetTask(tok)
    if rollout_task.tokenizer.vocab_size < cfg.model.vocab_size:  # a padded vocabulary: its extra rows are no tokens
        cfg = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling,
                                                                    vocab_limit=rollout_task.tokenizer.vocab_size))
    rollout_lib.check_prompt_lengths(rollout_task, cfg.rollout, cfg.sampling.max_new_tokens,
                                     cfg.model.max_position_embeddings)  # DataError names file:line
    if cfg.modes.debug_train_only or not ranks.main:  # torchrun: rank 0 generates for all ranks
        engine: Engine = NoEngine()
    else:
        engine = make_engine(cfg.rollout, cfg.model, lora.model_params(state, cfg.lora), cfg.output_dir,
                             cfg.num_threads, ops_cfg=cfg.ops, vocab_limit=cfg.sampling.vocab_limit,
                             draft=spec_launch.server_draft(cfg, state))
        engine = spec_launch.engine_for(cfg, engine)  # --speculative_algorithm: the embedded engine with a draft
    pool = partial.Pool() if cfg.modes.partial_rollouts else None
    eval_set = None
    if cfg.rollout.eval_data:
        prompts, labels = rollout_lib.eval_prompts(rollout_task, cfg.rollout)  # DataError names file:line
        eval_set = (prompts[: cfg.eval_size], labels[: cfg.eval_size])
    return Job(cfg, task, distributed.shard(state, ranks), engine, task.heldout_pairs(cfg.eval_size),
               rollout_task=rollout_task, pool=pool, eval_set=eval_set, ranks=ranks)


def make_task(cfg: run_flags.RunConfig) -> AdditionTask | ChatArithTask:
    """The built-in task of --task (chat_arith poses its questions through --hf_checkpoint's chat template)."""
    if cfg.task == "chat_arith":
        return chat_task(cfg.hf_checkpoint, cfg.task_digits, cfg.task_second_digits, cfg.task_ops)
    return AdditionTask(digits=cfg.task_digits, reverse_answer=cfg.task_reverse_answer,
                        fixed_width=cfg.task_fixed_width)


def chat_task(hf_dir: str, digits: int, second_digits: int, task_ops: str) -> ChatArithTask:
    try:
        return ChatArithTask(data.load_tokenizer(hf_dir), digits, second_digits, task_ops)
    except (DataError, ValueError) as e:
        raise UserError(f"--task=chat_arith with --hf_checkpoint={hf_dir}: {e}") from e


def resolve_hf_checkpoint(spec: str, cache_dir: str) -> str:
    """--hf_checkpoint as a checkpoint directory: a .gguf file or a model name is converted once under
    --model_cache_dir (state/gguf_import.py); a directory stays as it is."""
    try:
        return gguf_import.resolve_checkpoint(spec, cache_dir, log=lambda m: sys.stderr.write(m + "\n"))
    except gguf_import.ImportFailed as e:
        raise UserError(f"--hf_checkpoint={spec}: {e}") from e


def check_positions(cfg: run_flags.RunConfig, task: AdditionTask | ChatArithTask) -> None:
    """The task's longest prompt plus --max_new_tokens must fit the model's positions (--prompt_data rows are
    checked row by row when they are read)."""
    if cfg.rollout.prompt_data or cfg.rollout.load_rollouts:
        return
    longest = len(task.prompt_ids(task.max_operand - 1, task.max_operand - 1))
    limit = cfg.model.max_position_embeddings
    if longest + cfg.sampling.max_new_tokens > limit:
        where = f"--hf_checkpoint={cfg.hf_checkpoint}'s max_position_embeddings" if cfg.hf_checkpoint else (
            "the randomly initialised model's positions")
        raise UserError(f"--max_new_tokens={cfg.sampling.max_new_tokens} with the task's prompts of up to {longest} "
                        f"tokens needs {longest + cfg.sampling.max_new_tokens} positions, more than {where} "
                        f"({limit}); lower --max_new_tokens to at most {limit - longest}")


def evaluate(job: Job) -> float:
    """Held-out success of greedy decoding: the task's held-out pairs, or --eval_data scored as the run's
    rollouts are (NaN without an engine, or for a --prompt_data run without --eval_data)."""
    task, cfg = job.task, job.cfg
    if cfg.modes.debug_train_only or (cfg.rollout.prompt_data and job.eval_set is None) or not job.ranks.main:
        return float("nan")  # torchrun: rank 0 evaluates (it alone writes metrics and the summary)
    if job.eval_set is not None:
        prompts, labels = job.eval_set
        greedy = dataclasses.replace(cfg.sampling, temperature=0.0)
        col = rollout_lib.generate_and_score(job.engine, job.rollout_task, cfg.rollout, greedy, prng.key(EVAL_STREAM),
                                             prompts, labels)
        return sum(col.rewards) / len(col.rewards)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=job.cfg.sampling.max_new_tokens,
                            stop_token_ids=(task.tokenizer.eos_id,), vocab_limit=task.tokenizer.vocab_size)
    gen = generate_batch(job.engine, [task.prompt_ids(*p) for p in job.eval_pairs], prng.key(EVAL_STREAM), greedy)
    return sum(task.reward(r, p) for r, p in zip(gen.tokens, job.eval_pairs, strict=True)) / len(job.eval_pairs)


def eval_pass_at_k(job: Job) -> dict[str, float]:
    """--eval_pass_k: pass@1 and pass@k of sampled responses on the evaluation set of `evaluate`."""
    cfg, k = job.cfg, job.cfg.rollout.eval_pass_k
    if job.eval_set is not None:
        prompts, labels = job.eval_set
        score = lambda ps, rs, labs: rollout_lib.score(job.rollout_task, cfg.rollout, ps, rs, labs)[0]  # noqa: E731
    elif cfg.rollout.prompt_data:
        return {}
    else:
        prompts, labels = [job.task.prompt_ids(*p) for p in job.eval_pairs], job.eval_pairs
        score = lambda ps, rs, labs: [job.task.reward(r, lab) for r, lab in zip(rs, labs, strict=True)]  # noqa: E731
    return sampled_pass_at_k(job.engine, prompts, labels, score, cfg.sampling, k, (1, k))


def sft_batch(task: AdditionTask, key: prng.Key, n: int) -> RolloutBuffer:
    prompts, answers = zip(*(task.sft_example(p) for p in task.sample_pairs(key, n)))
    tokens, positions, seg, mask = pack_right_padded(list(prompts), list(answers))
    zeros = torch.zeros_like(mask)
    return RolloutBuffer(tokens, positions, seg, mask, zeros, zeros, torch.zeros(n), torch.zeros(n, dtype=torch.int64))


def sft_warmup(job: Job, guard: steps.StepGuard) -> float:
    """Supervised steps on task answers, from the cursor on. The optimizer state carries into RL:
    restarting Adam would make RL's first update a sign step of size lr on every weight."""
    cfg, cur = job.cfg, job.cursor
    stream = prng.fold_in(job.state.key, SFT_STREAM)
    for s in range(cur.sft_step, cfg.sft_warmup_steps):
        k = prng.fold_in(stream, s)
        job.where = f"SFT step {s + 1}"
        batch = sft_batch(job.task, k, cfg.sft_batch_size)
        debug.block_at(cfg.repro.debug_block_at, "sft_step", s + 1)
        job.state, m = guard("sft", s + 1, job.state, batch, k)
        cur.sft_step = s + 1
        cur.summary["sft_final_loss"] = float(m["loss"])
        if cfg.save_every and cur.sft_step % cfg.save_every == 0 and cur.sft_step < cfg.sft_warmup_steps:
            save_checkpoint(job)
    job.engine.update_weights(int(job.state.step), model_params(job))
    return cur.summary.get("sft_final_loss", float("nan"))


# Per-sample entries of a rollout's stats (saved with --save_rollouts, never written to metrics.jsonl):
# the first and last weight version that generated each sample (they differ for a resumed partial sample).
SAMPLE_STATS = ("sample_version_first", "sample_version_last")


def rollout(
    job: Job, key: prng.Key, ref_params: Any, timer: profiling.PhaseTimer | None = None, rl_step: int | None = None
) -> tuple[RolloutBuffer, dict[str, torch.Tensor]]:
    """RL step `rl_step`'s buffer (1-based; default: the one after the state's last update) and its stats."""
    cfg, g = job.cfg, job.cfg.group_size
    timer = timer or profiling.PhaseTimer()
    if rl_step is None:
        rl_step = int(job.state.step) - cfg.sft_warmup_steps + 1
    if cfg.rollout.load_rollouts:
        return load_rollout(cfg.rollout.load_rollouts, rl_step)
    task = job.rollout_task if job.rollout_task is not None else job.task
    extra: dict[str, float] = {}
    with timer("rollout"):  # generation; collect also scores the responses
        if job.pool is not None:  # --partial_rollouts
            col, last_versions, extra = partial.collect(
                job.pool, job.engine, task, cfg.rollout, cfg.sampling, prng.fold_in(key, K_DATA),
                prng.fold_in(key, K_ROLLOUT), job.state.key, cfg.prompts_per_step, g,
                partial.round_tokens(cfg.modes.partial_rollout_tokens, cfg.sampling.max_new_tokens))
        else:
            # over-sampling, DAPO's dynamic sampling and overlong shaping are one loop (launch.rl.collect)
            col = rl.collect(job, key, K_DATA, K_ROLLOUT, rl_step - 1, task)
            last_versions = col.batch.weight_versions
    with timer("reward"):
        prompts, gen, rewards = col.prompts, col.batch, col.rewards
        buf = build_rollout_buffer(prompts, gen.tokens, gen.logprobs, rewards, [i // g for i in range(len(prompts))],
                                   cfg.normalize_advantage_std, col.loss_masks)
        if getattr(gen, "routed_experts", None) is not None:  # MoE: the engine's experts, for R3 and its metric
            m = cfg.model
            buf = buf._replace(routed_experts=routing.buffer_routes(gen.routed_experts, buf.loss_mask.shape[1],
                                                                     len(m.moe_layers), m.num_experts_per_tok))
    if ref_params is not None:
        with torch.no_grad(), timer("logprob_recompute"):
            ref_model = lora.full_params(ref_params, getattr(job.state, "base", None), cfg.lora)
            ref = model.sequence_logprobs(ref_model, cfg.model, buf.tokens, buf.positions, buf.segment_ids,
                                          cfg.loss.temperature, ops_cfg=cfg.ops)
        buf = buf._replace(ref_logprobs=ref)
    buf = rl.finish(job, buf)  # critic values and the configured advantage estimator
    n = len(gen.tokens)
    stats = {
        "reward_mean": buf.rewards.mean(),
        "response_len": torch.tensor(sum(len(t) for t in gen.tokens) / n),
        "truncated_frac": torch.tensor(sum(f == "length" for f in gen.finish_reasons) / n),
        "weight_version": torch.tensor(float(min(gen.weight_versions))),
        "reward_errors": torch.tensor(float(col.reward_errors)),
        "informative_groups_frac": torch.tensor(col.informative_groups / cfg.prompts_per_step),
        **{k: torch.tensor(v) for k, v in {**(col.stats or {}), **extra}.items()},
        "sample_version_first": torch.tensor(gen.weight_versions, dtype=torch.int64),
        "sample_version_last": torch.tensor(last_versions, dtype=torch.int64),
    }
    if cfg.rollout.save_rollouts:
        save_rollout(cfg.rollout.save_rollouts, rl_step, buf, stats)
    return buf, stats


def model_params(job: Job) -> Any:
    """The full model the trainer's state stands for, as the engine serves it: merged under --lora_rank.
    Under torchrun the params are gathered once (every rank takes part; rank 0's engine gets them)."""
    return lora.full_params(distributed.full(job.state.params), getattr(job.state, "base", None), job.cfg.lora)


def broadcast_rollout(job: Job, key: prng.Key, timer: profiling.PhaseTimer,
                      rl_step: int) -> tuple[RolloutBuffer, dict[str, torch.Tensor]]:
    """The step's rollout: generated by rank 0 (the one engine), the whole batch broadcast to every rank,
    so each rank trains on its slice of exactly the batch one process would have."""
    out = rollout(job, key, job.ref_params, timer, rl_step) if job.ranks.main else None
    return distributed.broadcast(out, job.ranks)


def lora_base_hash(job: Job) -> str:
    """The hash of the frozen LoRA base a checkpoint records and --resume checks, computed once a run."""
    if not job.base_hash:
        job.base_hash = tree_hash(job.state.base)
    return job.base_hash


def save_checkpoint(job: Job) -> None:
    """Everything the next step needs (launch/resume.py); once per state step.

    Under --lora_rank the frozen base is left out (it is rebuilt from --hf_checkpoint or --seed, as at the
    start); the checkpoint keeps its hash, which --resume checks, so the adapters continue on the same base.
    """
    if int(job.state.step) == job.saved_step:
        return
    block = lambda: debug.block_at(job.cfg.repro.debug_block_at, "checkpoint_write", int(job.state.step))
    extra: dict[str, Any] = {}
    if job.pool is not None:
        extra["partial_pool"] = partial.to_tree(job.pool)
    if job.ahead_rollout is not None:
        extra["ahead_rollout"] = {"buffer": job.ahead_rollout[0], "stats": dict(job.ahead_rollout[1])}
    state = job.state
    if getattr(state, "base", None) is not None:
        extra["lora_base_hash"] = lora_base_hash(job)
        state = state._replace(base=None)
    resume.save(job.cfg.output_dir, state, job.ref_params, job.cursor, run_flags.flag_values_dict(), block,
                extra)
    job.saved_step = int(job.state.step)


def restore(job: Job) -> None:
    """Continue from the latest checkpoint (--resume): state, KL reference, cursor, engine weights."""
    r = resume.restore(job.cfg.output_dir, run_flags.flag_values_dict(), job.ranks.mesh)
    state = distributed.shard(r.state, job.ranks)  # a checkpoint of one process, cut into this mesh's shards
    if getattr(job.state, "base", None) is not None:  # --lora_rank: the saved adapters on this run's (same) base
        saved, now = r.extra.pop("lora_base_hash", None), lora_base_hash(job)
        if saved != now:
            raise resume.ResumeError(f"--resume: the base model (--hf_checkpoint={job.cfg.hf_checkpoint!r}, "
                                     f"--seed={job.cfg.seed}) hashes to {now[:12]}, not to the {str(saved)[:12]} "
                                     f"the LoRA adapters of {r.path} were trained on; restore that checkpoint "
                                     f"directory or start a new --output_dir")
        state = state._replace(base=job.state.base)
    job.state, job.ref_params, job.cursor, job.saved_step = state, r.ref_params, r.cursor, int(r.state.step)
    if job.pool is not None and "partial_pool" in r.extra:
        job.pool = partial.from_tree(r.extra["partial_pool"])
    if "ahead_rollout" in r.extra:
        job.ahead_rollout = (r.extra["ahead_rollout"]["buffer"], r.extra["ahead_rollout"]["stats"])
    job.engine.update_weights(int(job.state.step), model_params(job))
    spec_launch.sync(job)
    sys.stderr.write(f"resumed from {r.path}: {job.cursor.sft_step} SFT and {job.cursor.rl_step} RL steps done\n")


def run(cfg: run_flags.RunConfig) -> dict[str, Any]:
    """The whole job, holding --output_dir's lock from before its first write to after its last (under
    torchrun: rank 0 holds it, and every rank joins the process group first)."""
    ranks = distributed.from_env(cfg.repro.dist_timeout_s)
    try:
        if not ranks.main:
            return _run(cfg, ranks)
        with run_dir.held(cfg.output_dir):
            return _run(cfg, ranks)
    finally:
        distributed.close(ranks)


def _run(cfg: run_flags.RunConfig, ranks: distributed.Ranks = distributed.SINGLE) -> dict[str, Any]:
    if cfg.profile_steps is not None and cfg.profile_steps[1] > cfg.num_steps:
        a, b = cfg.profile_steps
        raise UserError(f"--profile_steps={a}:{b} goes past the run's last RL step (--num_steps={cfg.num_steps})")
    try:
        modes.check(cfg)
        distributed.check(cfg, ranks)
    except ValueError as e:
        raise UserError(str(e)) from e
    if cfg.rollout.save_rollouts:
        try:
            os.makedirs(cfg.rollout.save_rollouts, exist_ok=True)
        except OSError as e:
            raise UserError(f"--save_rollouts={cfg.rollout.save_rollouts} cannot be created ({e.strerror}); choose "
                            f"another directory") from e
    setup_torch(cfg)
    job = build(cfg, ranks)
    try:
        return _run_job(job)
    except Exception as e:
        if ranks.world > 1 and distributed.is_collective_failure(e):
            raise distributed.failure(e, ranks, job.where, cfg.repro.dist_timeout_s) from e
        raise
    finally:
        job.engine.close()  # the servers (and router) the run started stop with it, also on an error


def _run_job(job: Job) -> dict[str, Any]:
    cfg, ranks = job.cfg, job.ranks
    if cfg.repro.resume:
        job.where = "--resume"
        restore(job)
    report_state_bytes(job)
    cur = job.cursor
    try:
        guard = steps.StepGuard.from_config(cfg, run_flags.flag_values_dict(), ranks.mesh,
                                            distributed.is_collective_failure if ranks.world > 1 else lambda e: False)
    except ValueError as e:  # an objective the flags cannot build (--custom_loss, packing limits)
        raise UserError(str(e)) from e
    resume_step = cur.rl_step if cfg.repro.resume else None
    writer = (MetricsWriter(cfg.output_dir, cfg.tensorboard, resume_step=resume_step) if ranks.main
              else NoWriter())  # torchrun: rank 0 writes the run's files
    summary = cur.summary
    if "eval_success_init" not in summary:
        summary["eval_success_init"] = evaluate(job)
    if cfg.sft:
        return run_sft(job, writer, summary)
    t0 = time.time()
    if not cur.sft_done:
        if cfg.sft_warmup_steps:
            sft_warmup(job, guard)
        cur.sft_done = True
        # without a warm-up the weights are the initial ones: their (greedy, fixed-key) evaluation is already known
        cur.last_eval = summary["eval_success_step0"] = (evaluate(job) if cfg.sft_warmup_steps
                                                         else summary["eval_success_init"])
        # under --lora_rank: the adapters; under torchrun gathered (the reference log-probs are rank 0's rollout's)
        job.ref_params = distributed.full(job.state.params) if cfg.loss.kl_coef > 0 else None
        job.state = rl.attach_critic(cfg, job.state)  # PPO: a value model from the warmed-up trunk
        spec_launch.attach(job)  # --speculative_algorithm: the draft joins the state and the engine
        if cfg.save_every and cfg.sft_warmup_steps:
            save_checkpoint(job)
    last_eval = cur.last_eval
    bar = _progress(cfg, cur.rl_step) if ranks.main else None
    profiler = profiling.StepProfiler(cfg.profile_steps, cfg.output_dir)
    t_rl = time.time()
    rollout_only, ahead = cfg.modes.debug_rollout_only, None
    executor = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead") if cfg.modes.async_rollout else None
    if job.ahead_rollout is not None:  # resumed: the checkpoint carried the rollout generated ahead
        ahead = (futures.Future(), profiling.PhaseTimer())
        ahead[0].set_result(job.ahead_rollout)
    for step in range(cur.rl_step, cfg.num_steps):
        profiler.begin(step + 1)
        job.where = f"RL step {step + 1}"
        distributed.exit_at(cfg.repro.debug_exit_rank, ranks, step + 1)
        key = prng.fold_in(job.state.key, step)
        if ahead is not None:  # --async_rollout: generated during the previous step's update
            (buf, stats), timer, ahead, job.ahead_rollout = ahead[0].result(), ahead[1], None, None
            stats = dict(stats)
        else:
            timer = profiling.PhaseTimer()
            with launch_memory.offloaded(job, cfg.memory.offload_train_state):
                buf, stats = broadcast_rollout(job, key, timer, step + 1)
        sample_stats = {k: stats.pop(k) for k in SAMPLE_STATS if k in stats}
        if cfg.modes.async_rollout or cfg.modes.partial_rollouts:
            stats.update(staleness(int(job.state.step), sample_stats["sample_version_first"]))
        if rollout_only:  # --debug_rollout_only: no update, no weight sync, no checkpoint
            metrics = to_floats(stats)
        else:
            if executor is not None:
                # Step k+1's rollout, from the weights before step k's update (the engine's until the sync
                # below, which waits for it): the step's samples are set by version, never by timing. The
                # last step generates one too: the checkpoint carries it, so a longer resumed run is exact.
                nxt = profiling.PhaseTimer()
                ahead = (executor.submit(rollout, dataclasses.replace(job), prng.fold_in(job.state.key, step + 1),
                                         job.ref_params, nxt, step + 2), nxt)
            if cfg.repro.debug_nan_at_step == step + 1:
                buf = debug.plant_nan(buf)
            debug.block_at(cfg.repro.debug_block_at, "rl_step", step + 1)
            with timer("train"):
                job.state, metrics = guard("rl", step + 1, job.state, buf, prng.fold_in(key, K_TRAIN))
            if ahead is not None:
                job.ahead_rollout = ahead[0].result()
            with timer("weight_sync"):
                job.engine.update_weights(int(job.state.step), model_params(job))
                spec_launch.sync(job)
            metrics = to_floats({**stats, **metrics})
        metrics.update(spec_launch.take_metrics(job))  # the step's rollout: acceptance, tokens/s
        cur.rl_step = step + 1
        profiler.end(step + 1)
        metrics.update(timer.metrics())
        evaluating = (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or step + 1 == cfg.num_steps
        if evaluating and not cfg.modes.debug_train_only:
            metrics["eval_success"] = last_eval = cur.last_eval = evaluate(job)
            if cfg.rollout.eval_pass_k and ranks.main:
                metrics.update(eval_pass_at_k(job))
            spec_launch.take_metrics(job)  # the evaluation's decoding is no rollout: its counts are dropped
        writer.write(step + 1, metrics)
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and not rollout_only:
            save_checkpoint(job)
        if bar is not None:
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", eval=f"{last_eval:.3f}")
            bar.update(1)
    if executor is not None:
        executor.shutdown()
    if bar is not None:
        bar.close()
    writer.close()
    if not rollout_only:
        save_checkpoint(job)
    summary = {**{k: summary[k] for k in ("eval_success_init", "sft_final_loss") if k in summary},
               "sft_seconds": t_rl - t0, "eval_success_step0": summary["eval_success_step0"]}
    if ranks.main:
        plot_curves(writer.path, os.path.join(cfg.output_dir, "reward_curve.png"))
    summary.update(eval_success_final=last_eval, rl_seconds=time.time() - t_rl,
                   state_hash=tree_hash(distributed.full_state(job.state)))
    if ranks.world > 1:
        summary.update(world_size=ranks.world, state_mib_per_rank=distributed.state_bytes(job.state) / 2**20)
    return summary


class NoWriter:
    """Ranks other than 0 under torchrun: their metrics are rank 0's (all-reduced), written once."""

    def write(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


def report_state_bytes(job: Job) -> None:
    """Under torchrun, each rank says on stderr what it holds of the params and AdamW moments."""
    if job.ranks.world == 1:
        return
    mine = distributed.state_bytes(job.state)
    whole = sum(x.numel() * x.element_size() for x in tree_leaves((job.state.params, job.state.opt_state)))
    sys.stderr.write(f"rank {job.ranks.rank} of {job.ranks.world}: params + optimizer state {mine / 2**20:.2f} MiB "
                     f"on this rank, {whole / 2**20:.2f} MiB in all ({mine / whole:.2f} of it)\n")


def staleness(trainer_version: int, sample_versions: torch.Tensor) -> dict[str, float]:
    """How many updates behind the trainer each sample's (oldest) weights are, over the batch."""
    lag = (trainer_version - sample_versions).double()
    return {"staleness_mean": float(lag.mean()), "staleness_max": float(lag.max())}


def run_sft(job: Job, writer: MetricsWriter, summary: dict[str, Any]) -> dict[str, Any]:
    """--sft: --num_steps supervised steps on --sft_data (no rollouts), evaluated like an RL run."""
    cfg = job.cfg
    if not cfg.sft_data:
        raise UserError("--sft needs --sft_data=FILE.jsonl (rows of {\"prompt\": ..., \"response\": ...})")
    try:
        examples = sft_data.load_jsonl(cfg.sft_data, job.task.tokenizer)
    except ValueError as e:
        raise UserError(str(e)) from e
    loss_fn, stream, t0 = train.make_sft_loss(cfg.model), prng.fold_in(job.state.key, SFT_STREAM), time.time()
    for s in range(cfg.num_steps):
        k = prng.fold_in(stream, s)
        job.state, m = train.train_step(job.state, sft_data.batch(examples, k, cfg.sft_batch_size), k,
                                        lora.loss_for(loss_fn, job.state, cfg.lora), cfg.sft_optim)
        job.engine.update_weights(int(job.state.step), model_params(job))
        metrics = to_floats(m)
        if (cfg.eval_every and (s + 1) % cfg.eval_every == 0) or s + 1 == cfg.num_steps:
            metrics["eval_success"] = evaluate(job)
        writer.write(s + 1, metrics)
        summary["sft_final_loss"] = metrics["loss"]
    writer.close()
    save_checkpoint(job)
    summary.update(eval_success_final=evaluate(job), sft_seconds=time.time() - t0, sft_rows=len(examples),
                   state_hash=tree_hash(job.state))
    return summary


def _progress(cfg: run_flags.RunConfig, initial: int = 0):
    if not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.num_steps, initial=initial, desc="rl", unit="step", dynamic_ncols=True)


def config_from_flags() -> run_flags.RunConfig:
    """The RunConfig of the parsed flags (the task fixes vocabulary, stop token and answer length)."""
    f = flags.FLAGS
    hf_dir = resolve_hf_checkpoint(f.hf_checkpoint, f.model_cache_dir)
    task = (chat_task(hf_dir, f.task_digits, f.task_second_digits, f.task_ops) if f.task == "chat_arith"
            else AdditionTask(digits=f.task_digits))
    vocab, stop = task.tokenizer.vocab_size, (task.tokenizer.eos_id,)
    tok_dir = tokenizer_dir(f.tokenizer, hf_dir, f.prompt_data)
    if tok_dir:  # --prompt_data through a Hugging Face tokenizer: its ids fit the model, its EOS stops generation
        tok = data.load_tokenizer(tok_dir)
        vocab, stop = max(vocab, tok.vocab_size), (tok.eos_id,)
    cfg = run_flags.configs_from_flags(vocab, stop, task.max_answer_tokens, tok_dir)
    return dataclasses.replace(cfg, hf_checkpoint=hf_dir)


def tokenizer_dir(tokenizer: str, hf_checkpoint: str, prompt_data: str) -> str:
    """The Hugging Face tokenizer of --prompt_data: --tokenizer, else --hf_checkpoint's when it has one."""
    if tokenizer:
        return tokenizer
    return hf_checkpoint if prompt_data and data.has_tokenizer(hf_checkpoint) else ""


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected positional arguments: {argv[1:]}")
    try:
        summary = run(config_from_flags())
    except (UserError, run_dir.RunDirError, MetricsFileError, launch_memory.MemoryPlanError, EngineError,
            PluginError, DataError, RolloutFileError, resume.ResumeError, steps.StepFailed,
            distributed.DistributedError) as e:
        sys.exit(f"error: {e}")
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: rank 0 prints the run's summary
        return
    print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
    if {"--helpshort", "--help", "-?"} & set(sys.argv[1:]):  # absl's would list only this module's own flags
        print(run_flags.short_help())
        sys.exit(0)
    app.run(main)
