"""Our forward against transformers' own Qwen2/Llama on the same weights, and export back."""

import json
import os

import pytest
import torch
import transformers

from miles_fn import model
from state import hf

CASES = [("qwen2", False), ("qwen2", True), ("llama", False), ("llama", True)]


def _padded_batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (3, 12), generator=g)
    attn = torch.ones(3, 12, dtype=torch.int64)
    attn[1, 8:] = 0  # right padding
    attn[2, 4:] = 0
    return tokens, attn


@pytest.mark.parametrize("arch,tie", CASES)
def test_logits_match_transformers_on_padded_batch(hf_models, arch, tie):
    ref_model, path = hf_models[(arch, tie)]
    cfg, params = hf.load_hf(path)
    assert cfg.tie_word_embeddings == tie and ("lm_head" in params) == (not tie)
    tokens, attn = _padded_batch(cfg.vocab_size)
    with torch.no_grad():
        ref = ref_model(input_ids=tokens, attention_mask=attn).logits
    positions = torch.arange(12).expand(3, 12)
    ours = model.forward(params, cfg, tokens, positions, model.causal_segment_mask(attn))
    valid = attn.bool()
    assert ref.abs()[valid].max() > 1.0  # the weights give logits that are not flat
    assert (ours - ref).abs()[valid].max().item() <= 1e-4


@pytest.mark.parametrize("arch,tie", CASES)
def test_export_reloads_in_transformers_with_identical_logits(hf_models, tmp_path, arch, tie):
    ref_model, path = hf_models[(arch, tie)]
    cfg, params = hf.load_hf(path)
    out = str(tmp_path / "export")
    hf.save_hf(out, cfg, params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(ref_model)
    tokens, attn = _padded_batch(cfg.vocab_size)
    with torch.no_grad():
        a = ref_model(input_ids=tokens, attention_mask=attn).logits
        b = reloaded(input_ids=tokens, attention_mask=attn).logits
    assert torch.equal(a, b)


def test_left_padded_positions_match_transformers(hf_models):
    """Left padding with positions counted from the first real token, as the engine prefills."""
    ref_model, path = hf_models[("qwen2", False)]
    cfg, params = hf.load_hf(path)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    attn = torch.ones(2, 9, dtype=torch.int64)
    attn[1, :4] = 0
    positions = torch.clamp(torch.cumsum(attn, -1) - 1, min=0)
    with torch.no_grad():
        ref = ref_model(input_ids=tokens, attention_mask=attn, position_ids=positions).logits
    mask = (torch.tril(torch.ones(9, 9, dtype=torch.bool))[None] & attn.bool()[:, None, :]) | torch.eye(9).bool()
    ours = model.forward(params, cfg, tokens, positions, mask)
    assert (ours - ref).abs()[attn.bool()].max().item() <= 1e-4


def test_gradients_match_autograd_through_transformers(hf_models):
    """torch.func.grad over our params tree equals autograd through transformers' module."""
    ref_model, path = hf_models[("llama", False)]
    cfg, params = hf.load_hf(path)
    tokens, attn = _padded_batch(cfg.vocab_size)
    targets = tokens[:, 1:]
    mask = attn[:, 1:].float()

    def loss_ours(p):
        lp = model.sequence_logprobs(p, cfg, tokens, torch.arange(12).expand(3, 12), attn)
        return -(lp * mask).sum() / mask.sum()

    grads = torch.func.grad(loss_ours)(params)
    ref_model.zero_grad()
    logits = ref_model(input_ids=tokens, attention_mask=attn).logits[:, :-1]
    lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    (-(lp * mask).sum() / mask.sum()).backward()
    theirs = dict(ref_model.named_parameters())
    for name, where in hf.hf_names(cfg).items():
        g = grads
        for w in where:
            g = g[w]
        ref_g = theirs[name].grad
        assert torch.allclose(g, ref_g, atol=1e-5, rtol=1e-4), name


def test_unsupported_config_is_refused_by_name(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="gpt2"):
        hf.load_hf(str(d))
    cfg = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 2, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="yarn"):
        hf.load_hf(str(d))


def test_missing_and_misshapen_tensors_are_named(hf_models, tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = hf_models[("qwen2", False)]
    tensors = load_file(os.path.join(path, "model.safetensors"))
    out = tmp_path / "broken"
    out.mkdir()
    (out / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    bad = dict(tensors)
    del bad["model.layers.1.mlp.up_proj.weight"]
    save_file(bad, str(out / "model.safetensors"))
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        hf.load_hf(str(out))
    bad = dict(tensors)
    bad["model.norm.weight"] = torch.ones(3)
    save_file(bad, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight"):
        hf.load_hf(str(out))
