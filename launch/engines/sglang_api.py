"""The subset of SGLang's native HTTP API that the rollout path uses, as plain functions over JSON.

Both sides use these shapes: the client (to drive real SGLang or launch.rollout_server) and the
rollout server (to answer like SGLang). Shapes follow SGLang's GenerateReqInput / io_struct:

  POST /generate {"input_ids": [[int]], "sampling_params": [{...}], "return_logprob": true}
    -> [{"output_ids": [int], "meta_info": {"finish_reason": {"type": "stop", "matched": id} |
         {"type": "length", "length": n}, "output_token_logprobs": [[logprob, token_id, null], ...],
         "prompt_tokens": n, "completion_tokens": n, "weight_version": "7"}}]
  POST /update_weights_from_tensor {"serialized_named_tensors": [str], "load_format": str,
       "flush_cache": bool, "weight_version": str} -> {"success": bool, "message": str}
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
from collections.abc import Sequence
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

import ops
from launch.engines.base import EngineError, Request, Sample
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


def generate_body(requests: Sequence[Request], sampling: SamplingConfig, seed_mask: int | None = None
                  ) -> dict[str, Any]:
    """One batched /generate call: every request's ids and its own sampling_seed."""
    def seed(r: Request) -> int:
        return r.seed & seed_mask if seed_mask is not None else r.seed

    return {
        "input_ids": [list(r.input_ids) for r in requests],
        "sampling_params": [sampling_params(sampling, seed(r)) for r in requests],
        "return_logprob": True,
        "stream": False,
    }


def parse_generate_reply(reply: Any, n: int, where: str) -> list[Sample]:
    """Samples from a /generate reply for n requests; EngineError naming `where` if it is malformed."""
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
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise EngineError(f"{where}: /generate output {i} is malformed ({type(e).__name__}: {e})") from None
        if "output_ids" in item and list(item["output_ids"]) != tokens:
            raise EngineError(f"{where}: /generate output {i}: output_ids disagree with output_token_logprobs")
        if reason not in ("stop", "length"):
            raise EngineError(f"{where}: /generate output {i} finished with {meta['finish_reason']!r}")
        out.append(Sample(tokens, logprobs, reason, version))
    return out


def generate_reply(samples: Sequence[Sample], prompt_lens: Sequence[int]) -> list[dict[str, Any]]:
    """The SGLang-shaped reply for samples (what the rollout server sends)."""
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
            },
        })
    return out


def abort_reply(n_prompt: int) -> dict[str, Any]:
    """SGLang's reply for a request aborted before it produced a token."""
    return {"text": "", "output_ids": [], "meta_info": {
        "finish_reason": {"type": "abort", "message": "aborted by /abort_request or /pause_generation"},
        "prompt_tokens": n_prompt, "completion_tokens": 0, "output_token_logprobs": [], "weight_version": ""}}


def parse_generate_body(body: dict[str, Any]) -> tuple[list[list[int]], list[int], SamplingConfig]:
    """(prompts, seeds, sampling) from a /generate body; ValueError naming the bad field.

    One call is one batch, so every request must share the sampling parameters except the seed."""
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise ValueError("input_ids: a non-empty list of token ids (or of lists of them) is required")
    prompts = [ids] if isinstance(ids[0], int) else ids
    if not all(isinstance(p, list) and p and all(isinstance(t, int) and t >= 0 for t in p) for p in prompts):
        raise ValueError("input_ids: every prompt must be a non-empty list of non-negative ints")
    sp = body.get("sampling_params") or {}
    sps = sp if isinstance(sp, list) else [sp] * len(prompts)
    if len(sps) != len(prompts):
        raise ValueError(f"sampling_params: {len(sps)} entries for {len(prompts)} prompts")
    if body.get("return_logprob") is False:
        raise ValueError("return_logprob: this server always returns log-probs; do not set it to false")
    if body.get("stream"):
        raise ValueError("stream: streaming is not supported")
    seeds: list[int] = []
    configs: set[tuple] = set()
    for i, p in enumerate(sps):
        if not isinstance(p, dict):
            raise ValueError(f"sampling_params[{i}]: must be an object")
        seed = p.get("sampling_seed", 0)
        if not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise ValueError(f"sampling_params[{i}].sampling_seed: an integer in [0, 2**64) is required")
        seeds.append(seed)
        try:
            top_k = int(p.get("top_k", -1))
            configs.add((float(p.get("temperature", 1.0)), max(top_k, 0), float(p.get("top_p", 1.0)),
                         int(p.get("max_new_tokens", 128)), tuple(int(t) for t in p.get("stop_token_ids") or ())))
        except (TypeError, ValueError) as e:
            raise ValueError(f"sampling_params[{i}]: {e}") from None
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


def tensor_update_body(named: dict[str, torch.Tensor], version: int) -> dict[str, Any]:
    return {"serialized_named_tensors": [encode_tensors(named)], "load_format": TENSOR_FORMAT,
            "flush_cache": True, "weight_version": str(version)}
