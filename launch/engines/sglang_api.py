"""The subset of SGLang's native HTTP API that the rollout path uses, as plain functions over JSON.

Both sides use these shapes: the client (to drive real SGLang or launch.rollout_server) and the
rollout server (to answer like SGLang). Shapes follow SGLang's GenerateReqInput / io_struct:

  POST /generate {"input_ids": [[int]], "sampling_params": [{...}], "return_logprob": true}
    -> [{"output_ids": [int], "meta_info": {"finish_reason": {"type": "stop", "matched": id} |
         {"type": "length", "length": n}, "output_token_logprobs": [[logprob, token_id, null], ...],
         "prompt_tokens": n, "completion_tokens": n, "weight_version": "7"}}]
    (with "return_routed_experts": true, a MoE model's meta_info also holds "routed_experts": the base64
    of int32 expert ids [prompt + completion - 1, num_hidden_layers, top_k], C order, -1 in a dense layer:
    SGLang's --enable-return-routed-experts format, which Miles decodes with np.frombuffer)
    (a speculating server adds "spec_verify_ct": n, "spec_accept_histogram": [verifies that accepted
    exactly j drafts, j = 0..k] and "draft_weight_version": "7")
  POST /update_weights_from_tensor {"serialized_named_tensors": [str], "load_format": str,
       "flush_cache": bool, "weight_version": str} -> {"success": bool, "message": str}
    ("draft_only": true: the tensors are the speculative draft's; "disable_draft_model": true: the target's only)
  POST /update_weights_from_disk {"model_path": str, "weight_version": str} -> {"success", "message"}
  POST /init_weights_update_group {"master_address", "master_port", "rank_offset", "world_size",
       "group_name", "backend"}; POST /update_weights_from_distributed {"names", "dtypes", "shapes",
       "group_name", "flush_cache", "weight_version"} (dtypes spelled "float32", "bfloat16"; the tensors
       then arrive by broadcast from rank 0, in that order); POST /destroy_weights_update_group
       {"group_name"} (launch/engines/weight_group.py)
  POST /flush_cache, GET /health, GET /health_generate, GET /get_model_info,
  POST /pause_generation {"mode": "abort"|"retract"|"in_place"}, POST /continue_generation
  POST /abort_request {"rid": str, "abort_all": bool} (a /generate body may carry "rid": str or [str]);
    an aborted request finishes with {"type": "abort"} and the tokens it had produced

Tensor payloads: SGLang's own serializer is pickle (torch multiprocessing reductions), which must
never be read from a socket. Our format, load_format = TENSOR_FORMAT: serialized_named_tensors
holds one string per tensor-parallel rank, each the base64 of a safetensors file whose tensors
carry Hugging Face names (model.layers.0.self_attn.q_proj.weight, ...). safetensors is a JSON header
plus raw little-endian bytes, so reading it runs no code. Real SGLang is synced through
/update_weights_from_disk or /update_weights_from_distributed instead.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

import ops
from launch.engines.base import EngineError, Request, Sample, SpecInfo
from miles_fn.config import ModelConfig
from miles_fn.sampling import SamplingConfig

TENSOR_FORMAT = "miles_safetensors_b64"
SEED_MASK_63 = (1 << 63) - 1  # real SGLang keeps sampling_seed in a signed 64-bit integer


def sampling_params(sampling: SamplingConfig, seed: int) -> dict[str, Any]:
    return {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "max_new_tokens": sampling.max_new_tokens,
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": False,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "sampling_seed": seed,
    }


def ops_info(oc: ops.OpsConfig) -> dict[str, Any]:
    """What /get_model_info says of the kernels, so a client can check they are the trainer's."""
    return {"deterministic_inference": oc.invariant,
            "invariant_ops": {"tile_rows": oc.tile_rows, "kv_block": oc.kv_block} if oc.invariant else None}


def generate_body(requests: Sequence[Request], sampling: SamplingConfig, seed_mask: int | None = None,
                  return_routed_experts: bool = False) -> dict[str, Any]:
    """One batched /generate call: every request's ids and its own sampling_seed (and, for a MoE model's
    R3, SGLang's request for the experts each layer ran)."""
    def seed(r: Request) -> int:
        return r.seed & seed_mask if seed_mask is not None else r.seed

    return {
        "input_ids": [list(r.input_ids) for r in requests],
        "sampling_params": [sampling_params(sampling, seed(r)) for r in requests],
        "return_logprob": True,
        "stream": False,
        **({"return_routed_experts": True} if return_routed_experts else {}),
    }


def encode_routes(routes: torch.Tensor, cfg: ModelConfig) -> str:
    """A sample's routes [T, L_moe, k] in SGLang's wire form: base64 of int32 [T, num_layers, k], -1 in dense layers."""
    full = torch.full((routes.shape[0], cfg.num_layers, cfg.num_experts_per_tok), -1, dtype=torch.int32)
    full[:, list(cfg.moe_layers)] = routes.to(torch.int32)
    return base64.b64encode(full.numpy().astype("<i4").tobytes()).decode("ascii")


def decode_routes(blob: Any, tokens: int, cfg: ModelConfig) -> torch.Tensor:
    """encode_routes' inverse: [tokens, L_moe, k] int32; ValueError when the payload is no such array."""
    if not isinstance(blob, str):
        raise ValueError(f"routed_experts: a base64 string is required, got {show(blob)}")
    try:
        raw = base64.b64decode(blob.encode("ascii"), validate=True)
    except (ValueError, UnicodeError) as e:
        raise ValueError(f"routed_experts: not base64 ({e})") from None
    width = cfg.num_layers * cfg.num_experts_per_tok
    if len(raw) != 4 * tokens * width:
        raise ValueError(f"routed_experts: {len(raw)} bytes, expected {tokens} tokens x {cfg.num_layers} layers x "
                         f"{cfg.num_experts_per_tok} experts x 4 bytes = {4 * tokens * width}")
    full = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(tokens, cfg.num_layers, cfg.num_experts_per_tok)
    moe = full[:, list(cfg.moe_layers)]
    if ((moe < 0) | (moe >= cfg.num_experts)).any():
        raise ValueError(f"routed_experts: an expert id outside [0, {cfg.num_experts}) in a MoE layer")
    return moe.clone()


def parse_generate_reply(reply: Any, n: int, where: str, routes_cfg: ModelConfig | None = None) -> list[Sample]:
    """Samples from a /generate reply for n requests; EngineError naming `where` if it is malformed.
    With routes_cfg (a MoE model's config) each meta_info.routed_experts present is decoded (encode_routes)."""
    items = reply if isinstance(reply, list) else [reply]
    if len(items) != n:
        raise EngineError(f"{where}: /generate returned {len(items)} outputs for {n} requests")
    out = []
    for i, item in enumerate(items):
        try:
            meta = item["meta_info"]
            pairs = meta["output_token_logprobs"]
            tokens = [int(p[1]) for p in pairs]
            logprobs = [float(p[0]) for p in pairs]
            reason = meta["finish_reason"]["type"] if isinstance(meta["finish_reason"], dict) else "length"
            v = meta.get("weight_version")
            version = -1 if v is None or v == "" else int(v)  # "" on a request aborted before it started
            routed = meta.get("routed_experts")  # SGLang's enable_return_routed_experts (module docstring)
            if routed is not None and routes_cfg is not None:
                routed = decode_routes(routed, strict_int(meta["prompt_tokens"], "prompt_tokens", 1)
                                       + len(tokens) - 1, routes_cfg)
            else:
                routed = None
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise EngineError(f"{where}: /generate output {i} is malformed ({type(e).__name__}: {e})") from None
        try:
            spec = parse_spec_meta(meta, len(tokens))
        except (TypeError, ValueError) as e:
            raise EngineError(f"{where}: /generate output {i}: {e}") from None
        if "output_ids" in item and list(item["output_ids"]) != tokens:
            raise EngineError(f"{where}: /generate output {i}: output_ids disagree with output_token_logprobs")
        if reason not in ("stop", "length"):
            raise EngineError(f"{where}: /generate output {i} finished with {meta['finish_reason']!r}")
        out.append(Sample(tokens, logprobs, reason, version, routed, spec))
    return out


def generate_reply(samples: Sequence[Sample], prompt_lens: Sequence[int], routes_cfg: ModelConfig | None = None
                   ) -> list[dict[str, Any]]:
    """The SGLang-shaped reply for samples (what the rollout server sends); with routes_cfg (the request
    asked for return_routed_experts) each sample's routes as meta_info.routed_experts."""
    out = []
    for s, n_prompt in zip(samples, prompt_lens, strict=True):
        finish = {"type": "stop", "matched": s.tokens[-1]} if s.finish_reason == "stop" else \
            {"type": "length", "length": len(s.tokens)}
        out.append({
            "text": "",
            "output_ids": list(s.tokens),
            "meta_info": {
                "finish_reason": finish,
                "prompt_tokens": n_prompt,
                "completion_tokens": len(s.tokens),
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(s.logprobs, s.tokens, strict=True)],
                "weight_version": str(s.weight_version),
                **({} if routes_cfg is None or s.routed_experts is None
                   else {"routed_experts": encode_routes(s.routed_experts, routes_cfg)}),
                **({} if s.spec is None else spec_meta(s.spec)),
            },
        })
    return out


def spec_meta(spec: SpecInfo) -> dict[str, Any]:
    """A speculating server's per-request meta_info (SGLang's spec_verify_ct and spec_accept_histogram, and
    the draft's weight version, which SGLang does not report)."""
    return {"spec_verify_ct": sum(spec.histogram), "spec_accept_histogram": list(spec.histogram),
            "spec_plain_ct": spec.plain, "draft_weight_version": str(spec.draft_version)}


def parse_spec_meta(meta: dict[str, Any], n_tokens: int) -> SpecInfo | None:
    """SpecInfo from a reply's meta_info (None when the server did not speculate); ValueError naming the field."""
    hist = meta.get("spec_accept_histogram")
    if hist is None:
        return None
    if not isinstance(hist, list) or len(hist) < 2:
        raise ValueError(f"spec_accept_histogram: a list of k+1 >= 2 counts is required, got {show(hist)}")
    counts = tuple(strict_int(c, "spec_accept_histogram", 0) for c in hist)
    plain = strict_int(meta.get("spec_plain_ct", 0), "spec_plain_ct", 0)  # absent from SGLang's replies
    verifies = sum(counts)
    if n_tokens and not verifies + plain <= n_tokens - 1 <= verifies * len(counts) + plain:
        raise ValueError(f"spec_accept_histogram {show(hist)}, spec_plain_ct {plain}: {verifies} verifies (each "
                         f"emits 1..{len(counts)}) and {plain} plain steps cannot emit {n_tokens - 1} tokens after "
                         "the first")
    v = meta.get("draft_weight_version")
    try:
        draft_version = int(v)
    except (TypeError, ValueError):
        raise ValueError(f"draft_weight_version: an integer string is required, got {show(v)}") from None
    return SpecInfo(counts, draft_version, plain)


def abort_reply(n_prompt: int) -> dict[str, Any]:
    """SGLang's reply for a request aborted before it produced a token."""
    return {"text": "", "output_ids": [], "meta_info": {
        "finish_reason": {"type": "abort", "message": "aborted by /abort_request or /pause_generation"},
        "prompt_tokens": n_prompt, "completion_tokens": 0, "output_token_logprobs": [], "weight_version": ""}}


def show(v: Any, limit: int = 60) -> str:
    """repr of a client's value, cut short (a refused field may hold a huge list)."""
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."


def strict_int(v: Any, field: str, lo: int | None = None, hi: int | None = None) -> int:
    """v if it is a JSON integer in [lo, hi); ValueError naming `field` (true, 2.5 and "3" are not integers)."""
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{field}: an integer is required, got {show(v)}")
    if (lo is not None and v < lo) or (hi is not None and v >= hi):
        span = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'})"
        raise ValueError(f"{field}: {show(v)} is outside {span}")
    return v


def strict_float(v: Any, field: str) -> float:
    """v as a finite float; ValueError naming `field` (NaN, Infinity, true and "1.0" are refused)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{field}: a number is required, got {show(v)}")
    try:
        f = float(v)
    except OverflowError:  # an integer past float range
        f = float("inf")
    if not math.isfinite(f):
        raise ValueError(f"{field}: a finite number is required, got {show(v)}")
    return f


def strict_bool(v: Any, field: str) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{field}: true or false is required, got {show(v)}")
    return v


def token_ids(v: Any, field: str, vocab_size: int | None, allow_empty: bool = False) -> list[int]:
    """A list of token ids in [0, vocab_size); ValueError naming the first bad entry."""
    if not isinstance(v, list) or not (v or allow_empty):
        what = "a list" if allow_empty else "a non-empty list"
        raise ValueError(f"{field}: {what} of token ids is required, got {show(v)}")
    for j, t in enumerate(v):
        strict_int(t, f"{field}[{j}]")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise ValueError(f"{field}[{j}]: token id {t} is outside the model's vocabulary "
                             f"[0, {vocab_size if vocab_size is not None else 'inf'})")
    return list(v)


BOOL_PARAMS = ("ignore_eos", "skip_special_tokens", "no_stop_trim")  # accepted, no effect on ids-in, ids-out


def _sampling_key(p: Any, where: str, vocab_size: int | None) -> tuple[int, tuple]:
    """(sampling_seed, the rest of one request's sampling parameters), each field checked strictly."""
    if not isinstance(p, dict):
        raise ValueError(f"{where}: must be an object, got {show(p)}")
    seed = strict_int(p.get("sampling_seed", 0), f"{where}.sampling_seed", 0, 2**64)
    t = strict_float(p.get("temperature", 1.0), f"{where}.temperature")
    if t < 0:
        raise ValueError(f"{where}.temperature: must be >= 0 (0 = greedy), got {show(t)}")
    top_p = strict_float(p.get("top_p", 1.0), f"{where}.top_p")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"{where}.top_p: must be in (0, 1], got {show(top_p)}")
    top_k = strict_int(p.get("top_k", -1), f"{where}.top_k", -1)  # -1 (SGLang) or 0: off
    n = strict_int(p.get("max_new_tokens", 128), f"{where}.max_new_tokens", 1)
    stop = p.get("stop_token_ids")
    stop_ids = () if stop is None else tuple(token_ids(stop, f"{where}.stop_token_ids", vocab_size, True))
    for k in BOOL_PARAMS:
        if p.get(k) is not None:
            strict_bool(p[k], f"{where}.{k}")
    return seed, (t, max(top_k, 0), top_p, n, stop_ids)


def parse_generate_body(body: dict[str, Any], vocab_size: int | None = None
                        ) -> tuple[list[list[int]], list[int], SamplingConfig]:
    """(prompts, seeds, sampling) from a /generate body; ValueError naming the bad field.

    Types are strict (a bool is not an int, a float must be finite, an int must be one), and with
    vocab_size every token id must be in [0, vocab_size): a bad request gets a 400, never a dropped
    connection. One call is one batch, so every request must share the sampling parameters except the seed."""
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise ValueError("input_ids: a non-empty list of token ids (or of lists of them) is required")
    if all(isinstance(x, list) for x in ids):
        prompts = [token_ids(p, f"input_ids[{i}]", vocab_size) for i, p in enumerate(ids)]
    else:
        prompts = [token_ids(ids, "input_ids", vocab_size)]
    sp = body.get("sampling_params")
    sps = [{}] * len(prompts) if sp is None else [sp] * len(prompts) if isinstance(sp, dict) else sp
    if not isinstance(sps, list):
        raise ValueError(f"sampling_params: an object or a list of them is required, got {show(sp)}")
    if len(sps) != len(prompts):
        raise ValueError(f"sampling_params: {len(sps)} entries for {len(prompts)} prompts")
    if body.get("return_logprob") is not None and not strict_bool(body["return_logprob"], "return_logprob"):
        raise ValueError("return_logprob: this server always returns log-probs; do not set it to false")
    if body.get("stream") is not None and strict_bool(body["stream"], "stream"):
        raise ValueError("stream: streaming is not supported")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str) and not (
            isinstance(rid, list) and len(rid) == len(prompts) and all(isinstance(r, str) for r in rid)):
        raise ValueError(f"rid: a string, or a list of {len(prompts)} strings (one a prompt), is required, "
                         f"got {show(rid)}")
    seeds: list[int] = []
    configs: set[tuple] = set()
    for i, p in enumerate(sps):
        seed, rest = _sampling_key(p, f"sampling_params[{i}]", vocab_size)
        seeds.append(seed)
        configs.add(rest)
    if len(configs) != 1:
        raise ValueError("sampling_params: requests of one call must share every parameter but sampling_seed")
    t, k, top_p, n, stop = configs.pop()
    return prompts, seeds, SamplingConfig(temperature=t, top_k=k, top_p=top_p, max_new_tokens=n, stop_token_ids=stop)


def encode_tensors(named: dict[str, torch.Tensor]) -> str:
    return base64.b64encode(st_save({k: v.detach().contiguous().cpu() for k, v in named.items()})).decode("ascii")


def decode_tensors(blob: str) -> dict[str, torch.Tensor]:
    """Tensors from one TENSOR_FORMAT string; ValueError if it is not base64 safetensors."""
    try:
        raw = base64.b64decode(blob.encode("ascii"), validate=True)
        # clone: own, aligned storage (CPU kernels give different bits on unaligned data)
        return {k: v.clone() for k, v in st_load(raw).items()}
    except Exception as e:  # binascii.Error, SafetensorError, UnicodeError: all mean a bad payload
        raise ValueError(f"serialized_named_tensors: not base64 safetensors ({type(e).__name__}: {e})") from None


def tensor_update_body(named: dict[str, torch.Tensor], version: int, draft_only: bool = False) -> dict[str, Any]:
    """draft_only (SGLang's field): the tensors are the speculative draft's, not the target's."""
    return {"serialized_named_tensors": [encode_tensors(named)], "load_format": TENSOR_FORMAT,
            "flush_cache": True, "weight_version": str(version), **({"draft_only": True} if draft_only else {})}
