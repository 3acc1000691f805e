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
from typing import Any

import torch
from absl import app, flags

from launch import flags as run_flags
from launch import memory as launch_memory
from launch import profiling
from launch.engines import Engine, EngineError, make_engine
from launch.engines.base import generate_batch
from launch.evaluation import sampled_pass_at_k
from launch.metrics import MetricsWriter, plot_curves, to_floats
from launch.plugins import PluginError
from launch.rollout import DataError, collect
from launch.rollout_io import RolloutFileError, load_rollout, save_rollout
from miles_fn import model, prng, train
from miles_fn.batching import pack_right_padded
from miles_fn.rollout_buffer import build_rollout_buffer
from miles_fn.sampling import SamplingConfig
from miles_fn.tasks.addition import AdditionTask
from state import checkpoint, hf
from state.train_state import RolloutBuffer, TrainState
from state.tree import tree_hash

# Sub-keys of a step's key, by purpose. Fixed forever: changing one changes every run.
K_DATA, K_ROLLOUT, K_TRAIN = 0, 1, 2
INIT_STREAM, SFT_STREAM, EVAL_STREAM = 0x1417, 1 << 31, 0xE7A1


class UserError(Exception):
    """A bad input (file, checkpoint, flag combination): reported as one line, no traceback."""


@dataclasses.dataclass
class Job:
    cfg: run_flags.RunConfig
    task: AdditionTask
    state: TrainState
    engine: Engine
    eval_pairs: list[tuple[int, int]]


def setup_torch(cfg: run_flags.RunConfig) -> None:
    torch.set_num_threads(cfg.num_threads)
    torch.use_deterministic_algorithms(cfg.deterministic)


def build(cfg: run_flags.RunConfig) -> Job:
    task = AdditionTask(digits=cfg.task_digits, reverse_answer=cfg.task_reverse_answer,
                        fixed_width=cfg.task_fixed_width)
    root = prng.key(cfg.seed)
    if cfg.hf_checkpoint:
        try:
            mcfg, params = hf.load_hf(cfg.hf_checkpoint)
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"--hf_checkpoint={cfg.hf_checkpoint}: {e}") from e
        if mcfg.vocab_size < task.tokenizer.vocab_size:
            raise UserError(f"--hf_checkpoint={cfg.hf_checkpoint}: vocab {mcfg.vocab_size} is smaller than the "
                            f"task tokenizer's {task.tokenizer.vocab_size}")
        cfg = dataclasses.replace(cfg, model=mcfg)
    else:
        params = model.init_params(cfg.model, prng.fold_in(root, INIT_STREAM), cfg.init_std)
    state = train.init_state(params, root)
    engine = make_engine(cfg.rollout, cfg.model, state.params, cfg.output_dir, cfg.num_threads)
    return Job(cfg, task, state, engine, task.heldout_pairs(cfg.eval_size))


def evaluate(job: Job) -> float:
    """Exact-answer success rate of greedy decoding on the held-out prompts."""
    task = job.task
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=job.cfg.sampling.max_new_tokens,
                            stop_token_ids=(task.tokenizer.eos_id,))
    gen = generate_batch(job.engine, [task.prompt_ids(*p) for p in job.eval_pairs], prng.key(EVAL_STREAM), greedy)
    return sum(task.reward(r, p) for r, p in zip(gen.tokens, job.eval_pairs, strict=True)) / len(job.eval_pairs)


def sft_batch(task: AdditionTask, key: prng.Key, n: int) -> RolloutBuffer:
    prompts, answers = zip(*(task.sft_example(p) for p in task.sample_pairs(key, n)))
    tokens, positions, seg, mask = pack_right_padded(list(prompts), list(answers))
    zeros = torch.zeros_like(mask)
    return RolloutBuffer(tokens, positions, seg, mask, zeros, zeros, torch.zeros(n), torch.zeros(n, dtype=torch.int64))


def sft_warmup(job: Job) -> float:
    """Supervised steps on task answers. The optimizer state carries into RL: restarting Adam
    would make RL's first update a sign step of size lr on every weight."""
    cfg, loss_fn, loss = job.cfg, train.make_sft_loss(job.cfg.model), float("nan")
    stream = prng.fold_in(job.state.key, SFT_STREAM)
    for s in range(cfg.sft_warmup_steps):
        k = prng.fold_in(stream, s)
        job.state, m = train.train_step(job.state, sft_batch(job.task, k, cfg.sft_batch_size), k, loss_fn,
                                        cfg.sft_optim)
        loss = float(m["loss"])
    job.engine.update_weights(int(job.state.step), job.state.params)
    return loss


def rollout(
    job: Job, key: prng.Key, ref_params: Any, timer: profiling.PhaseTimer | None = None
) -> tuple[RolloutBuffer, dict[str, torch.Tensor]]:
    cfg, g = job.cfg, job.cfg.group_size
    timer = timer or profiling.PhaseTimer()
    rl_step = int(job.state.step) - cfg.sft_warmup_steps + 1
    if cfg.rollout.load_rollouts:
        return load_rollout(cfg.rollout.load_rollouts, rl_step)
    with timer("rollout"):  # generation; collect also scores the responses
        col = collect(job.engine, job.task, cfg.rollout, cfg.sampling, prng.fold_in(key, K_DATA),
                      prng.fold_in(key, K_ROLLOUT), job.state.key, rl_step - 1,
                      cfg.prompts_per_step, g)
    with timer("reward"):
        prompts, gen, rewards = col.prompts, col.batch, col.rewards
        buf = build_rollout_buffer(prompts, gen.tokens, gen.logprobs, rewards, [i // g for i in range(len(prompts))],
                                   cfg.normalize_advantage_std, col.loss_masks)
    if ref_params is not None:
        with torch.no_grad(), timer("logprob_recompute"):
            ref = model.sequence_logprobs(ref_params, cfg.model, buf.tokens, buf.positions, buf.segment_ids,
                                          cfg.loss.temperature)
        buf = buf._replace(ref_logprobs=ref)
    n = len(gen.tokens)
    stats = {
        "reward_mean": buf.rewards.mean(),
        "response_len": torch.tensor(sum(len(t) for t in gen.tokens) / n),
        "truncated_frac": torch.tensor(sum(f == "length" for f in gen.finish_reasons) / n),
        "weight_version": torch.tensor(float(min(gen.weight_versions))),
        "reward_errors": torch.tensor(float(col.reward_errors)),
        "informative_groups_frac": torch.tensor(col.informative_groups / cfg.prompts_per_step),
    }
    if cfg.rollout.save_rollouts:
        save_rollout(cfg.rollout.save_rollouts, rl_step, buf, stats)
    return buf, stats


def save_checkpoint(job: Job) -> None:
    step = int(job.state.step)
    path = checkpoint.step_dir(os.path.join(job.cfg.output_dir, "checkpoints"), step)
    checkpoint.save(path, job.state, {"step": step, "flags": run_flags.flag_values_dict()})


def run(cfg: run_flags.RunConfig) -> dict[str, Any]:
    if cfg.profile_steps is not None and cfg.profile_steps[1] > cfg.num_steps:
        a, b = cfg.profile_steps
        raise UserError(f"--profile_steps={a}:{b} goes past the run's last RL step (--num_steps={cfg.num_steps})")
    setup_torch(cfg)
    job = build(cfg)
    cfg = job.cfg
    writer = MetricsWriter(cfg.output_dir, cfg.tensorboard)
    summary: dict[str, Any] = {"eval_success_init": evaluate(job)}
    t0 = time.time()
    if cfg.sft_warmup_steps:
        summary["sft_final_loss"] = sft_warmup(job)
    summary["sft_seconds"] = time.time() - t0
    summary["eval_success_step0"] = last_eval = evaluate(job)
    ref_params = job.state.params if cfg.loss.kl_coef > 0 else None
    loss_fn = train.make_grpo_loss(launch_memory.training_model_config(cfg.memory, cfg.model), cfg.loss)
    bar = _progress(cfg)
    profiler = profiling.StepProfiler(cfg.profile_steps, cfg.output_dir)
    t_rl = time.time()
    for step in range(cfg.num_steps):
        timer = profiling.PhaseTimer()
        profiler.begin(step + 1)
        key = prng.fold_in(job.state.key, step)
        with launch_memory.offloaded(job, cfg.memory.offload_train_state):
            buf, stats = rollout(job, key, ref_params, timer)
        with timer("train"):
            job.state, metrics = launch_memory.train_update(cfg.memory, cfg.model, job.state, buf,
                                                            prng.fold_in(key, K_TRAIN), loss_fn, cfg.optim)
        with timer("weight_sync"):
            job.engine.update_weights(int(job.state.step), job.state.params)
        profiler.end(step + 1)
        metrics = to_floats({**stats, **metrics})
        metrics.update(timer.metrics())
        if (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or step + 1 == cfg.num_steps:
            metrics["eval_success"] = last_eval = evaluate(job)
            if cfg.rollout.eval_pass_k:
                metrics.update(sampled_pass_at_k(job.engine, [job.task.prompt_ids(*p) for p in job.eval_pairs],
                                                 job.eval_pairs, job.task.reward, cfg.sampling,
                                                 cfg.rollout.eval_pass_k, (1, cfg.rollout.eval_pass_k)))
        writer.write(step + 1, metrics)
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            save_checkpoint(job)
        if bar is not None:
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", eval=f"{last_eval:.3f}")
            bar.update(1)
    if bar is not None:
        bar.close()
    writer.close()
    save_checkpoint(job)
    plot_curves(writer.path, os.path.join(cfg.output_dir, "reward_curve.png"))
    summary.update(eval_success_final=last_eval, rl_seconds=time.time() - t_rl, state_hash=tree_hash(job.state))
    return summary


def _progress(cfg: run_flags.RunConfig):
    if not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.num_steps, desc="rl", unit="step", dynamic_ncols=True)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected positional arguments: {argv[1:]}")
    task = AdditionTask(digits=flags.FLAGS.task_digits)
    cfg = run_flags.configs_from_flags(task.tokenizer.vocab_size, (task.tokenizer.eos_id,), task.max_answer_tokens)
    try:
        summary = run(cfg)
    except (UserError, launch_memory.MemoryPlanError, EngineError, PluginError, DataError, RolloutFileError) as e:
        sys.exit(f"error: {e}")
    print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
    app.run(main)
