"""Arithmetic questions in a chat: a verifiable task for a real instruction-tuned model.

The question "What is 47+8? Answer with the number only." is posed as one user message through
the tokenizer's chat template (with the generation prompt), so the model answers in the format it
was tuned on. The reward is exact and defined on the decoded reply: 1 when the reply ended (the
tokenizer's EOS came within the token budget) and the last integer in it (`-?[0-9]+`, thousands
commas removed) equals the answer, else 0. "47 + 8 = 55" and "The answer is 55." score 1;
"55 is not ... 56" and a reply cut off before its end score 0 (a cut reply's last number may be
half written). Questions (a, b, op) are split into train and held-out sets by a fixed hash of the
question, so the evaluation questions are never trained on.
"""

from __future__ import annotations

import dataclasses
import re
from types import MappingProxyType
from typing import Any

from miles_fn import prng

OPS = MappingProxyType({"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b})
QUESTION = "What is {a}{op}{b}? Answer with the number only."
_INT = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    """The last integer written in text (thousands commas such as 1,234 read as one number)."""
    found = _INT.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", text))
    return int(found[-1]) if found else None


@dataclasses.dataclass(frozen=True)
class ChatArithTask:
    """First operand of `digits` digits, second of `second_digits` (0 = digits), operator from `ops`."""

    tokenizer: Any  # a Hugging Face tokenizer with a chat template (launch.data.HFTokenizer's face)
    digits: int = 2
    second_digits: int = 1
    ops: str = "+"
    heldout_fraction: float = 0.1

    def __post_init__(self) -> None:
        if not self.ops or set(self.ops) - set(OPS):
            raise ValueError(f"ops {self.ops!r}: each must be one of {''.join(OPS)}")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the chat arithmetic task needs a tokenizer with a chat template")

    @property
    def max_operand(self) -> int:
        return 10**self.digits

    @property
    def max_second(self) -> int:
        return 10 ** (self.second_digits or self.digits)

    @property
    def max_answer_tokens(self) -> int:
        return 24  # room for a short sentence around the number, then EOS

    def answer(self, a: int, b: int, op: str = "+") -> int:
        return OPS[op](a, b)

    def question(self, a: int, b: int, op: str = "+") -> str:
        return QUESTION.format(a=a, b=b, op=op)

    def is_heldout(self, a: int, b: int, op: str = "+") -> bool:
        # Knuth multiplicative hash of the question: fixed, independent of the seed.
        code = (a * self.max_second + b) * len(OPS) + list(OPS).index(op)
        return (code * 2654435761) % (1 << 32) < self.heldout_fraction * (1 << 32)

    def prompt_ids(self, a: int, b: int, op: str = "+") -> list[int]:
        messages = [{"role": "user", "content": self.question(a, b, op)}]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def longest_prompt_ids(self) -> list[int]:
        return self.prompt_ids(self.max_operand - 1, self.max_second - 1, self.ops[0])

    def sample_pairs(self, key: prng.Key, n: int, heldout: bool = False) -> list[tuple[int, int, str]]:
        """n questions (a, b, op) from the chosen split, by rejection from uniform draws (deterministic in key)."""
        out: list[tuple[int, int, str]] = []
        attempt = 0
        while len(out) < n:
            k = prng.fold_in(key, attempt)
            a = prng.randint(prng.fold_in(k, 0), (4 * n + 16,), 0, self.max_operand).tolist()
            b = prng.randint(prng.fold_in(k, 1), (4 * n + 16,), 0, self.max_second).tolist()
            o = prng.randint(prng.fold_in(k, 2), (4 * n + 16,), 0, len(self.ops)).tolist()
            qs = [(x, y, self.ops[i]) for x, y, i in zip(a, b, o, strict=True)]
            out.extend(q for q in qs if self.is_heldout(*q) == heldout)
            attempt += 1
        return out[:n]

    def heldout_pairs(self, n: int) -> list[tuple[int, int, str]]:
        """The first n held-out questions in a fixed order: the evaluation set."""
        return self.sample_pairs(prng.key(0xE7A1), n, heldout=True)

    def reward(self, response_ids: list[int], question: tuple[int, int, str]) -> float:
        if self.tokenizer.eos_id not in response_ids:
            return 0.0
        return 1.0 if last_integer(self.tokenizer.decode(list(response_ids))) == self.answer(*question) else 0.0

    def sft_example(self, question: tuple[int, int, str]) -> tuple[list[int], list[int]]:
        """A supervised example: the prompt, then the bare answer and EOS."""
        return self.prompt_ids(*question), self.tokenizer.encode(str(self.answer(*question))) + [self.tokenizer.eos_id]
