"""The TRL side of the RL-step benchmarks: GRPOTrainer on the addition task (bench.rl_step) or on chat
arithmetic through the model's chat template (bench.real_rl_step) for a fixed wall time, optionally with
peft's LoRA.

Run by those benchmarks with an interpreter that has trl (the `bench` extra), as
    python -m bench.trl_grpo --model DIR --seconds S --out FILE.json ...
It needs torch, transformers, trl, datasets (peft for --lora_rank) and this repository's miles_fn and
launch.data (for the task, its tokenizer face and its reward), so it also runs from a separate virtual
environment.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from miles_fn import prng
from miles_fn.tasks.addition import AdditionTask
from miles_fn.tokenizer import BOS, EOS, PAD


def char_tokenizer(task: AdditionTask):
    """A PreTrainedTokenizerFast with the CharTokenizer's ids: one token per character, specials whole."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(task.tokenizer.vocab)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   padding_side="left")
    probe = task.prompt_ids(7, 25)
    got = fast(text=[prompt_text(task, 7, 25)])["input_ids"][0]
    if got != probe:
        raise RuntimeError(f"the character tokenizer for TRL disagrees with CharTokenizer: {got} != {probe}")
    return fast


def prompt_text(task: AdditionTask, a: int, b: int) -> str:
    """The task's prompt as text: <bos> and the characters after it."""
    ids = task.prompt_ids(a, b)
    if ids[0] != task.tokenizer.bos_id or task.tokenizer.bos_id in ids[1:]:
        raise ValueError(f"expected one leading <bos> in the task's prompt, got {ids}")
    return BOS + task.tokenizer.decode(ids[1:])


def addition_data(args: argparse.Namespace) -> tuple[Any, Callable[..., list[float]], Any]:
    """Prompts as text in the character tokenizer; the reward is the task's on the completion ids."""
    import datasets

    task = AdditionTask(digits=args.task_digits, fixed_width=bool(args.fixed_width),
                        reverse_answer=bool(args.reverse_answer))
    pairs = task.sample_pairs(prng.key(args.seed), 20000)
    data = datasets.Dataset.from_dict({"prompt": [prompt_text(task, a, b) for a, b in pairs],
                                       "a": [a for a, _ in pairs], "b": [b for _, b in pairs]})

    def exact_answer(completion_ids: list[list[int]], a: list[int], b: list[int], **_: Any) -> list[float]:
        return [task.reward(ids, (x, y)) for ids, x, y in zip(completion_ids, a, b, strict=True)]

    return data, exact_answer, char_tokenizer(task)


def chat_arith_data(args: argparse.Namespace) -> tuple[Any, Callable[..., list[float]], Any]:
    """Conversational prompts (TRL applies the model's chat template, as ChatArithTask.prompt_ids does);
    the training split of the questions; the reward is ChatArithTask's on the completion ids (EOS kept)."""
    import datasets
    from transformers import AutoTokenizer

    from launch import data as launch_data
    from miles_fn.tasks.chat_arith import ChatArithTask

    task = ChatArithTask(launch_data.load_tokenizer(args.model), args.task_digits, args.task_second_digits,
                         args.task_ops)
    questions = task.sample_pairs(prng.key(args.seed), 20000)
    data = datasets.Dataset.from_dict({
        "prompt": [[{"role": "user", "content": task.question(*q)}] for q in questions],
        "a": [q[0] for q in questions], "b": [q[1] for q in questions], "op": [q[2] for q in questions]})

    def exact_answer(completion_ids: list[list[int]], a: list[int], b: list[int], op: list[str], **_: Any
                     ) -> list[float]:
        return [task.reward(ids, q) for ids, *q in zip(completion_ids, a, b, op, strict=True)]

    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    tokenizer.padding_side = "left"
    return data, exact_answer, tokenizer


def lora_config(args: argparse.Namespace) -> Any:
    """peft's LoRA with miles-fn's --lora_* meaning (no dropout, no bias, the same targets), or None."""
    if not args.lora_rank:
        return None
    import peft

    return peft.LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0, bias="none",
                           target_modules=args.lora_targets.split(","), task_type="CAUSAL_LM")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.trl_grpo", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory to start from")
    p.add_argument("--seconds", type=float, required=True, help="train for this wall time (then finish the step)")
    p.add_argument("--max_steps", type=int, default=100000)
    p.add_argument("--prompts_per_step", type=int, default=32)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--eps_clip", type=float, default=0.2)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--task_digits", type=int, default=2)
    p.add_argument("--fixed_width", type=int, default=0)
    p.add_argument("--reverse_answer", type=int, default=0)
    p.add_argument("--task", default="addition", choices=["addition", "chat_arith"])
    p.add_argument("--task_second_digits", type=int, default=1, help="chat_arith only")
    p.add_argument("--task_ops", default="+", help="chat_arith only")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lora_rank", type=int, default=0, help="0: full fine-tune; else peft LoRA of this rank")
    p.add_argument("--lora_alpha", type=float, default=16.0)
    p.add_argument("--lora_targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save_model", default="", help="write the trained model here")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import datasets
    import transformers
    import trl

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    data, reward_fn, tokenizer = (chat_arith_data(args) if args.task == "chat_arith" else addition_data(args))
    steps: list[dict[str, float]] = []

    class Clock(transformers.TrainerCallback):
        """Per-step wall time and reward; stops training once the wall-time budget is spent."""

        def on_train_begin(self, *a: Any, **k: Any) -> None:
            self.t0 = self.last = time.perf_counter()

        def on_step_end(self, _args: Any, state: Any, control: Any, **k: Any) -> None:
            now = time.perf_counter()
            steps.append({"step": state.global_step, "seconds": now - self.last, "elapsed": now - self.t0})
            self.last = now
            if now - self.t0 >= args.seconds:
                control.should_training_stop = True

        def on_log(self, _args: Any, state: Any, control: Any, logs: dict | None = None, **k: Any) -> None:
            if logs and "reward" in logs and steps and steps[-1]["step"] == state.global_step:
                steps[-1]["reward_mean"] = float(logs["reward"])

    with tempfile.TemporaryDirectory() as tmp:
        cfg = trl.GRPOConfig(
            output_dir=tmp, use_cpu=True, bf16=False, fp16=False, use_vllm=False, report_to="none",
            num_generations=args.group_size, per_device_train_batch_size=args.prompts_per_step * args.group_size,
            gradient_accumulation_steps=1, num_iterations=1, max_completion_length=args.max_new_tokens,
            temperature=args.temperature, top_p=1.0, top_k=0, learning_rate=args.lr, lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=args.max_grad_norm,
            beta=0.0, epsilon=args.eps_clip, loss_type="dapo", scale_rewards="group", max_steps=args.max_steps,
            logging_steps=1, save_strategy="no", disable_tqdm=True, seed=args.seed, dataloader_num_workers=0,
            gradient_checkpointing=False,  # TRL turns it on by default; it only costs time at this size
        )
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_fn, args=cfg, train_dataset=data,
                                  processing_class=tokenizer, callbacks=[Clock()], peft_config=lora_config(args))
        trainer.train()
        if args.save_model:  # merged under LoRA, so the same evaluator loads it as a plain checkpoint
            trained = trainer.model.merge_and_unload() if args.lora_rank else trainer.model
            trained.save_pretrained(args.save_model)
    out = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
           "steps": steps}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
