"""A character tokenizer for the built-in tasks: one id per character, plus specials."""

from __future__ import annotations

import dataclasses

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
    alphabet: str = "0123456789+-*=,:?abcdefghijklmnopqrstuvwxyz "

    @property
    def specials(self) -> tuple[str, ...]:
        return (PAD, BOS, EOS)

    @property
    def vocab(self) -> tuple[str, ...]:
        return self.specials + tuple(self.alphabet)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    def encode(self, text: str) -> list[int]:
        off = len(self.specials)
        index = {c: i + off for i, c in enumerate(self.alphabet)}
        try:
            return [index[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} in {text!r} is not in the tokenizer's alphabet") from None

    def decode(self, ids: list[int]) -> str:
        """Text of the ids, stopping at the first EOS; other specials are dropped."""
        off = len(self.specials)
        out = []
        for i in ids:
            if i == self.eos_id:
                break
            if i >= off:
                out.append(self.alphabet[i - off])
        return "".join(out)
