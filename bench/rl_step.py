"""The RL step: miles-fn against TRL's GRPOTrainer on the same model, task and settings.

Both start from the same weights: a tiny Qwen2 (the default job's shape) after a short supervised
warm-up with miles-fn, so that rewards are neither all 0 nor all 1. Then each trains for the same
wall time on two-digit addition (reward 1 for the exact answer), with the same group size, prompts
per step, completion cap, sampling (temperature 1), loss (PPO-clip 0.2, token-mean, no KL),
advantages (group mean/std), optimizer (AdamW, constant lr, clip 1.0), float32, and threads.
Reported: seconds per step, samples/s, the mean reward of the last steps inside the time budget,
and the held-out greedy success of both final models, scored by the same evaluator. miles-fn runs
twice, as the job runs by default (the rows whose advantage is 0, most of a sparse-reward batch,
are left out of the train step: the same update, see rollout_buffer.gradient_rows) and with every
row trained as TRL does, so that what the cut buys and what the rest of the step buys both show.

TRL runs in a subprocess of an interpreter that has trl: this one when trl imports here, else
--trl_python (or $MILES_BENCH_TRL_PYTHON); without one the TRL column is skipped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from bench import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAST = 5  # steps averaged for "reward reached"


def trl_python(flag: str) -> str | None:
    if flag:
        return flag
    if os.environ.get("MILES_BENCH_TRL_PYTHON"):
        return os.environ["MILES_BENCH_TRL_PYTHON"]
    return sys.executable if importlib.util.find_spec("trl") is not None else None


def miles_job(start: str, out_dir: str, args: Any, skip_zero_advantage_rows: bool = True):
    """A launch.main Job from the default job's flagfile, starting at `start`."""
    from absl import flags

    from launch import flags as run_flags
    from launch import main as launch_main
    from miles_fn.tasks.addition import AdditionTask

    overrides = [f"--{k}={getattr(args, k)}" for k in ("prompts_per_step", "group_size", "lr")
                 if getattr(args, k) is not None]
    flags.FLAGS.unparse_flags()  # from the defaults: another job parsed in this process leaves its flags set
    flags.FLAGS([
        "rl_step", f"--flagfile={os.path.join(ROOT, 'launch/flags/cpu_tiny.flags')}", f"--hf_checkpoint={start}",
        f"--num_threads={args.threads}", "--sft_warmup_steps=0", f"--eval_size={args.eval_size}", "--noprogress",
        "--notensorboard", f"--output_dir={out_dir}", "--kl_coef=0",
        f"--skip_zero_advantage_rows={str(skip_zero_advantage_rows).lower()}", *overrides,
    ])
    task = AdditionTask(digits=flags.FLAGS.task_digits)
    cfg = run_flags.configs_from_flags(task.tokenizer.vocab_size, (task.tokenizer.eos_id,), task.max_answer_tokens)
    launch_main.setup_torch(cfg)
    return launch_main.build(cfg)


def sft_start(init: str, start: str, args: Any) -> float:
    """Supervised warm-up with miles-fn from `init`; writes `start` and returns its held-out success."""
    import dataclasses

    from launch import flags as run_flags
    from launch import main as launch_main
    from launch import steps
    from state import hf

    job = miles_job(init, os.path.join(start, "_run"), args)
    job.cfg = dataclasses.replace(job.cfg, sft_warmup_steps=args.sft_steps)
    launch_main.sft_warmup(job, steps.StepGuard.from_config(job.cfg, run_flags.flag_values_dict()))
    hf.save_hf(start, job.cfg.model, job.state.params)
    return launch_main.evaluate(job)


def shared_settings(job: Any) -> dict[str, Any]:
    """What TRL is given so that it does the same work as the miles-fn job."""
    cfg, task = job.cfg, job.task
    if cfg.loss.eps_clip_high is not None or cfg.loss.loss_agg != "token_mean" or cfg.sampling.temperature != 1.0:
        raise ValueError("bench.rl_step compares PPO-clip, token-mean, temperature-1 jobs only")
    return {"prompts_per_step": cfg.prompts_per_step, "group_size": cfg.group_size, "lr": cfg.optim.lr,
            "eps_clip": cfg.loss.eps_clip, "max_grad_norm": cfg.optim.max_grad_norm,
            "max_new_tokens": cfg.sampling.max_new_tokens, "task_digits": task.digits,
            "fixed_width": int(task.fixed_width), "reverse_answer": int(task.reverse_answer)}


def train_for(job: Any, seconds: float, max_steps: int) -> list[dict[str, float]]:
    """The job's own loop body for `seconds` of wall time (at least one step): launch.main.rollout, the job's
    update (launch.steps), the weight sync of the model the state stands for (merged under --lora_rank)."""
    import time

    from launch import main as launch_main
    from launch import steps as launch_steps
    from miles_fn import prng

    update = launch_steps.make_step_fn(job.cfg, "rl")
    steps: list[dict[str, float]] = []
    t0 = last = time.perf_counter()
    step = 0
    while (step == 0 or last - t0 < seconds) and step < max_steps:
        key = prng.fold_in(job.state.key, step)
        buf, stats = launch_main.rollout(job, key, None)
        t_rollout = time.perf_counter() - last
        job.state, metrics = update(job.state, buf, prng.fold_in(key, launch_main.K_TRAIN))
        job.engine.update_weights(int(job.state.step), launch_main.model_params(job))
        now = time.perf_counter()
        step += 1
        steps.append({"step": step, "seconds": now - last, "elapsed": now - t0, "rollout_seconds": t_rollout,
                      "reward_mean": float(stats["reward_mean"]),
                      "train_rows_frac": float(metrics.get("train_rows_frac", torch.tensor(1.0)))})
        last = now
    return steps


def run_miles(start: str, out_dir: str, args: Any, skip_zero_advantage_rows: bool = True
              ) -> tuple[list[dict[str, float]], float, dict[str, Any]]:
    job = miles_job(start, out_dir, args, skip_zero_advantage_rows)
    from launch import main as launch_main

    steps = train_for(job, args.seconds, args.max_steps)
    return steps, launch_main.evaluate(job), shared_settings(job)


def trl_process(python: str, tmp: str, argv: Sequence[str]) -> tuple[dict[str, Any], str]:
    """Run bench.trl_grpo under `python` with `argv`; returns its JSON and the directory of its saved model."""
    out, model_dir, log = (os.path.join(tmp, n) for n in ("trl.json", "trl_model", "trl.log"))
    cmd = [python, "-m", "bench.trl_grpo", f"--save_model={model_dir}", f"--out={out}", *argv]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "w") as f:
        p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        with open(log) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"the TRL side failed ({' '.join(cmd)}), exit {p.returncode}:\n{tail}")
    with open(out) as f:
        return json.load(f), model_dir


def run_trl(python: str, start: str, tmp: str, args: Any, settings: dict[str, Any]
            ) -> tuple[list[dict[str, float]], float, str]:
    from launch import main as launch_main
    from state import hf

    result, model_dir = trl_process(python, tmp, [
        f"--model={start}", f"--seconds={args.seconds}", f"--max_steps={args.max_steps}", f"--threads={args.threads}",
        *(f"--{k}={v}" for k, v in settings.items())])
    job = miles_job(start, os.path.join(tmp, "trl_eval"), args)
    _, params = hf.load_hf(model_dir)
    job.engine.update_weights(0, params)
    return result["steps"], launch_main.evaluate(job), result["trl"]


HEADER = ["trainer", "s/step (median)", "samples/s", "steps in budget", f"reward (last {LAST} steps)",
          "held-out success at end"]


def table_row(label: str, c: dict[str, Any]) -> list[Any]:
    """One contender's row under HEADER."""
    return [label, c["seconds_per_step"], c["samples_per_s"], c["steps"], c["reward_at_budget"], c["eval_success"]]


def ratio_row(label: str, ours: dict[str, Any], theirs: dict[str, Any]) -> list[Any]:
    """Per-step and samples/s ratios of two contenders under HEADER."""
    return [label, f"{theirs['seconds_per_step'] / ours['seconds_per_step']:.2f}x",
            f"{ours['samples_per_s'] / theirs['samples_per_s']:.2f}x", "", "", ""]


def summarise(steps: list[dict[str, float]], samples_per_step: int, seconds: float) -> dict[str, Any]:
    per_step = common.median([s["seconds"] for s in steps])
    inside = [s for s in steps if s["elapsed"] <= seconds] or steps[:1]
    rewards = [s["reward_mean"] for s in inside if "reward_mean" in s][-LAST:]
    out = {"steps": len(steps), "seconds_per_step": per_step, "samples_per_s": samples_per_step / per_step,
           "reward_at_budget": sum(rewards) / max(len(rewards), 1), "per_step": steps}
    if steps and "train_rows_frac" in steps[0]:
        out["train_rows_frac_mean"] = sum(s["train_rows_frac"] for s in steps) / len(steps)
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = common.parse_args("rl_step", __doc__.splitlines()[0], argv, lambda p: (
        p.add_argument("--seconds", type=float, default=60.0, help="training wall time of each contender"),
        p.add_argument("--max_steps", type=int, default=100000),
        p.add_argument("--sft_steps", type=int, default=300, help="supervised warm-up that makes the start"),
        p.add_argument("--prompts_per_step", type=int, default=None, help="default: the default job's"),
        p.add_argument("--group_size", type=int, default=None, help="default: the default job's"),
        p.add_argument("--lr", type=float, default=None, help="default: the default job's"),
        p.add_argument("--eval_size", type=int, default=256),
        p.add_argument("--trl_python", default="", help="an interpreter with trl installed"),
        p.add_argument("--no_trl", action="store_true", help="measure miles-fn only"),
    ))
    if args.quick:
        args.seconds, args.max_steps, args.sft_steps, args.prompts_per_step, args.group_size, args.eval_size = (
            0.0, 2, 2, 2, 2, 8)
    torch.set_num_threads(args.threads)
    from miles_fn.tasks.addition import AdditionTask

    task = AdditionTask()
    python = None if args.no_trl else trl_python(args.trl_python)
    with tempfile.TemporaryDirectory() as tmp:
        init = common.save_tiny_qwen2(os.path.join(tmp, "init"), task.tokenizer.vocab_size, max_positions=64)
        start = os.path.join(tmp, "start")
        start_success = sft_start(init, start, args)
        contenders = {}
        for name, skip in (("miles_fn", True), ("miles_fn_all_rows", False)):
            load = os.getloadavg()[0]
            steps_, eval_, settings = run_miles(start, os.path.join(tmp, name), args, skip)
            n = settings["prompts_per_step"] * settings["group_size"]
            contenders[name] = {**summarise(steps_, n, args.seconds), "eval_success": eval_,
                                "load_avg_1min_before_after": [load, os.getloadavg()[0]]}
        ours, dense = contenders["miles_fn"], contenders["miles_fn_all_rows"]
        theirs, trl_version = None, None
        if python is not None:
            load = os.getloadavg()[0]
            trl_steps, trl_eval, trl_version = run_trl(python, start, tmp, args, settings)
            theirs = {**summarise(trl_steps, n, args.seconds), "eval_success": trl_eval,
                      "load_avg_1min_before_after": [load, os.getloadavg()[0]]}
    names = {"miles_fn": f"miles-fn (default; trained {ours['train_rows_frac_mean']:.0%} of rows, the rest have "
                         f"advantage 0)",
             "miles_fn_all_rows": "miles-fn, every row trained (--noskip_zero_advantage_rows)"}
    rows = [table_row(names[k], c) for k, c in contenders.items()]
    ratio = dense_ratio = None
    if theirs is not None:
        ratio = theirs["seconds_per_step"] / ours["seconds_per_step"]
        dense_ratio = theirs["seconds_per_step"] / dense["seconds_per_step"]
        rows += [table_row(f"TRL {trl_version} GRPOTrainer", theirs),
                 ratio_row("ratio (miles-fn default / TRL)", ours, theirs),
                 ratio_row("ratio (miles-fn every row / TRL)", dense, theirs)]
    table = common.print_table(
        f"RL step: GRPO on {settings['task_digits']}-digit addition, {settings['prompts_per_step']} prompts x "
        f"{settings['group_size']} samples, lr {settings['lr']:g}, "
        f"{args.seconds:.0f} s each from the same start (held-out success {start_success:.3f}), "
        f"{args.threads} thread(s)",
        HEADER, rows)
    out = {"benchmark": "rl_step", "machine": common.machine_info(args.threads), "quick": args.quick,
           "args": {k: v for k, v in vars(args).items() if k not in ("out",)}, "settings": settings,
           "start_eval_success": start_success,
           "miles_fn": ours, "miles_fn_all_rows": dense, "trl": theirs, "trl_version": trl_version,
           "step_ratio": ratio, "step_ratio_all_rows": dense_ratio,
           "trl_skipped": theirs is None, "table": table}
    common.write_json(args.out, out)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
