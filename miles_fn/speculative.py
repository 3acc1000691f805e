"""Speculative decoding that returns exactly what plain decoding returns for the same keys.

Plain decoding (miles_fn.generate) samples row r's token t by the inverse CDF of one uniform
u[r, t] = uniform64(fold_in(row_key[r], t)). Here a small draft LM proposes k tokens greedily, the
target scores [pending, d_1..d_k] in one forward of k+1 tokens on its KV cache, and at each position
j the target's own inverse-CDF sample s_j from the same uniform u[r, n + j] is computed. Draft token
d_{j+1} is accepted exactly when s_j == d_{j+1}; at the first disagreement s_j is kept and the round
stops (after k acceptances s_k is the bonus token). Every emitted token is therefore the target's
sample at its position from its own uniform, given a prefix that is itself the target's samples: the
plain sampler's output token for token. Its log-prob is the target's, from the verify forward (never
the draft's). Under ops.INVARIANT a row's logits do not depend on how many tokens a forward carries
or on masked cache columns, so tokens and log-probs equal plain decoding's bit for bit; with the
reference ops they agree to float rounding (and the tokens are the same unless a uniform falls within
rounding of a CDF step).

For a deterministic draft this is the maximal coupling of the draft's point mass with the target's
sampler: P(accept) = p(d), the acceptance of rejection sampling (Leviathan et al.) for a greedy draft.

The cache: each round writes k+1 columns to both caches; the rejected drafts' columns are marked
invalid in the row's key mask ("rolled back" per row without moving memory), so rows accept
different counts and finish independently (stop token, max_new_tokens) in one batch. The draft runs
in the C decode kernel (ops.decode_cpu) where plain decoding would use it, and so does the verify: one
kernel call of B x (k+1) tokens, its GEMMs over weights packed for that many rows, its sampler the
plain kernel loop's. Under ops.INVARIANT the kernel is never used (the verify stays on the invariant
torch forward, for the bitwise claim above); elsewhere the kernel rounds as plain decoding on the
kernel does, to float32 rounding of the torch forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

import ops
from miles_fn import model, prng
from miles_fn.batching import place_rows
from miles_fn.config import ModelConfig
from miles_fn.generate import Generation, prefill
from miles_fn.prefix_cache import PrefixCache
from miles_fn.sampling import SamplingConfig, sample_with_uniform
from ops import decode_cpu

# The draft's numbers only decide what is proposed, never what is emitted: the fastest reference path.
DRAFT_OPS = ops.OpsConfig(decode_backend="auto")


@dataclasses.dataclass(frozen=True)
class SpecStats:
    """Counts over (row, verify forward) pairs of live rows; `add` sums two calls' counts."""

    verifies: int = 0  # live rows summed over verify forwards
    emitted: int = 0  # tokens those verifies emitted (each row's first token comes from the prefill)
    accepted_at: tuple[int, ...] = ()  # [k]: verifies whose drafts 1..j+1 all matched the target's samples
    # Per row, in request order: [k+1] verifies that accepted exactly j drafts (what a server reports per request).
    rows: tuple[tuple[int, ...], ...] = ()
    plain: tuple[int, ...] = ()  # per row, in request order: plain steps (disable_by_batch_size), not verifies

    def add(self, other: SpecStats) -> SpecStats:
        if not self.accepted_at:
            return other
        if not other.accepted_at:
            return self
        if len(self.accepted_at) != len(other.accepted_at):
            raise ValueError(f"SpecStats.add: k differs ({len(self.accepted_at)} vs {len(other.accepted_at)})")
        return SpecStats(self.verifies + other.verifies, self.emitted + other.emitted,
                         tuple(a + b for a, b in zip(self.accepted_at, other.accepted_at, strict=True)),
                         self.rows + other.rows,
                         (self.plain or (0,) * len(self.rows)) + (other.plain or (0,) * len(other.rows)))

    @staticmethod
    def from_rows(histograms: Sequence[Sequence[int]], emitted: int) -> SpecStats:
        """The counts of requests given by their acceptance histograms and the tokens their verifies emitted
        (a request's tokens less its first, which the prefill samples)."""
        if not histograms:
            return SpecStats()
        k = len(histograms[0]) - 1
        if k < 1 or any(len(h) != k + 1 for h in histograms):
            raise ValueError(f"SpecStats.from_rows: every histogram needs the same k+1 >= 2 entries, got "
                             f"{sorted({len(h) for h in histograms})}")
        return SpecStats(sum(sum(h) for h in histograms), emitted,
                         tuple(sum(sum(h[j + 1:]) for h in histograms) for j in range(k)),
                         tuple(tuple(h) for h in histograms))

    @property
    def tokens_per_verify(self) -> float:
        """Mean accepted length: tokens emitted per verify forward (1 = nothing accepted, k+1 at most)."""
        return self.emitted / self.verifies if self.verifies else 0.0

    @property
    def accept_rate(self) -> float:
        """Accepted drafts / proposed drafts (SGLang's and Miles' spec_accept_rate)."""
        k = len(self.accepted_at)
        return sum(self.accepted_at) / (self.verifies * k) if self.verifies and k else 0.0

    @property
    def accept_by_position(self) -> tuple[float, ...]:
        """P(draft j accepted | drafts before it accepted), j = 1..k."""
        reached = (self.verifies, *self.accepted_at[:-1])
        return tuple(a / r if r else 0.0 for a, r in zip(self.accepted_at, reached, strict=True))


def generate_speculative(
    params: model.Params,
    cfg: ModelConfig,
    draft_params: model.Params,
    draft_cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    key: prng.Key,
    sampling: SamplingConfig,
    num_steps: int,
    request_ids: Sequence[int] | None = None,
    *,
    ops_cfg: ops.OpsConfig = ops.REFERENCE,
    draft_ops_cfg: ops.OpsConfig = DRAFT_OPS,
    disable_by_batch_size: int = 0,
    prefix_cache: PrefixCache | None = None,
) -> tuple[Generation, SpecStats]:
    """generate(params, cfg, prompts, key, sampling, request_ids) with a draft proposing num_steps tokens
    a verify: the same Generation (see the module docstring), and the acceptance counts."""
    ids = torch.tensor(request_ids if request_ids is not None else range(len(prompts)), dtype=torch.int64)
    return generate_speculative_rows(params, cfg, draft_params, draft_cfg, prompts, prng.fold_in(key, ids),
                                     sampling, num_steps, ops_cfg=ops_cfg, draft_ops_cfg=draft_ops_cfg,
                                     disable_by_batch_size=disable_by_batch_size, prefix_cache=prefix_cache)


def check_draft(cfg: ModelConfig, draft_cfg: ModelConfig, num_steps: int) -> None:
    """Refuse a draft that cannot propose the target's tokens, naming the fix."""
    if num_steps < 1:
        raise ValueError(f"speculative decoding: num_steps (--speculative_num_steps) must be >= 1, got {num_steps}")
    if draft_cfg.vocab_size != cfg.vocab_size:
        raise ValueError(f"speculative decoding: the draft's vocab_size {draft_cfg.vocab_size} differs from the "
                         f"target's {cfg.vocab_size}; the draft must share the target's tokenizer and vocabulary "
                         "(--draft_checkpoint of the same model family, or a random draft from --draft_hidden_size)")


def _sample(logits: torch.Tensor, u: torch.Tensor | None, sampling: SamplingConfig, oc: ops.OpsConfig,
            kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain engine's per-step sampler and log-prob, call for call (generate_rows' loop body, or with
    `kernel` its C loop's sampler, which plain decoding on the kernel uses)."""
    if kernel:
        return decode_cpu.sample_rows(logits, u, sampling.logprob_temperature)
    tok, lps = sample_with_uniform(logits, u, sampling)
    if oc.invariant:
        lps = ops.token_logprobs(logits, tok, sampling.logprob_temperature, oc)
    return tok, lps


def _take(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """x's rows `rows` (None: all of x)."""
    return x if rows is None else x[rows]


def _put(x: torch.Tensor, rows: torch.Tensor, b: int) -> torch.Tensor:
    """_take's inverse: a [b, ...] tensor of zeros with x's rows at `rows` (the live rows' results back to [B])."""
    return x.new_zeros(b, *x.shape[1:]).index_copy_(0, rows, x)


def _greedy(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The draft's proposal: its argmax over the ids the target may sample (vocab_limit)."""
    if sampling.limits(logits.shape[-1]):
        logits = logits[..., : sampling.vocab_limit]
    return torch.argmax(logits, dim=-1)


def verify(logits: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor | None, sampling: SamplingConfig,
           oc: ops.OpsConfig = ops.REFERENCE, kernel: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The lossless rule on one verify forward's logits [B, k+1, V], drafts [B, k], uniforms [B, k+1].

    Returns the target's own samples s [B, k+1] (column j from u[:, j], by the plain sampler), their
    log-probs [B, k+1], and the accepted count a [B]: the longest run with s[:, j] == drafts[:, j]. The
    row emits s[:, :a+1]: the accepted drafts (equal to the target's samples) and the target's sample
    at the first disagreement (or the bonus after k acceptances). `kernel`: the C kernel's sampler, as
    plain decoding on the kernel samples (one call over every row and column).
    """
    k = drafts.shape[1]
    if kernel:
        b, t, v = logits.shape
        s, lps = _sample(logits.reshape(b * t, v), None if u is None else u.reshape(b * t), sampling, oc, True)
        s, lps = s.view(b, t), lps.view(b, t)
        return s, lps, torch.cumprod((s[:, :k] == drafts).to(torch.int64), 1).sum(1)
    samples, lps = [], []
    for j in range(k + 1):  # one [B, V] call a column, the shape the plain engine's step samples
        s, lp = _sample(logits[:, j].contiguous(), None if u is None else u[:, j].contiguous(), sampling, oc)
        samples.append(s)
        lps.append(lp)
    s = torch.stack(samples, 1)
    a = torch.cumprod((s[:, :k] == drafts).to(torch.int64), 1).sum(1)
    return s, torch.stack(lps, 1), a


def _plans(params: model.Params, cfg: ModelConfig, cache: model.KVCache, valid: torch.Tensor, base: torch.Tensor,
           entries: int, blocks: Sequence[int], oc: ops.OpsConfig) -> list[decode_cpu.DecodePlan] | None:
    """C kernel plans of these block sizes over one cache where plain decoding would take the kernel, else None.

    They read the caller's mask `valid` (bool, viewed as bytes: the same memory) at every step, and rope
    table entry e of row r is position base[r] + e.
    """
    if not decode_cpu.chosen(oc, params, cache):
        return None
    cos, sin = ops.rope_tables(base[:, None] + torch.arange(entries)[None], cfg.dim_head, cfg.rope_theta)
    return [decode_cpu.DecodePlan(params, cfg, cache, valid.view(torch.uint8), cos[:, 0], sin[:, 0], block=t)
            for t in blocks]


@torch.no_grad()
def generate_speculative_rows(
    params: model.Params,
    cfg: ModelConfig,
    draft_params: model.Params,
    draft_cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    row_keys: prng.Key,
    sampling: SamplingConfig,
    num_steps: int,
    *,
    ops_cfg: ops.OpsConfig = ops.REFERENCE,
    draft_ops_cfg: ops.OpsConfig = DRAFT_OPS,
    disable_by_batch_size: int = 0,
    prefix_cache: PrefixCache | None = None,
) -> tuple[Generation, SpecStats]:
    """generate_rows (one key per request, [B, 2]) with speculative rounds of num_steps draft tokens.

    disable_by_batch_size > 0 (vLLM's speculative_disable_by_batch_size): a round with more live rows than
    that is a plain decode step instead (the target's sample from the same uniform; the draft only takes
    the token into its cache), since where a step is compute-bound a verify of k+1 tokens a row costs k+1
    steps. The tokens are the same either way; SpecStats.plain counts those steps per row.
    """
    check_draft(cfg, draft_cfg, num_steps)
    if disable_by_batch_size < 0:
        raise ValueError(f"generate_speculative: disable_by_batch_size must be >= 0, got {disable_by_batch_size}")
    k = num_steps
    b = len(prompts)
    if b == 0:
        return Generation([], [], []), SpecStats(0, 0, (0,) * k, ())
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate_speculative: every prompt needs at least one token")
    if tuple(row_keys.shape) != (b, 2):
        raise ValueError(f"generate_speculative: row_keys must have shape [{b}, 2], got {tuple(row_keys.shape)}")
    lens = torch.tensor([len(p) for p in prompts])
    lp, n_new = int(lens.max()), sampling.max_new_tokens
    if lp + n_new > cfg.max_position_embeddings:
        raise ValueError(f"generate_speculative: prompt length {lp} + max_new_tokens {n_new} exceeds "
                         f"max_position_embeddings {cfg.max_position_embeddings}")
    # Every live row emits >= 1 token a round after the prefill's first: at most n_new - 1 rounds of k+1 columns.
    width = lp + (n_new - 1) * (k + 1)
    prompt_tok = place_rows(prompts, lp - lens, lp)
    valid_t = torch.zeros(b, width, dtype=torch.bool)
    valid_t[:, :lp] = torch.arange(lp)[None] >= (lp - lens)[:, None]
    valid_d = valid_t.clone()
    positions = torch.clamp(torch.arange(lp)[None, :] - (lp - lens)[:, None], min=0)
    stops = sampling.stop_token_ids
    logits, cache_t = prefill(params, cfg, prompts, prompt_tok, positions, valid_t, width, ops_cfg, stops=stops,
                              prefix_cache=prefix_cache)
    # head=False: the draft's first proposal comes from its round's [prev, pending] block
    _, cache_d = prefill(draft_params, draft_cfg, prompts, prompt_tok, positions, valid_d, width, draft_ops_cfg,
                         head=False, stops=stops, prefix_cache=prefix_cache)
    # The kernel's rope entries: the target's t is position lens + t (pending's is n - 1), the draft's
    # position lens - 1 + t (its round starts one token earlier, at prev).
    kt = kd = None
    if n_new > 1:
        steps = 0 < disable_by_batch_size < b  # some round may have more live rows: a 1-token plan too
        kt = _plans(params, cfg, cache_t, valid_t, lens, n_new + k, [k + 1, 1] if steps else [k + 1], ops_cfg)
        kd = _plans(draft_params, draft_cfg, cache_d, valid_d, lens - 1, n_new + k + 1, [2, 1], draft_ops_cfg)
    kernel_sampler = (kt is not None and sampling.top_k == 0 and sampling.top_p == 1.0
                      and not sampling.limits(cfg.vocab_size))  # as generate_rows decides for plain decoding

    # The plain engine's uniforms, the same call; k+1 spare rows for the verify columns past max_new_tokens.
    u = None
    if sampling.temperature > 0:
        u = prng.uniform64(prng.fold_in(row_keys[None], torch.arange(n_new)[:, None]))  # [n_new, B]
        u = torch.cat([u, torch.zeros(k + 1, b, dtype=u.dtype)])
    stop = torch.tensor(sampling.stop_token_ids or [-1], dtype=torch.int64)
    rows = torch.arange(b)
    span = torch.arange(k + 1)
    out_tok = torch.zeros(b, n_new + k + 1, dtype=torch.int64)
    out_lp = torch.zeros(b, n_new + k + 1, dtype=torch.float32)

    tok, lps = _sample(logits, None if u is None else u[0], sampling, ops_cfg, kernel_sampler)
    out_tok[:, 0], out_lp[:, 0] = tok, lps
    n = torch.ones(b, dtype=torch.int64)  # tokens emitted per row
    done = torch.isin(tok, stop) | (n >= n_new)
    pending = tok  # the last emitted token: in neither cache yet
    prev = prompt_tok[:, -1]  # the token before it, for the draft: already in its cache after the prefill...
    prev_valid = torch.zeros(b, dtype=torch.bool)  # ...unless the previous round accepted all k drafts
    verifies, emitted, accepted_at = 0, 0, torch.zeros(k, dtype=torch.int64)
    hist = torch.zeros(b, k + 1, dtype=torch.int64)  # per row: verifies that accepted exactly j drafts
    plain = torch.zeros(b, dtype=torch.int64)  # per row: plain steps (rounds past disable_by_batch_size)
    no_drafts = torch.zeros(b, 0, dtype=torch.int64)
    col = lp
    causal_blk = torch.tril(torch.ones(k + 1, k + 1, dtype=torch.bool))
    while not bool(done.all()):
        live = ~done
        pos = lens + n - 1  # pending's position
        # kr = k drafts this round, or 0: a plain step (more live rows than disable_by_batch_size).
        kr = 0 if disable_by_batch_size and int(live.sum()) > disable_by_batch_size else k
        # Draft: [prev, pending] at columns col, col+1, then d_1..d_{k-1} one a step at col+2 .. col+k.
        valid_d[:, col] = prev_valid
        valid_d[:, col + 1 : col + max(kr, 1) + 1] = True  # tentative: a query only sees the columns before it
        # On the kernel only the live rows are computed (finished rows cost nothing): li, None when all are live.
        li = None if bool(live.all()) else torch.nonzero(live).squeeze(1)
        if kd is not None:  # prev's own column is masked when invalid: its output is unused either way
            dl = kd[0].block_step(_take(torch.stack([prev, pending], 1), li), _take(n - 1, li), col, li,
                                  head=bool(kr))  # a plain step only caches the tokens: no output layer
            drafts = [_greedy(dl[:, -1], sampling)] if kr else []
            for j in range(1, kr):
                drafts.append(_greedy(kd[1].block_step(drafts[-1][:, None], _take(n + j, li), col + j + 1, li)[:, -1],
                                      sampling))
            if li is not None:  # back to [B]: a finished row's drafts are never read
                drafts = [_put(x, li, b) for x in drafts]
        else:
            m2 = valid_d[:, None, : col + 2].repeat(1, 2, 1)
            m2[:, 0, col], m2[:, 0, col + 1] = True, False
            dl = model.forward(draft_params, draft_cfg, torch.stack([prev, pending], 1),
                               torch.stack([pos - 1, pos], 1).clamp(min=0), m2, cache_d, col, ops_cfg=draft_ops_cfg)
            drafts = [_greedy(dl[:, -1], sampling)] if kr else []
            for j in range(1, kr):
                dl = model.forward(draft_params, draft_cfg, drafts[-1][:, None], (pos + j)[:, None],
                                   valid_d[:, None, : col + j + 2], cache_d, col + j + 1, ops_cfg=draft_ops_cfg)
                drafts.append(_greedy(dl[:, -1], sampling))
        d = torch.stack(drafts, 1) if kr else no_drafts  # [B, kr]

        # Verify: [pending, d_1..d_kr] at columns col..col+kr, causal within the block.
        block = torch.cat([pending[:, None], d], 1)
        sp = span[: kr + 1]
        if kt is not None:
            valid_t[:, col : col + kr + 1] = True  # the kernel's query j sees columns ..col+j: causal
            z = kt[0 if kr else 1].block_step(_take(block, li), _take(n - 1, li), col, li)
        else:
            mask = torch.cat([valid_t[:, None, :col].expand(b, kr + 1, col),
                              causal_blk[None, : kr + 1, : kr + 1].expand(b, kr + 1, kr + 1)], -1)
            z = model.forward(params, cfg, block, pos[:, None] + sp[None], mask, cache_t, col, ops_cfg=ops_cfg)
        idx = n[:, None] + sp[None]  # [B, kr+1]: the emitted index each verify column would take
        uv = None if u is None else u[idx, rows[:, None]]
        if li is None or kt is None:
            s, slp, a = verify(z, d, uv, sampling, ops_cfg, kernel_sampler)
        else:  # the live rows' verify, scattered back to [B] (finished rows: zeros, never emitted)
            live_out = verify(z, d[li], None if uv is None else uv[li], sampling, ops_cfg, kernel_sampler)
            s, slp, a = (_put(x, li, b) for x in live_out)
        m = torch.minimum(a + 1, n_new - n)  # tokens this round emits: s_0 .. s_a, capped
        hit = torch.isin(s, stop) & (sp[None] < m[:, None])
        if sampling.stop_token_ids:
            first_stop = torch.where(hit, sp[None], kr + 1).amin(1)
            m = torch.minimum(m, first_stop + 1)
        m = torch.where(live, m, 0)
        # Rows past their window are overwritten by their next round or cut by n below.
        out_tok.scatter_(1, idx, s)
        out_lp.scatter_(1, idx, slp)
        if kr:
            verifies += int(live.sum())
            emitted += int(m.sum())
            accepted_at += ((a[:, None] > torch.arange(k)[None]) & live[:, None]).sum(0)
            hist[rows, a] += live.long()
        else:
            plain += live.long()

        # Keep the columns of pending and the accepted drafts; the rest are invalid from now on.
        valid_t[:, col : col + k + 1] = (span[None] <= a[:, None]) & live[:, None]
        valid_d[:, col] &= live
        valid_d[:, col + 1] = live
        valid_d[:, col + 2 : col + k + 1] = (torch.arange(1, k)[None] <= a[:, None]) & live[:, None]
        pending = torch.where(live, s[rows, a], pending)
        # d_k never went through the draft (after a plain step nothing is pending for it: a = 0 < k)
        prev, prev_valid = (d[:, k - 1] if kr else pending), live & (a == k)
        n = n + m
        done = done | (n >= n_new) | (hit.any(1) & live)
        col += (k if kr else 1) + 1  # a plain step uses 2 columns: the draft's [prev, pending], the target's first

    gen = _generation(out_tok, out_lp, n, sampling)
    return gen, SpecStats(verifies, emitted, tuple(int(x) for x in accepted_at.tolist()),
                          tuple(tuple(h) for h in hist.tolist()), tuple(plain.tolist()))


def _generation(out_tok: torch.Tensor, out_lp: torch.Tensor, n_out: torch.Tensor, sampling: SamplingConfig
                ) -> Generation:
    counts, all_tok, all_lp = n_out.tolist(), out_tok.tolist(), out_lp.tolist()
    tokens = [row[:c] for row, c in zip(all_tok, counts, strict=True)]
    logprobs = [row[:c] for row, c in zip(all_lp, counts, strict=True)]
    stops = set(sampling.stop_token_ids)
    return Generation(tokens, logprobs, ["stop" if t and t[-1] in stops else "length" for t in tokens])
