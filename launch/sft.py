"""`--sft`: supervised fine-tuning on a prompt/response JSONL file, no rollouts.

One JSON object per line: {"prompt": "17+25=", "response": "42"}. The prompt is encoded
after BOS, the response before EOS; the loss is token-mean cross-entropy on the response.
Step s trains on rows drawn uniformly with replacement by fold_in(SFT stream, s).
"""

from __future__ import annotations

import json

import torch

from miles_fn import prng
from miles_fn.batching import pack_right_padded
from miles_fn.tasks.addition import AdditionTask
from miles_fn.tokenizer import CharTokenizer
from state.train_state import RolloutBuffer

Example = tuple[list[int], list[int]]


def load_jsonl(path: str, tokenizer: CharTokenizer) -> list[Example]:
    """(prompt ids, response ids) per row; ValueError names the file and row of a bad line."""
    out: list[Example] = []
    try:
        f = open(path)
    except OSError as e:
        raise ValueError(f"--sft_data={path}: {e.strerror}") from e
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt, response = row["prompt"], row["response"]
                if not isinstance(prompt, str) or not isinstance(response, str):
                    raise TypeError("prompt and response must be strings")
                out.append(([tokenizer.bos_id] + tokenizer.encode(prompt),
                            tokenizer.encode(response) + [tokenizer.eos_id]))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"--sft_data={path} row {n}: {type(e).__name__}: {e} "
                                 '(want {"prompt": str, "response": str})') from e
    if not out:
        raise ValueError(f"--sft_data={path}: no rows")
    return out


def batch(examples: list[Example], key: prng.Key, n: int) -> RolloutBuffer:
    """n rows drawn with replacement (deterministic in key), packed right-padded with the response as loss mask."""
    idx = prng.randint(key, (n,), 0, len(examples)).tolist()
    prompts, responses = zip(*(examples[i] for i in idx), strict=True)
    tokens, positions, seg, mask = pack_right_padded(list(prompts), list(responses))
    zeros = torch.zeros_like(mask)
    return RolloutBuffer(tokens, positions, seg, mask, zeros, zeros, torch.zeros(n), torch.zeros(n, dtype=torch.int64))


def write_addition_jsonl(path: str, n: int, task: AdditionTask, seed: int = 0) -> None:
    """A prompt/response file of n training-split problems of `task`, in its own format (never held-out ones)."""
    with open(path, "w") as f:
        for a, b in task.sample_pairs(prng.key(seed), n):
            prompt = task.tokenizer.decode(task.prompt_ids(a, b)[1:])  # the text after BOS
            f.write(json.dumps({"prompt": prompt, "response": task.answer_text(a, b)}) + "\n")

