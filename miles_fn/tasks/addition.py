"""Multi-digit addition: a verifiable task a tiny model learns on CPU.

Prompt "<bos>17+25=", answer "42<eos>". With fixed_width, operands and sum are
zero-padded to a fixed number of digits ("<bos>07+25=" -> "032<eos>"), so every digit
sits at the same position in every prompt. With reverse_answer the sum's digits
least-significant first, "24<eos>" (so each digit depends only on the digits at
its place and one carry, as the ones-first order that people use on paper; it is
what lets a tiny model learn the task in minutes). The reward is exact: 1 when the
decoded response equals the answer, else 0. The pairs (a, b) are split into train and
held-out sets by a fixed hash of the pair, so evaluation prompts are never trained on.
"""

from __future__ import annotations

import dataclasses

from miles_fn import prng
from miles_fn.tokenizer import CharTokenizer


@dataclasses.dataclass(frozen=True)
class AdditionTask:
    digits: int = 2
    reverse_answer: bool = False
    fixed_width: bool = False
    heldout_fraction: float = 0.1
    tokenizer: CharTokenizer = CharTokenizer()

    @property
    def max_operand(self) -> int:
        return 10**self.digits

    @property
    def max_answer_tokens(self) -> int:
        return self.digits + 2  # digits of the sum, plus EOS

    def is_heldout(self, a: int, b: int) -> bool:
        # Knuth multiplicative hash of the pair: fixed, independent of the seed.
        h = ((a * self.max_operand + b) * 2654435761) % (1 << 32)
        return h < self.heldout_fraction * (1 << 32)

    def prompt_ids(self, a: int, b: int) -> list[int]:
        w = self.digits if self.fixed_width else 0
        return [self.tokenizer.bos_id] + self.tokenizer.encode(f"{a:0{w}d}+{b:0{w}d}=")

    def answer_text(self, a: int, b: int) -> str:
        s = f"{a + b:0{self.digits + 1 if self.fixed_width else 0}d}"
        return s[::-1] if self.reverse_answer else s

    def answer_ids(self, a: int, b: int) -> list[int]:
        return self.tokenizer.encode(self.answer_text(a, b)) + [self.tokenizer.eos_id]

    def sample_pairs(self, key: prng.Key, n: int, heldout: bool = False) -> list[tuple[int, int]]:
        """n pairs from the chosen split, by rejection from uniform draws (deterministic in key)."""
        out: list[tuple[int, int]] = []
        attempt = 0
        while len(out) < n:
            draws = prng.randint(prng.fold_in(key, attempt), (4 * n + 16, 2), 0, self.max_operand).tolist()
            out.extend((a, b) for a, b in draws if self.is_heldout(a, b) == heldout)
            attempt += 1
        return [tuple(p) for p in out[:n]]

    def heldout_pairs(self, n: int) -> list[tuple[int, int]]:
        """The first n held-out pairs in a fixed order: the evaluation set."""
        return self.sample_pairs(prng.key(0xE7A1), n, heldout=True)

    def reward(self, response_ids: list[int], pair: tuple[int, int]) -> float:
        text = self.tokenizer.decode(response_ids)
        ended = self.tokenizer.eos_id in response_ids
        return 1.0 if ended and text == self.answer_text(*pair) else 0.0

    def sft_example(self, pair: tuple[int, int]) -> tuple[list[int], list[int]]:
        return self.prompt_ids(*pair), self.answer_ids(*pair)

