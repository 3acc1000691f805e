"""Prompt datasets: JSONL rows {input_key: prompt, label_key: label}, in a seeded order per epoch.

The prompt is a string or a list of chat messages ({"role", "content"}). With a tokenizer that
has a chat template, a string becomes one user message and the template (with the generation
prompt) makes the ids; otherwise the ids are BOS + the encoded text. Epoch e visits the rows in
the order prng.permutation(fold_in(key, e), n), so sample i of the run is row
perm_{i // n}[i % n] whatever process computes it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from miles_fn import prng


class DataError(Exception):
    """A bad dataset file or row: the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class PromptRow:
    prompt: Any  # str, or a list of {"role", "content"} messages
    label: Any
    line: int  # 1-based line in the file, for messages


def jsonl_lines(path: str, flag: str) -> list[tuple[int, str]]:
    """(1-based line number, text) of each non-blank line of a UTF-8 file (a leading BOM is dropped).

    Bytes that are not UTF-8 are a DataError naming the file, the line and the byte, not a traceback.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"{flag}={path}: {e.strerror or e}") from None
    out = []
    for n, line in enumerate(raw.split(b"\n"), start=1):
        try:
            text = line.decode("utf-8-sig" if n == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{n}: not valid UTF-8 (byte 0x{line[e.start]:02x} at byte {e.start + 1} of the "
                            f"line); {flag} files must be UTF-8 text") from None
        if text.strip():
            out.append((n, text))
    return out


def json_type(v: Any) -> str:
    """The JSON name of a parsed value's type, for messages about a row."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if v is None else names.get(type(v), type(v).__name__)


def load_jsonl(path: str, input_key: str = "input", label_key: str = "label",
               flag: str = "--prompt_data") -> tuple[PromptRow, ...]:
    """The rows of a prompt file; DataError names the file and line of the first bad one (`flag` names the file)."""
    rows = []
    for n, line in jsonl_lines(path, flag):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{n}: a row must be a JSON object, got {json_type(row)}")
        if input_key not in row:
            raise DataError(f"{path}:{n}: no {input_key!r} field (--input_key); fields: {sorted(row)}")
        if why := prompt_problem(row[input_key]):
            raise DataError(f"{path}:{n}: {input_key!r} must be a non-empty string or a list of "
                            f"{{'role', 'content'}} messages: {why}")
        if label_key and label_key not in row:
            raise DataError(f"{path}:{n}: no {label_key!r} field (--label_key); fields: {sorted(row)}")
        rows.append(PromptRow(row[input_key], row.get(label_key) if label_key else None, n))
    if not rows:
        raise DataError(f"{flag}={path}: no rows")
    return tuple(rows)


@functools.lru_cache(maxsize=8)
def cached_jsonl(path: str, input_key: str, label_key: str, flag: str = "--prompt_data") -> tuple[PromptRow, ...]:
    return load_jsonl(path, input_key, label_key, flag)


def prompt_problem(p: Any) -> str:
    """What is wrong with a row's prompt ('' when it is a non-empty string or a well-formed message list)."""
    if isinstance(p, str):
        return "" if p else "got an empty string"
    if not isinstance(p, list):
        return f"got {json_type(p)}"
    if not p:
        return "got an empty list"
    for i, m in enumerate(p):
        if not isinstance(m, dict):
            return f"message {i} is {json_type(m)}, not an object"
        for field in ("role", "content"):
            if not isinstance(m.get(field), str):
                got = "missing" if field not in m else json_type(m[field])
                return f"message {i} needs a string {field!r} (got {got})"
    return ""


def epoch_order(key: prng.Key, epoch: int, n: int) -> list[int]:
    return prng.permutation(prng.fold_in(key, epoch), n).tolist()


def rows_at(rows: tuple[PromptRow, ...], key: prng.Key, start: int, count: int) -> list[PromptRow]:
    """Samples start .. start+count-1 of the run's stream over the dataset (epochs chained)."""
    n, out, cache = len(rows), [], {}
    for i in range(start, start + count):
        epoch = i // n
        if epoch not in cache:
            cache[epoch] = epoch_order(key, epoch, n)
        out.append(rows[cache[epoch][i % n]])
    return out


def encode_prompt(prompt: Any, tokenizer: Any) -> list[int]:
    """Prompt ids: the tokenizer's chat template when it has one, else BOS + encoded text."""
    template = getattr(tokenizer, "chat_template", None)
    if template and hasattr(tokenizer, "apply_chat_template"):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # the template is the checkpoint's code (jinja2 raises its own TemplateError)
            raise DataError(f"the tokenizer's chat template refused the prompt ({type(e).__name__}: {e})") from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    if not isinstance(prompt, str):
        raise DataError("chat-message prompts need a tokenizer with a chat template")
    if hasattr(tokenizer, "bos_id"):  # the built-in character tokenizer
        return [tokenizer.bos_id] + tokenizer.encode(prompt)
    return list(tokenizer.encode(prompt))  # a Hugging Face tokenizer adds its own special tokens


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(directory: str) -> bool:
    """Whether a checkpoint directory holds a Hugging Face tokenizer (so --prompt_data can use it)."""
    import os

    return bool(directory) and any(os.path.isfile(os.path.join(directory, f)) for f in TOKENIZER_FILES)


class HFTokenizer:
    """A Hugging Face tokenizer with the face of the built-in one that rollouts use: `eos_id`,
    `encode`, `decode` (up to the first EOS, special tokens dropped), plus its chat template."""

    def __init__(self, tok: Any):
        if tok.eos_token_id is None:
            raise DataError("the tokenizer has no eos_token: generation would have no stop token")
        self.tok = tok
        self.eos_id = int(tok.eos_token_id)
        self.vocab_size = len(tok)
        self.chat_template = getattr(tok, "chat_template", None)

    def apply_chat_template(self, messages: Any, **kw: Any) -> Any:
        return self.tok.apply_chat_template(messages, **kw)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def decode(self, ids: list[int]) -> str:
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.tok.decode(ids, skip_special_tokens=True)


@functools.lru_cache(maxsize=4)
def load_tokenizer(directory: str) -> HFTokenizer:
    """The tokenizer saved in `directory` (local files only: nothing is downloaded)."""
    from transformers import AutoTokenizer

    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(directory, local_files_only=True))
    except (OSError, ValueError) as e:
        raise DataError(f"--tokenizer={directory}: cannot load a Hugging Face tokenizer ({e})") from None


@dataclasses.dataclass(frozen=True)
class DatasetTask:
    """What rollouts need of a task when prompts come from --prompt_data with a Hugging Face
    tokenizer: the tokenizer (prompts, labels and rewards come from the dataset rows)."""

    tokenizer: Any
