"""True on-policy: under ops.INVARIANT the engine's log-probs are the trainer's, bit for bit.

The property is drawn by hypothesis over batch compositions: the engine decodes a target
request with a KV cache alone, among 3 or among 16 mixed-length requests (left-padded,
finishing at different steps); the trainer scores the finished sequence alone, right-padded
among others, or packed into one row with others (segment ids, positions restarting).
"""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ops
from miles_fn import model, prng
from miles_fn.config import ModelConfig
from miles_fn.generate import generate
from miles_fn.sampling import SamplingConfig
from state import hf

CFG = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_position_embeddings=64)
PARAMS = model.init_params(CFG, prng.key(0), std=0.3)
# Small tiles and key blocks, so that every call spans several GEMM tiles and several key blocks.
INV = ops.OpsConfig(mode="invariant", tile_rows=8, kv_block=4)
SAMPLING = SamplingConfig(temperature=0.9, max_new_tokens=6, stop_token_ids=(7,))
TARGET_ID = 1000  # the target's key stream, whatever its place in a batch

tokens_st = st.lists(st.integers(1, CFG.vocab_size - 1), min_size=1, max_size=10)


def engine(prompt, others, batch, at, oc):
    prompts = list(others[: batch - 1])
    prompts.insert(min(at, len(prompts)), prompt)
    ids = [TARGET_ID if p is prompt else i for i, p in enumerate(prompts)]
    gen = generate(PARAMS, CFG, prompts, prng.key(5), SAMPLING, request_ids=ids, ops_cfg=oc)
    i = ids.index(TARGET_ID)
    return gen.tokens[i], torch.tensor(gen.logprobs[i], dtype=torch.float32)


def trainer_rows(rows, oc):
    """rows: list of lists of sequences, each row packed from its sequences, right-padded."""
    t = max(sum(len(s) for s in r) for r in rows)
    tok = torch.zeros(len(rows), t, dtype=torch.int64)
    pos = torch.zeros(len(rows), t, dtype=torch.int64)
    seg = torch.zeros(len(rows), t, dtype=torch.int64)
    for i, r in enumerate(rows):
        c = 0
        for j, s in enumerate(r):
            tok[i, c : c + len(s)] = torch.tensor(s)
            pos[i, c : c + len(s)] = torch.arange(len(s))
            seg[i, c : c + len(s)] = j + 1
            c += len(s)
    with torch.no_grad():
        return model.sequence_logprobs(PARAMS, CFG, tok, pos, seg, SAMPLING.temperature, ops_cfg=oc)


def trainer(prompt, response, row_partners, packed_before, packed_after, oc):
    """The target's response log-probs as the trainer sees them, three ways."""
    seq = prompt + response
    n0, n1 = len(prompt) - 1, len(seq) - 1
    alone = trainer_rows([[seq]], oc)[0, n0:n1]
    padded = trainer_rows([[p] for p in row_partners[:2]] + [[seq]] + [[p] for p in row_partners[2:]], oc)
    padded = padded[min(2, len(row_partners)), n0:n1]
    off = sum(len(s) for s in packed_before)
    packed = trainer_rows([[*packed_before, seq, *packed_after], row_partners[:1] or [[1]]], oc)[0, off + n0 : off + n1]
    return alone, padded, packed


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=tokens_st, others=st.lists(tokens_st, min_size=15, max_size=15), at=st.integers(0, 15),
       partners=st.lists(tokens_st, min_size=0, max_size=4), before=st.lists(tokens_st, max_size=2),
       after=st.lists(tokens_st, max_size=2))
def test_invariant_logprobs_are_bitwise_equal_across_batches_cache_padding_and_packing(
        prompt, others, at, partners, before, after):
    runs = {b: engine(prompt, others, b, at, INV) for b in (1, 3, 16)}
    response, lp = runs[1]
    for b, (toks, lps) in runs.items():
        assert toks == response, f"batch {b} sampled other tokens"
        assert torch.equal(lps, lp), f"engine log-probs in a batch of {b} differ from a batch of 1"
    got_all = trainer(prompt, response, partners, before, after, INV)
    for name, got in zip(("alone", "padded", "packed"), got_all, strict=True):
        assert torch.equal(got, lp), f"trainer ({name}) differs from the engine by {(got - lp).abs().max()}"


def test_reference_ops_are_not_invariant_so_the_property_can_fail():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 61, (int(n),), generator=g).tolist() for n in torch.randint(1, 11, (16,), generator=g)]
    diffs = []
    for oc in (ops.REFERENCE, INV):
        resp, lp1 = engine(prompts[0], prompts[1:], 1, 0, oc)
        _, lp16 = engine(prompts[0], prompts[1:], 16, 0, oc)
        alone, padded, packed = trainer(prompts[0], resp, prompts[1:4], prompts[4:5], prompts[5:6], oc)
        diffs.append(max(float((x - lp1).abs().max()) for x in (lp16, alone, padded, packed)))
    assert diffs[0] > 0.0, "reference kernels happened to be invariant here: the property test proves nothing"
    assert diffs[1] == 0.0


def test_invariant_forward_matches_transformers(hf_models):
    """Invariance is not bought with wrong numbers: the invariant forward against transformers' model."""
    ref_model, path = hf_models[("qwen2", False)]
    cfg, params = hf.load_hf(path)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (3, 12), generator=g)
    attn = torch.ones(3, 12, dtype=torch.int64)
    attn[1, 8:] = 0
    attn[2, 4:] = 0
    with torch.no_grad():
        ref = ref_model(input_ids=tokens, attention_mask=attn).logits
        ours = model.forward(params, cfg, tokens, torch.arange(12).expand(3, 12), model.causal_segment_mask(attn),
                             ops_cfg=INV)
    valid = attn.bool()
    assert ref.abs()[valid].max() > 1.0
    assert (ours - ref).abs()[valid].max().item() <= 1e-4
