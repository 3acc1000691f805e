"""A checkpoint whose vocabulary is padded past its tokenizer (Qwen2.5: 151,936 rows for 151,665 tokens, issue 16).

The extra rows are no tokens: they must never be sampled (the character tokenizer's decode raised IndexError on
one), while the reported log-probs stay the full-row ones the trainer recomputes.
"""

import json
import math
import os
import re

import pytest
import torch

import ops
from miles_fn import model, prng
from miles_fn.generate import generate
from miles_fn.sampling import SamplingConfig, sample_with_uniform
from ops import decode_cpu
from state import checkpoint, hf
from tests.conftest import make_hf_model
from tests.test_main import run_main

VOCAB, LIMIT = 61, 10  # model rows, real tokens
PROMPTS = [[3, 7, 1, 2, 9], [4], [8, 8, 1, 5]]


def _logits() -> torch.Tensor:
    """[4, 9] logits whose cut columns (5..8) are the largest: an uncut sampler picks them most of the time."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 9, generator=g, dtype=torch.float64)
    x[:, 5:] += 4.0
    return x


def _ref_pick(logits: torch.Tensor, u: float, t: float, limit: int, top_k: int = 0) -> int:
    """Inverse CDF over softmax(logits[:limit] / t) (top-k of those when top_k), a float64 loop."""
    row = [float(v) / t for v in logits[:limit]]
    if top_k:
        kth = sorted(row, reverse=True)[top_k - 1]
        row = [v if v >= kth else -math.inf for v in row]
    z = sum(math.exp(v) for v in row)
    acc = 0.0
    for i, v in enumerate(row):
        acc += math.exp(v) / z
        if acc > u:
            return i
    return limit - 1


def _ref_logprob(logits: torch.Tensor, tok: int, t: float) -> float:
    row = [float(v) / t for v in logits]
    m = max(row)
    return row[tok] - m - math.log(sum(math.exp(v - m) for v in row))


@pytest.mark.parametrize("top_k", [0, 3])
def test_cut_rows_are_never_picked_and_logprobs_are_the_full_rows(top_k):
    logits = _logits()
    u = torch.tensor([0.05, 0.4, 0.77, 0.99], dtype=torch.float64)
    t = 0.8
    tok, lp = sample_with_uniform(logits.float(), u, SamplingConfig(temperature=t, top_k=top_k, vocab_limit=5))
    for r in range(4):
        assert tok[r].item() == _ref_pick(logits[r], float(u[r]), t, 5, top_k)
        assert lp[r].item() == pytest.approx(_ref_logprob(logits[r], tok[r].item(), t), abs=1e-5)
    greedy, glp = sample_with_uniform(logits.float(), None, SamplingConfig(temperature=0, vocab_limit=5))
    assert greedy.tolist() == [max(range(5), key=lambda i, r=r: float(logits[r, i])) for r in range(4)]
    assert glp[0].item() == pytest.approx(_ref_logprob(logits[0], greedy[0].item(), 1.0), abs=1e-5)
    # without the cut the padded columns win: what the cut prevents
    assert (sample_with_uniform(logits.float(), None, SamplingConfig(temperature=0))[0] >= 5).all()
    # a limit of 0 or of at least the row's length cuts nothing, bit for bit
    plain = sample_with_uniform(logits.float(), u, SamplingConfig(temperature=t, top_k=top_k))
    for limit in (0, 9, 20):
        same = sample_with_uniform(logits.float(), u, SamplingConfig(temperature=t, top_k=top_k, vocab_limit=limit))
        assert torch.equal(same[0], plain[0]) and torch.equal(same[1], plain[1])
    with pytest.raises(ValueError, match="vocab_limit"):
        SamplingConfig(vocab_limit=-1)


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    _, path = make_hf_model("qwen2", False, str(tmp_path_factory.mktemp("padded")), seed=4, vocab_size=VOCAB,
                            max_position_embeddings=64)
    return path


def _decode_configs():
    cfgs = [("torch", ops.REFERENCE), ("invariant", ops.INVARIANT)]
    if not decode_cpu.status():
        cfgs.append(("cpu_kernel", ops.OpsConfig(decode_backend="cpu_kernel")))
    return cfgs


@pytest.mark.parametrize("name,ops_cfg", _decode_configs())
def test_generate_never_samples_a_padded_row_on_any_decode_path(padded, name, ops_cfg):
    cfg, params = hf.load_hf(padded)
    assert cfg.vocab_size == VOCAB
    for temp in (1.0, 0.0):
        uncut = generate(params, cfg, PROMPTS, prng.key(1), SamplingConfig(temperature=temp, max_new_tokens=8),
                         ops_cfg=ops_cfg)
        assert max(max(t) for t in uncut.tokens) >= LIMIT  # the padded rows are likely without the cut
        sc = SamplingConfig(temperature=temp, max_new_tokens=8, vocab_limit=LIMIT)
        gen = generate(params, cfg, PROMPTS, prng.key(1), sc, ops_cfg=ops_cfg)
        assert all(len(t) == 8 and max(t) < LIMIT for t in gen.tokens)
        # the trainer's full-sequence log-probs are the engine's: bit for bit under the invariant kernels
        for prompt, tokens, lps in zip(PROMPTS, gen.tokens, gen.logprobs, strict=True):
            seq = torch.tensor([prompt + tokens])
            n = seq.shape[1]
            full = model.sequence_logprobs(params, cfg, seq, torch.arange(n)[None], torch.ones(1, n, dtype=torch.long),
                                           sc.logprob_temperature, ops_cfg=ops_cfg)[0, len(prompt) - 1:]
            if ops_cfg.invariant:
                assert torch.equal(full, torch.tensor(lps))
            else:
                torch.testing.assert_close(full, torch.tensor(lps), atol=1e-4, rtol=0)


def _responses(root: str, step: int) -> list[list[int]]:
    buf = checkpoint.load(os.path.join(root, f"step_{step:08d}")).tree["buffer"]
    return [[t for t, m in zip(row[1:], mask, strict=True) if m]
            for row, mask in zip(buf.tokens.tolist(), buf.loss_mask.tolist(), strict=True)]


def test_main_with_a_padded_checkpoint_samples_only_tokenizer_ids(padded, tmp_path):
    base = ["--num_steps=1", "--sft_warmup_steps=0", "--eval_size=4", "--prompts_per_step=2", "--group_size=4",
            "--noprogress", "--notensorboard", "--num_threads=1", "--debug_rollout_only"]
    # the built-in task's character tokenizer (48 ids) with a 61-row checkpoint: greedy evaluation and sampled
    # rollouts (IndexError in CharTokenizer.decode before)
    p = run_main(*base, f"--hf_checkpoint={padded}", f"--output_dir={tmp_path / 'a'}",
                 f"--save_rollouts={tmp_path / 'a' / 'r'}", timeout=120)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    got = _responses(str(tmp_path / "a" / "r"), 1)
    assert all(r and max(r) < 48 for r in got)
    # --prompt_data with the checkpoint's own Hugging Face tokenizer of 12 words (13 tokens with the pad token
    # transformers adds): the rows past its length are padding
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    chars = ["<unk>", "1", "2", "3", "+", "=", "a", "b", "c", "d", "<s>", "</s>"]
    t = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    ckpt = tmp_path / "ckpt"
    os.makedirs(ckpt)
    for f in os.listdir(padded):
        os.symlink(os.path.join(padded, f), ckpt / f)
    PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        ckpt)
    d = tmp_path / "d.jsonl"
    d.write_text("".join(json.dumps({"input": q, "label": "3"}) + "\n" for q in ("1+2=", "2+1=")))
    p = run_main(*base, f"--hf_checkpoint={ckpt}", f"--prompt_data={d}", "--max_new_tokens=12",
                 f"--output_dir={tmp_path / 'b'}", f"--save_rollouts={tmp_path / 'b' / 'r'}", timeout=120)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    n_tok = len(AutoTokenizer.from_pretrained(ckpt))
    assert n_tok < VOCAB
    got = _responses(str(tmp_path / "b" / "r"), 1)
    assert all(r and max(r) < n_tok for r in got)


def test_a_started_rollout_server_never_samples_a_padded_row(padded, tmp_path):
    """--rollout_backend=http: the server this run starts gets --vocab-limit (the character tokenizer's length)."""
    p = run_main("--num_steps=1", "--sft_warmup_steps=0", "--eval_size=4", "--prompts_per_step=2", "--group_size=4",
                 "--noprogress", "--notensorboard", "--num_threads=1", "--debug_rollout_only", "--rollout_backend=http",
                 f"--hf_checkpoint={padded}", f"--output_dir={tmp_path}", f"--save_rollouts={tmp_path / 'r'}",
                 timeout=180)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    limit = int(re.search(r"--vocab-limit (\d+)", (tmp_path / "rollout_server.log").read_text()).group(1))
    assert 0 < limit < VOCAB
    assert all(r and max(r) < limit for r in _responses(str(tmp_path / "r"), 1))
