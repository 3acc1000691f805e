"""The OpenAI-compatible API SGLang servers also speak, as pure translations to and from /generate.

    POST /v1/completions       {"prompt": str | [int] | [str] | [[int]], "max_tokens", "temperature", "top_p",
                                "n", "seed", "stop", "logprobs": 0, ...}
    POST /v1/chat/completions  {"messages": [{"role", "content"}], "max_tokens" | "max_completion_tokens",
                                "logprobs": bool, "top_logprobs": 0, ...}
    GET  /v1/models

A request becomes one /generate body (every prompt x n choices as one batch, ids in, ids out); the
reply becomes OpenAI's schema (choices, finish_reason, usage; logprobs in the completions format
{tokens, token_logprobs, top_logprobs, text_offset} or the chat format {content: [{token, logprob,
bytes, top_logprobs}]}). Each choice also carries SGLang's extension fields `prompt_token_ids` and
`token_ids` (always, and `return_token_ids: true` is accepted as SGLang clients send it), plus a
`meta_info` with the weight version and the server that served it, so a trainer can train on the exact
ids the engine sampled (token in, token out).

Determinism: `seed` is the request key exactly as /generate's `sampling_seed` is (a 64-bit integer,
default 0; a negative seed s is the key s + 2**64, as sglang-router only passes signed 64-bit seeds), so
/v1/completions with seed s gives the tokens and log-probs of /generate with sampling_seed
s. Choice k > 0 of a call (prompt i, choice j: k = i * n + j) uses request_seed(prng.key(seed), k).

SGLang extension fields accepted: top_k, stop_token_ids, ignore_eos, no_stop_trim, skip_special_tokens,
return_token_ids, rid. Fields OpenAI defines that this server cannot honour (frequency_penalty != 0,
logit_bias, best_of > 1, echo, suffix, stream, top alternatives in logprobs) are refused with a 400 that
names them, as is any field neither API defines: a silently ignored field would change what is sampled.

Stop strings: generation runs to a stop token or max_tokens; the tokens are then cut after the first one
whose decoded prefix holds a stop string (finish_reason "stop", matched_stop the string, the text cut
before it). The kept tokens and log-probs are a prefix of what the engine sampled, so they stay exact.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from launch.engines.sglang_api import show, strict_bool, strict_float, strict_int, token_ids

MODEL_ID = "miles-fn"
ROLES = ("system", "user", "assistant", "tool", "developer")

# Fields a body may carry that change nothing here, each with the values that mean "off".
NEUTRAL = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "best_of": (None, 1), "echo": (False,),
           "suffix": (None, ""), "stream": (False,), "logit_bias": (None, {}), "stream_options": (None,),
           "repetition_penalty": (1, 1.0), "min_tokens": (0,), "parallel_tool_calls": (None,), "tools": (None, []),
           "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
           "return_hidden_states": (False,), "continue_final_message": (False,)}  # the last two: sglang-router's
BOOLS = ("skip_special_tokens", "no_stop_trim", "return_token_ids", "separate_reasoning", "stream_reasoning")
IGNORED = ("model", "user", "rid", *BOOLS)  # type-checked only (no reasoning parser here: *_reasoning change nothing)
COMMON = ("max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "stop_token_ids", "ignore_eos",
          "logprobs", *IGNORED, *NEUTRAL)
COMPLETION_FIELDS = frozenset(("prompt", "input_ids", *COMMON))
CHAT_FIELDS = frozenset(("messages", "max_completion_tokens", "top_logprobs", *COMMON))


class Codec:
    """Text <-> ids for the API (a Hugging Face tokenizer, the built-in character one, or none: ids only)."""

    def __init__(self, encode: Callable[[str], list[int]] | None = None,
                 decode: Callable[[list[int]], str] | None = None, token_str: Callable[[int], str] | None = None,
                 chat: Callable[[list[dict]], list[int]] | None = None, eos_id: int | None = None, name: str = ""):
        self.encode, self.decode, self.chat, self.eos_id, self.name = encode, decode, chat, eos_id, name
        self._token_str = token_str

    def text(self, ids: Sequence[int]) -> str:
        return self.decode(list(ids)) if self.decode else ""

    def token(self, i: int) -> str:
        """One token as text; without a tokenizer, vLLM's "token_id:N" spelling."""
        return self._token_str(i) if self._token_str else f"token_id:{i}"


NO_TOKENIZER = Codec()


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a parsed request asks for, beyond the /generate body: how to shape the reply."""

    kind: str  # "completion" or "chat"
    prompts: tuple[tuple[int, ...], ...]
    n: int
    logprobs: bool
    stop: tuple[str, ...]
    model: str


def _field(body: dict[str, Any], name: str, default: Any) -> Any:
    v = body.get(name)
    return default if v is None else v


def _stop_strings(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise ValueError(f"stop: a non-empty string or a list of up to 4 of them is required, got {show(v)}")
    return tuple(stops)


def _check_fields(body: dict[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ValueError(f"{unknown[0]}: not a field this server's {where} understands (fields: "
                         f"{', '.join(sorted(allowed))})")
    for name, offs in NEUTRAL.items():
        if name in body and not any(body[name] == o and type(body[name]) is type(o) or body[name] is o
                                    for o in offs):
            raise ValueError(f"{name}: {show(body[name])} is not supported here (only {show(list(offs))})")
    for name in ("model", "user", "rid"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise ValueError(f"{name}: a string is required, got {show(body[name])}")
    for name in BOOLS:
        if body.get(name) is not None:
            strict_bool(body[name], name)


def _sampling(body: dict[str, Any], codec: Codec, vocab_size: int, max_tokens_field: str, default_max: int
              ) -> tuple[dict[str, Any], int, int]:
    """(one request's /generate sampling_params without its seed, n, seed)."""
    t = strict_float(_field(body, "temperature", 1.0), "temperature")
    if not 0.0 <= t <= 2.0:
        raise ValueError(f"temperature: must be in [0, 2] (0 = greedy), got {show(t)}")
    top_p = strict_float(_field(body, "top_p", 1.0), "top_p")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p: must be in (0, 1], got {show(top_p)}")
    top_k = strict_int(_field(body, "top_k", -1), "top_k", -1)
    n = strict_int(_field(body, "n", 1), "n", 1, 129)
    seed = strict_int(_field(body, "seed", 0), "seed", -(2**63), 2**64) % 2**64  # signed: its 64 bits (seed_bits)
    max_new = strict_int(_field(body, max_tokens_field, default_max), max_tokens_field, 1)
    stop_ids = token_ids(_field(body, "stop_token_ids", []), "stop_token_ids", vocab_size, allow_empty=True)
    ignore_eos = strict_bool(_field(body, "ignore_eos", False), "ignore_eos")
    if codec.eos_id is not None and not ignore_eos and codec.eos_id not in stop_ids:
        stop_ids = [*stop_ids, codec.eos_id]
    return {"temperature": t, "top_p": top_p, "top_k": top_k, "max_new_tokens": max_new,
            "stop_token_ids": stop_ids}, n, seed


def signed_seed(seed: int) -> int:
    """A 64-bit key as the signed integer with the same bits: sglang-router parses `seed` as an i64 and answers
    422 past 2**63 - 1, while the server reads a negative seed s as s + 2**64 (the same key)."""
    return seed - 2**64 if seed >= 2**63 else seed


def choice_seeds(seed: int, count: int) -> list[int]:
    """Seeds of a call's choices: `seed` itself first (so it equals /generate's sampling_seed), then fold-ins."""
    from launch.engines.base import request_seeds
    from miles_fn import prng

    return [seed, *request_seeds(prng.key(seed), list(range(1, count)))] if count > 1 else [seed]


def _generate_body(prompts: list[list[int]], sp: dict[str, Any], n: int, seed: int, max_positions: int,
                   max_tokens_field: str, body: dict[str, Any]) -> dict[str, Any]:
    for i, p in enumerate(prompts):
        if len(p) + sp["max_new_tokens"] > max_positions:
            raise ValueError(f"{max_tokens_field}: prompt {i} has {len(p)} tokens, and {len(p)} + "
                             f"{sp['max_new_tokens']} is over the model's {max_positions} positions; lower "
                             f"{max_tokens_field} or shorten the prompt")
    rows = [p for p in prompts for _ in range(n)]
    gen: dict[str, Any] = {"input_ids": rows,
                           "sampling_params": [{**sp, "sampling_seed": s} for s in choice_seeds(seed, len(rows))],
                           "return_logprob": True}
    if body.get("rid"):
        gen["rid"] = body["rid"]
    return gen


def completion_request(body: dict[str, Any], codec: Codec, vocab_size: int, max_positions: int
                       ) -> tuple[dict[str, Any], Plan]:
    """(/generate body, Plan) of a /v1/completions body; ValueError naming the bad field."""
    _check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    prompt, pf = body.get("prompt"), "prompt"
    if body.get("input_ids") is not None:  # the extension that passes sglang-router (it refuses id prompts)
        if prompt not in (None, ""):
            raise ValueError(f"input_ids: give the prompt as input_ids or as prompt, not both (prompt must be \"\" "
                             f"with input_ids, got {show(prompt)})")
        prompt, pf = body["input_ids"], "input_ids"
        if not isinstance(prompt, list) or not prompt:
            raise ValueError(f"input_ids: a non-empty list of token ids (or of lists of them) is required, got "
                             f"{show(prompt)}")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)):
        texts = [prompt] if isinstance(prompt, str) else prompt
        if codec.encode is None:
            raise ValueError("prompt: this server has no tokenizer, so prompts must be token ids (a list of ints, "
                             "or a list of such lists); start it with --tokenizer-path to send text")
        prompts = [codec.encode(t) for t in texts]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt[{i}]: the text encodes to no tokens")
            token_ids(p, f"prompt[{i}] (encoded)", vocab_size)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [token_ids(p, f"{pf}[{i}]", vocab_size) for i, p in enumerate(prompt)]
    elif isinstance(prompt, list) and prompt:
        prompts = [token_ids(prompt, pf, vocab_size)]
    else:
        raise ValueError(f"prompt: a string, a list of token ids, or a non-empty list of either is required, "
                         f"got {show(prompt)}")
    sp, n, seed = _sampling(body, codec, vocab_size, "max_tokens", 16)
    lp = body.get("logprobs")
    if lp is not None:
        strict_int(lp, "logprobs", 0)
        if lp > 0:
            raise ValueError(f"logprobs: {lp} asks for the top {lp} alternatives, which this server does not "
                             "compute; send logprobs=0 (the sampled token's log-prob, in token_logprobs)")
    gen = _generate_body(prompts, sp, n, seed, max_positions, "max_tokens", body)
    return gen, Plan("completion", tuple(tuple(p) for p in prompts), n, lp is not None,
                     _stop_strings(body.get("stop")), str(body.get("model") or MODEL_ID))


def _content(m: dict[str, Any], i: int) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in c):
        return "".join(p["text"] for p in c)
    if c is None and m.get("role") == "assistant":
        return ""
    raise ValueError(f"messages[{i}].content: a string or a list of {{'type': 'text', 'text': str}} parts is "
                     f"required, got {show(c)}")


def chat_request(body: dict[str, Any], codec: Codec, vocab_size: int, max_positions: int
                 ) -> tuple[dict[str, Any], Plan]:
    """(/generate body, Plan) of a /v1/chat/completions body: the messages through the chat template."""
    _check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"messages: a non-empty list of {{'role', 'content'}} objects is required, got {show(msgs)}")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role: one of {', '.join(ROLES)} is required, got "
                             f"{show(m.get('role') if isinstance(m, dict) else m)}")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise ValueError(f"messages[{i}].{extra[0]}: not supported here (role, content and name only)")
        clean.append({"role": m["role"], "content": _content(m, i)})
    if codec.chat is None:
        raise ValueError("messages: this server's tokenizer has no chat template (or it has no tokenizer); start it "
                         "with --tokenizer-path DIR of a tokenizer with one, or send ids to /v1/completions")
    try:
        prompt = codec.chat(clean)
    except Exception as e:  # the template is the checkpoint's jinja code
        raise ValueError(f"messages: the chat template refused them ({type(e).__name__}: {e})") from None
    token_ids(prompt, "messages (through the chat template)", vocab_size)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise ValueError("max_completion_tokens: give it or max_tokens, not both")
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    sp, n, seed = _sampling(body, codec, vocab_size, field, max(max_positions - len(prompt), 1))
    lp = strict_bool(_field(body, "logprobs", False), "logprobs")
    top = strict_int(_field(body, "top_logprobs", 0), "top_logprobs", 0, 21)
    if top and not lp:
        raise ValueError("top_logprobs: needs logprobs=true")
    if top:
        raise ValueError(f"top_logprobs: {top} alternatives are not computed by this server; send top_logprobs=0 "
                         "(each token's own log-prob is in logprobs.content[].logprob)")
    gen = _generate_body([prompt], sp, n, seed, max_positions, field, body)
    return gen, Plan("chat", (tuple(prompt),), n, lp, _stop_strings(body.get("stop")),
                     str(body.get("model") or MODEL_ID))


def cut_at_stop(ids: Sequence[int], codec: Codec, stops: Sequence[str]) -> tuple[int, str | None, str]:
    """(tokens to keep, the stop string matched or None, the text): the shortest prefix whose text holds a stop."""
    if stops and codec.decode is not None:
        for k in range(1, len(ids) + 1):
            text = codec.text(ids[:k])
            hits = [(text.find(s), s) for s in stops if s in text]
            if hits:
                at, s = min(hits)
                return k, s, text[:at]
    return len(ids), None, codec.text(ids)


def _finish(item: dict[str, Any]) -> tuple[str, Any]:
    f = item["meta_info"]["finish_reason"]
    kind = f.get("type") if isinstance(f, dict) else "length"
    return ("stop" if kind == "stop" else "abort" if kind == "abort" else "length"), (
        f.get("matched") if isinstance(f, dict) else None)


def _choice(plan: Plan, k: int, item: dict[str, Any], codec: Codec) -> tuple[dict[str, Any], int]:
    pairs = item["meta_info"]["output_token_logprobs"]
    ids, lps = [int(p[1]) for p in pairs], [float(p[0]) for p in pairs]
    keep, matched_str, text = cut_at_stop(ids, codec, plan.stop)
    ids, lps = ids[:keep], lps[:keep]
    reason, matched = ("stop", matched_str) if matched_str is not None else _finish(item)
    meta = {key: item["meta_info"][key] for key in ("weight_version", "served_by") if key in item["meta_info"]}
    toks = [codec.token(i) for i in ids]
    out: dict[str, Any] = {"index": k, "finish_reason": reason, "matched_stop": matched,
                           "prompt_token_ids": list(plan.prompts[k // plan.n]), "token_ids": ids, "meta_info": meta}
    if plan.kind == "completion":
        out["text"] = text
        offsets, at = [], 0
        for t in toks:
            offsets.append(at)
            at += len(t)
        out["logprobs"] = {"tokens": toks, "token_logprobs": lps, "top_logprobs": [None] * len(ids),
                           "text_offset": offsets} if plan.logprobs else None
    else:
        out["message"] = {"role": "assistant", "content": text}
        out["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                       for t, lp in zip(toks, lps, strict=True)]} if plan.logprobs else None
    return out, len(ids)


def response(plan: Plan, reply: list[dict[str, Any]], codec: Codec, request_id: str, created: int | None = None
             ) -> dict[str, Any]:
    """The OpenAI-shaped reply for the /generate reply of the request `plan` describes."""
    choices, completion = [], 0
    for k, item in enumerate(reply):
        c, n = _choice(plan, k, item, codec)
        choices.append(c)
        completion += n
    prompt = sum(len(p) for p in plan.prompts)
    return {"id": request_id, "object": "text_completion" if plan.kind == "completion" else "chat.completion",
            "created": int(time.time()) if created is None else created, "model": plan.model, "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


def models(max_positions: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "miles-fn",
                                        "root": MODEL_ID, "max_model_len": max_positions}]}


def error(message: str, code: int = 400) -> dict[str, Any]:
    """OpenAI's error body (the openai client raises BadRequestError with this message); `param` names the field."""
    param = message.split(":", 1)[0] if ":" in message else None
    return {"object": "error", "error": {"message": message, "type": "invalid_request_error",
                                         "param": param, "code": code}, "message": message}


def load_codec(path: str) -> Codec:
    """The codec of --tokenizer-path: "" (none: ids only), "char" (miles_fn's character tokenizer) or a
    Hugging Face tokenizer directory. I/O: called once, at server start."""
    if not path:
        return NO_TOKENIZER
    if path == "char":
        from miles_fn.tokenizer import CharTokenizer

        ct = CharTokenizer()
        return Codec(lambda s: [ct.bos_id, *ct.encode(s)], ct.decode,
                     lambda i: ct.vocab[i] if 0 <= i < ct.vocab_size else f"token_id:{i}", None, ct.eos_id, "char")
    from launch import data

    tok = data.load_tokenizer(path)

    def chat(messages: list[dict]) -> list[int]:
        return data.encode_prompt(messages, tok)

    return Codec(tok.encode, lambda ids: tok.tok.decode(ids, skip_special_tokens=True),
                 lambda i: tok.tok.decode([i]), chat if tok.chat_template else None, tok.eos_id, path)
