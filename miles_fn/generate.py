"""Batched autoregressive generation with a KV cache, as a function of (params, prompts, key).

Request i draws its token at step t from fold_in(fold_in(key, i), t), so what a
request samples does not depend on which other requests share its batch.
The cache is private to the call: nothing outside it is touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

import ops
from miles_fn import model, prng
from miles_fn.batching import place_rows
from miles_fn.config import ModelConfig
from miles_fn.prefix_cache import PrefixCache
from miles_fn.sampling import SamplingConfig, sample_with_uniform
from ops import decode_cpu


class Generation(NamedTuple):
    tokens: list[list[int]]  # response ids, the stop token included when one was hit
    logprobs: list[list[float]]  # per response token, see SamplingConfig.logprob_temperature
    finish_reasons: list[str]  # "stop" or "length"
    # MoE models: per request, the experts each MoE layer ran for every token the model was fed
    # (prompt, then response but its last): [P + R - 1, L_moe, k] int32, for R3 (rollout routing replay)
    routed_experts: list[torch.Tensor] | None = None


@torch.inference_mode()
def generate(
    params: model.Params,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    key: prng.Key,
    sampling: SamplingConfig,
    request_ids: Sequence[int] | None = None,
    *,
    ops_cfg: ops.OpsConfig = ops.REFERENCE,
    prefix_cache: PrefixCache | None = None,
) -> Generation:
    """Left-pad the prompts, prefill once, then decode one token per step for all live rows.

    `request_ids` name each request's key stream (default: its index in `prompts`).
    The reported log-probs come from ops.token_logprobs under `ops_cfg`, the trainer's op:
    with ops.INVARIANT they equal the trainer's full-sequence log-probs bit for bit.
    `prefix_cache` (see prefill) makes a call faster, never different.
    """
    ids = torch.tensor(request_ids if request_ids is not None else range(len(prompts)), dtype=torch.int64)
    return generate_rows(params, cfg, prompts, prng.fold_in(key, ids), sampling, ops_cfg=ops_cfg,
                         prefix_cache=prefix_cache)


@torch.no_grad()
def generate_rows(
    params: model.Params,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    row_keys: prng.Key,
    sampling: SamplingConfig,
    *,
    ops_cfg: ops.OpsConfig = ops.REFERENCE,
    prefix_cache: PrefixCache | None = None,
) -> Generation:
    """`generate` with one key per request given directly ([B, 2]): how a server that receives
    each request's key (as a sampling seed) reproduces what the caller would sample in-process."""
    b = len(prompts)
    if b == 0:
        return Generation([], [], [])
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    lens = torch.tensor([len(p) for p in prompts])
    lp = int(lens.max())
    n_new = sampling.max_new_tokens
    if lp + n_new > cfg.max_position_embeddings:
        raise ValueError(
            f"generate: prompt length {lp} + max_new_tokens {n_new} exceeds "
            f"max_position_embeddings {cfg.max_position_embeddings}"
        )
    total = lp + n_new
    if tuple(row_keys.shape) != (b, 2):
        raise ValueError(f"generate: row_keys must have shape [{b}, 2], got {tuple(row_keys.shape)}")

    prompt_tok = place_rows(prompts, lp - lens, lp)  # left-padded
    key_valid = torch.arange(total)[None] >= (lp - lens)[:, None]
    positions = torch.clamp(torch.arange(lp)[None, :] - (lp - lens)[:, None], min=0)

    routes: list | None = [] if cfg.num_experts else None  # prefill's MoE routes, then each step's
    logits, cache = prefill(params, cfg, prompts, prompt_tok, positions, key_valid, total, ops_cfg, routes,
                            stops=sampling.stop_token_ids, prefix_cache=prefix_cache)

    # Every step's key and its uniform in two vectorised calls instead of two Threefry
    # evaluations (~300 small ops) a step: the same values, as a draw is a function of
    # (key, counter) alone.
    uniforms = None
    if sampling.temperature > 0:
        uniforms = prng.uniform64(prng.fold_in(row_keys[None], torch.arange(n_new)[:, None]))  # [n_new, B]
    kernel = None
    if n_new > 1 and decode_cpu.chosen(ops_cfg, params, cache):
        # The decode steps' rope tables, once: step t feeds row r's token at position lens[r] + t.
        cos, sin = ops.rope_tables(lens[:, None] + torch.arange(n_new)[None], cfg.dim_head, cfg.rope_theta)
        kernel = decode_cpu.DecodePlan(params, cfg, cache, key_valid, cos[:, 0], sin[:, 0])
    stop = torch.tensor(sampling.stop_token_ids or [-1], dtype=torch.int64)
    step_routes: list[torch.Tensor] = []  # per decode step [B, L_moe, k]
    prompt_routes = None if routes is None else torch.stack([r.used.view(b, lp, -1) for r in routes], 2)
    out_tok = torch.zeros(b, n_new, dtype=torch.int64)
    out_lp = torch.zeros(b, n_new, dtype=torch.float32)
    done = torch.zeros(b, dtype=torch.bool)
    n_out = torch.zeros(b, dtype=torch.int64)  # tokens per row, its stop token included
    if kernel is not None and sampling.top_k == 0 and sampling.top_p == 1.0 and not sampling.limits(cfg.vocab_size):
        # The loop below, sampler included, as one C call (ops.decode_cpu.DecodePlan.generate). Its sampler
        # draws from every row: with a vocab_limit cut the kernel only steps and the loop below samples.
        out_tok, out_lp, n_out = kernel.generate(logits, uniforms, sampling.logprob_temperature,
                                                 sampling.stop_token_ids, lp)
        return _generation(out_tok, out_lp, n_out, sampling)
    for t in range(n_new):
        tok, lps = sample_with_uniform(logits, None if uniforms is None else uniforms[t], sampling)
        if ops_cfg.invariant:  # the reference token_logprobs is sample_with_uniform's own log_softmax + gather
            lps = ops.token_logprobs(logits, tok, sampling.logprob_temperature, ops_cfg)  # the trainer's op
        if sampling.stop_token_ids:
            live = ~done
            tok = torch.where(live, tok, 0)
            lps = torch.where(live, lps, 0.0)
            n_out += live.to(torch.int64)
            done = done | (live & torch.isin(tok, stop))
        else:
            n_out.fill_(t + 1)
        out_tok[:, t] = tok
        out_lp[:, t] = lps
        if t == n_new - 1 or (sampling.stop_token_ids and bool(done.all())):
            break
        col = lp + t
        if kernel is not None:
            logits = kernel.step(tok, t, col)
            continue
        mask = key_valid[:, None, : col + 1]
        pos = (lens + t)[:, None]
        step: list | None = None if prompt_routes is None else []
        logits = model.forward(params, cfg, tok[:, None], pos, mask, cache, col, ops_cfg=ops_cfg,
                               routes_out=step)[:, -1]
        if step is not None:
            step_routes.append(torch.stack([r.used.view(b, -1) for r in step], 1))

    gen = _generation(out_tok, out_lp, n_out, sampling)
    if prompt_routes is None:
        return gen
    steps = torch.stack(step_routes, 1) if step_routes else prompt_routes.new_zeros(b, 0, *prompt_routes.shape[2:])
    per_row = [torch.cat([prompt_routes[i, lp - int(lens[i]):], steps[i, : max(len(t) - 1, 0)]]).to(torch.int32)
               for i, t in enumerate(gen.tokens)]
    return gen._replace(routed_experts=per_row)


MIN_SHARED_PREFIX = 8  # tokens: a shorter common prefix, or turn, is not worth its own forward


def prefill(params: model.Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], prompt_tok: torch.Tensor,
            positions: torch.Tensor, key_valid: torch.Tensor, width: int, ops_cfg: ops.OpsConfig,
            routes: list | None = None, head: bool = True, stops: Sequence[int] = (),
            prefix_cache: PrefixCache | None = None) -> tuple[torch.Tensor | None, model.KVCache]:
    """The left-padded prompts [B, lp] into a new cache of `width` columns, and their last column's logits
    [B, V] (None with head=False).

    Each distinct prompt runs once and its cache rows and logits are copied to the requests that share it
    (a GRPO batch repeats each prompt group-size times). The distinct prompts' common prefix runs once too,
    cut at the turn ends they share (turn_bounds: after a `stops` token, a chat template's end of turn) and
    then up to their longest common prefix (shared_prefix_len): a function of the call's prompts alone, so a
    call prefills the same way whatever ran before it. The keys/values up to each cut are a function of the
    tokens before it, so `prefix_cache` may serve them from an earlier call, bit for bit. `routes` (MoE),
    when given, is filled with the prefill's moe.Route per layer, per request row (no prefix sharing).
    """
    b, lp = prompt_tok.shape
    row_of, src = distinct_prompts(prompts)
    dtype = params["embed"].dtype
    distinct = [prompts[i] for i in src]
    bounds = [] if routes is not None else common_bounds(distinct, stops)
    c = 0 if routes is not None else max(bounds[-1] if bounds else 0, shared_prefix_len(distinct))
    share = _Shared(bounds, c, prefix_cache, (cfg, ops_cfg))
    if len(src) == b:
        cache = model.new_kv_cache(cfg, b, width, dtype)
        return _prefill_rows(params, cfg, distinct, prompt_tok, positions, key_valid, cache, share, ops_cfg, routes,
                             head), cache
    rows, s_idx = torch.tensor(row_of, dtype=torch.int64), torch.tensor(src, dtype=torch.int64)
    pre = model.new_kv_cache(cfg, len(src), lp, dtype)
    got: list | None = None if routes is None else []
    logits = _prefill_rows(params, cfg, distinct, prompt_tok[s_idx], positions[s_idx], key_valid[s_idx], pre, share,
                           ops_cfg, got, head)
    if routes is not None:
        routes.extend(r._replace(used=r.used.view(len(src), lp, -1)[rows]) for r in got)
    cache = model.new_kv_cache(cfg, b, width, dtype)
    for (ck, cv), (pk, pv) in zip(cache, pre, strict=True):
        ck[:, :, :lp] = pk[rows]
        cv[:, :, :lp] = pv[rows]
    return None if logits is None else logits[rows], cache


def shared_prefix_len(prompts: Sequence[Sequence[int]]) -> int:
    """The prompts' longest common prefix, short of the shortest prompt (each row keeps a column of its own
    to give its logits); 0 for fewer than two prompts or under MIN_SHARED_PREFIX tokens."""
    if len(prompts) < 2:
        return 0
    c = _common_len(prompts)
    return c if c >= MIN_SHARED_PREFIX else 0


def _common_len(prompts: Sequence[Sequence[int]]) -> int:
    first, c = prompts[0], min(len(p) for p in prompts) - 1
    for p in prompts[1:]:
        c = next((i for i in range(c) if p[i] != first[i]), c)
    return c


def turn_bounds(prompt: Sequence[int], stops: Sequence[int]) -> list[int]:
    """Where a prefill cuts this prompt: after each `stops` token (a chat turn's end) at least
    MIN_SHARED_PREFIX tokens past the last cut and before the prompt's end.

    The cuts up to any cut are a function of the tokens before it alone (a cut kept near the end only
    ever drops later ones), so the keys/values there are too: what lets a PrefixCache serve them.
    """
    if not stops:
        return []
    stop, n, out, last = set(stops), len(prompt), [], 0
    for i, t in enumerate(prompt):
        if t in stop and i + 1 - last >= MIN_SHARED_PREFIX and n - i - 1 >= MIN_SHARED_PREFIX:
            out.append(i + 1)
            last = i + 1
    return out


def common_bounds(prompts: Sequence[Sequence[int]], stops: Sequence[int]) -> list[int]:
    """The turn_bounds every prompt has, within their common prefix (each row keeps a column of its own)."""
    if not prompts or not stops:
        return []
    c = _common_len(prompts) if len(prompts) > 1 else len(prompts[0]) - 1
    lists = [turn_bounds(p, stops) for p in prompts]
    out: list[int] = []
    for j, e in enumerate(min(lists, key=len)):  # the lists' common leading cuts, up to c
        if e > c or any(x[j] != e for x in lists):
            break
        out.append(e)
    return out


class _Shared(NamedTuple):
    bounds: list[int]  # the turn ends every row shares, cut one after another
    c: int  # then the rest of the rows' common prefix: columns [0, c) run once for all rows
    memo: PrefixCache | None
    tag: tuple  # (model config, ops config): with the weights, what the memo's entries are a function of


def _prefill_rows(params: model.Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], tok: torch.Tensor,
                  pos: torch.Tensor, valid: torch.Tensor, cache: model.KVCache, share: _Shared, oc: ops.OpsConfig,
                  routes: list | None, head: bool) -> torch.Tensor | None:
    """The prefill of left-padded rows whose first share.c tokens are the same: those run once ([1, c], in
    pieces at share.bounds) and their keys/values are copied to each row's columns; then the columns from c
    on run for every row (the longest row's own, the others' tail of the prefix again, and their padding).
    The keys and masks each query sees are those of the one-piece prefill, so under ops.INVARIANT the logits
    are its bits."""
    lp, c = tok.shape[1], share.c
    mask = prefill_mask(valid, lp)
    dense = bool(valid[:, :lp].all())
    if c == 0:
        return _forward(params, cfg, tok, pos, mask, cache, 0, oc, routes, head, dense)
    shared = _shared_prefix(params, cfg, prompts[0][:c], share, oc)
    lens = valid[:, :lp].sum(1)
    cols = (lp - lens)[:, None] + torch.arange(c)[None]  # [R, c]: each row's prefix columns
    rows = torch.arange(tok.shape[0])[:, None]
    for (ck, cv), (sk, sv) in zip(cache, shared, strict=True):  # [R, S, Hkv, D] views, written in place
        ck.transpose(1, 2)[rows, cols] = sk.transpose(1, 2)
        cv.transpose(1, 2)[rows, cols] = sv.transpose(1, 2)
    return _forward(params, cfg, tok[:, c:], pos[:, c:], mask[:, c:], cache, c, oc, None, head, dense)


def _forward(params: model.Params, cfg: ModelConfig, tok: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
             cache: model.KVCache, start: int, oc: ops.OpsConfig, routes: list | None, head: bool,
             dense: bool) -> torch.Tensor | None:
    """One prefill forward: model.last_logits, or the C kernel's (decode_cpu.prefill) where the kernel can take
    the model and the block is `dense` (no left padding: `mask` is then the causal mask over the cache's
    columns before it, which the kernel applies itself). Never an error: decoding is where
    --decode_backend=cpu_kernel insists. A function of the ops config and the shapes, so a prompt
    prefills the same way at every call."""
    if dense and routes is None and decode_cpu.can_take(oc, params, cache):
        return decode_cpu.prefill(params, cfg, tok, pos, cache, start, head)
    return model.last_logits(params, cfg, tok, pos, mask, cache, start, ops_cfg=oc, routes_out=routes, head=head)


def _shared_prefix(params: model.Params, cfg: ModelConfig, tokens: Sequence[int], share: _Shared,
                   oc: ops.OpsConfig) -> model.KVCache:
    """The keys/values [1, c] of the common prefix: a forward per piece, each on top of the ones before;
    a piece up to a turn end comes from share.memo when it holds it, and goes there when it did not."""
    shared = model.new_kv_cache(cfg, 1, share.c, params["embed"].dtype)
    start, kv = (0, None) if share.memo is None else share.memo.longest(params, share.tag, tokens, share.bounds)
    if kv is not None:
        for (sk, sv), (mk, mv) in zip(shared, kv, strict=True):
            sk[:, :, :start] = mk
            sv[:, :, :start] = mv
    ends = [e for e in share.bounds if e > start] + ([] if share.c in share.bounds else [share.c])
    for end in ends:
        n = end - start
        _forward(params, cfg, torch.tensor([list(tokens[start:end])]), torch.arange(start, end)[None],
                 torch.ones(1, n, end, dtype=torch.bool).tril(start), shared, start, oc, None, False, True)
        if share.memo is not None and end in share.bounds:
            share.memo.store(params, share.tag, tuple(tokens[:end]), shared)
        start = end
    return shared


def distinct_prompts(prompts: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(each request's distinct prompt, the first request of each distinct prompt): a GRPO batch repeats
    every prompt group-size times, so the prefill runs each once."""
    first: dict[tuple[int, ...], int] = {}
    row_of: list[int] = []
    src: list[int] = []
    for i, p in enumerate(prompts):
        row_of.append(first.setdefault(tuple(p), len(first)))
        if row_of[-1] == len(src):
            src.append(i)
    return row_of, src


def prefill_mask(key_valid: torch.Tensor, lp: int) -> torch.Tensor:
    """The left-padded prompts' causal mask [B, lp, lp]; a padding query sees itself (no empty softmax row)."""
    causal = torch.tril(torch.ones(lp, lp, dtype=torch.bool))
    return (causal[None] & key_valid[:, None, :lp]) | torch.eye(lp, dtype=torch.bool)[None]


def _generation(out_tok: torch.Tensor, out_lp: torch.Tensor, n_out: torch.Tensor, sampling: SamplingConfig
                ) -> Generation:
    counts, all_tok, all_lp = n_out.tolist(), out_tok.tolist(), out_lp.tolist()  # one conversion each
    tokens = [row[:n] for row, n in zip(all_tok, counts, strict=True)]
    logprobs = [row[:n] for row, n in zip(all_lp, counts, strict=True)]
    stops = set(sampling.stop_token_ids)
    reasons = ["stop" if t and t[-1] in stops else "length" for t in tokens]
    return Generation(tokens, logprobs, reasons)
