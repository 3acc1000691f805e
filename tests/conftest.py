import os

import pytest
import torch

torch.set_num_threads(2)


def _randomise(m: torch.nn.Module, seed: int) -> None:
    """Weights large enough that layers matter (the default init leaves logits near-uniform)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def make_hf_model(arch: str, tie: bool, tmp: str, seed: int = 0, **overrides):
    import transformers

    common = dict(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tie, rope_theta=10000.0)
    common.update(overrides)
    if arch == "qwen2":
        m = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    _randomise(m, seed)
    m.eval()
    path = os.path.join(tmp, f"{arch}-{'tied' if tie else 'untied'}")
    m.save_pretrained(path)
    return m, path


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("hf"))
    return {(a, t): make_hf_model(a, t, tmp) for a in ("qwen2", "llama") for t in (False, True)}
