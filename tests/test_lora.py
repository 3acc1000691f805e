"""LoRA (miles_fn/lora.py) against peft's LoRA on transformers' model with the same weights, and in the main job."""

import copy
import json
import os
import subprocess
import sys

import peft
import pytest
import torch
import transformers

from miles_fn import lora, model, prng, train
from state import hf
from tests.conftest import make_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HF_NAMES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
            "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
# (arch, targets): Llama on every linear, Qwen2 (q/k/v biases) on a subset, named as peft names them
CASES = [("llama", "q,k,v,o,gate,up,down"), ("qwen2", "q_proj,v_proj,down_proj")]


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("lora_hf"))
    out = {}
    for arch, _ in CASES:
        ref, path = make_hf_model(arch, False, tmp)
        out[arch] = (ref, path, *hf.load_hf(path))
    return out


def _batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (3, 12), generator=g)
    attn = torch.ones(3, 12, dtype=torch.int64)
    attn[1, 8:] = 0
    attn[2, 4:] = 0
    return tokens, attn


def _nonzero_adapters(params, cfg, seed=7):
    """Adapters from lora.init_adapters with B drawn too (B = 0 would make the LoRA path invisible)."""
    ad = lora.init_adapters(params, cfg, prng.key(seed))
    g = torch.Generator().manual_seed(seed)
    for layer in ad["layers"]:
        for ab in layer.values():
            ab["b"] = torch.randn(ab["b"].shape, generator=g) * 0.1
    return ad


def _peft_model(ref, cfg, adapters):
    """peft's LoRA on a copy of transformers' model, with our A and B copied into its lora_A / lora_B."""
    pcfg = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.0,
                           target_modules=[HF_NAMES[w].split(".")[-1] for w in adapters["layers"][0]])
    pm = peft.get_peft_model(copy.deepcopy(ref), pcfg)
    mods = dict(pm.named_modules())
    with torch.no_grad():
        for i, layer in enumerate(adapters["layers"]):
            for name, ab in layer.items():
                m = mods[f"base_model.model.model.layers.{i}.{HF_NAMES[name]}"]
                m.lora_A["default"].weight.copy_(ab["a"])
                m.lora_B["default"].weight.copy_(ab["b"])
    return pm.eval()


def _logprob_loss(mcfg, tokens, attn):
    mask = attn[:, 1:].float()

    def loss_fn(params, batch, key):
        lp = model.sequence_logprobs(params, mcfg, tokens, torch.arange(12).expand(3, 12), attn)
        return -(lp * mask).sum() / mask.sum(), {}

    return loss_fn


def _hf_loss(m, tokens, attn):
    logits = m(input_ids=tokens, attention_mask=attn).logits[:, :-1]
    lp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    mask = attn[:, 1:].float()
    return -(lp * mask).sum() / mask.sum()


def test_merge_is_w_plus_scaled_ba_by_hand():
    w = torch.tensor([[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]])
    base = {"embed": torch.zeros(1), "layers": [{"wq": w, "bq": torch.ones(2)}]}
    ad = {"layers": [{"wq": {"a": torch.tensor([[1.0, 2.0, 3.0]]), "b": torch.tensor([[1.0], [-2.0]])}}]}
    cfg = lora.LoraConfig(rank=1, alpha=2.0, targets=("q",))
    out = lora.merge(base, ad, cfg)
    # B @ A = [[1, 2, 3], [-2, -4, -6]], times alpha / r = 2
    assert torch.equal(out["layers"][0]["wq"], torch.tensor([[3.0, 4.0, 5.0], [-3.5, -6.0, -12.0]]))
    assert out["layers"][0]["bq"] is base["layers"][0]["bq"] and out["embed"] is base["embed"]
    assert torch.equal(base["layers"][0]["wq"], w)  # the base is not written


def test_parse_targets_accepts_peft_names_and_names_unknown_ones():
    assert lora.parse_targets("v_proj, q,down") == ("q", "v", "down")
    with pytest.raises(ValueError, match="qkv"):
        lora.parse_targets("q,qkv")
    with pytest.raises(ValueError):
        lora.parse_targets("")


def test_init_is_peft_kaiming_bound_b_zero_and_step0_equals_base(bases):
    _, _, mcfg, params = bases["llama"]
    cfg = lora.LoraConfig(rank=4, alpha=8.0)
    ad = lora.init_adapters(params, cfg, prng.key(3))
    a = ad["layers"][0]["w_down"]["a"]
    bound = 1.0 / mcfg.intermediate_size ** 0.5  # kaiming_uniform(a=sqrt(5)) on [r, in] is U(-1/sqrt(in), 1/sqrt(in))
    assert a.shape == (4, mcfg.intermediate_size) and a.abs().max() <= bound and a.abs().max() > 0.9 * bound
    assert a.std() > 0.5 * bound / 3 ** 0.5
    assert torch.equal(a, lora.init_adapters(params, cfg, prng.key(3))["layers"][0]["w_down"]["a"])
    assert not torch.equal(a, lora.init_adapters(params, cfg, prng.key(4))["layers"][0]["w_down"]["a"])
    assert all(float(ab["b"].abs().max()) == 0.0 for layer in ad["layers"] for ab in layer.values())
    merged = lora.merge(params, ad, cfg)
    for (pa, x), (pb, y) in zip(*(model_leaves(t) for t in (params, merged)), strict=True):
        assert pa == pb and torch.equal(x, y), pa
    tokens, attn = _batch(mcfg.vocab_size)
    pos, mask = torch.arange(12).expand(3, 12), model.causal_segment_mask(attn)
    assert torch.equal(model.forward(merged, mcfg, tokens, pos, mask), model.forward(params, mcfg, tokens, pos, mask))


def model_leaves(tree):
    from state.tree import path_name, tree_flatten_with_path

    paths, leaves, _ = tree_flatten_with_path(tree)
    return [(path_name(p), x) for p, x in zip(paths, leaves, strict=True)]


@pytest.mark.parametrize("arch,targets", CASES)
def test_forward_matches_peft(bases, arch, targets):
    ref, _, mcfg, params = bases[arch]
    cfg = lora.LoraConfig(rank=4, alpha=8.0, targets=lora.parse_targets(targets))
    ad = _nonzero_adapters(params, cfg)
    pm = _peft_model(ref, cfg, ad)
    tokens, attn = _batch(mcfg.vocab_size)
    pos, mask = torch.arange(12).expand(3, 12), model.causal_segment_mask(attn)
    with torch.no_grad():
        theirs, theirs_base = pm(input_ids=tokens, attention_mask=attn).logits, ref(input_ids=tokens,
                                                                                   attention_mask=attn).logits
    ours = model.forward(lora.merge(params, ad, cfg), mcfg, tokens, pos, mask)
    valid = attn.bool()
    change = (theirs - theirs_base).abs()[valid]
    assert change.max() > 0.1  # the adapters move the logits
    # logits up to ~5: 1e-5 is a few float32 ulps (measured 4.9e-6 Llama, 3.6e-6 Qwen2); peft adds x A^T B^T
    # after the base linear, we fold B A into W first
    assert (ours - theirs).abs()[valid].max() <= 1e-5


@pytest.mark.parametrize("arch,targets", CASES)
def test_gradients_reach_only_the_adapters_and_match_peft(bases, arch, targets):
    ref, _, mcfg, params = bases[arch]
    cfg = lora.LoraConfig(rank=4, alpha=8.0, targets=lora.parse_targets(targets))
    ad = _nonzero_adapters(params, cfg)
    tokens, attn = _batch(mcfg.vocab_size)
    loss_fn = lora.adapted_loss(_logprob_loss(mcfg, tokens, attn), params, cfg)
    grads, (loss, _) = train.loss_and_grad(ad, None, prng.key(0), loss_fn)
    assert all(not x.requires_grad and x.grad is None for _, x in model_leaves(params))  # the base took no graph
    pm = _peft_model(ref, cfg, ad)
    peft_loss = _hf_loss(pm, tokens, attn)
    peft_loss.backward()
    assert abs(float(loss) - float(peft_loss)) <= 1e-5
    mods = dict(pm.named_modules())
    assert {n for n, p in pm.named_parameters() if p.requires_grad} == {
        f"base_model.model.model.layers.{i}.{HF_NAMES[w]}.lora_{x}.default.weight"
        for i in range(mcfg.num_layers) for w in ad["layers"][0] for x in "AB"}
    assert [sorted(layer) for layer in grads["layers"]] == [sorted(layer) for layer in ad["layers"]]
    assert set(grads) == {"layers"}  # no gradient tree for embeddings, norms, biases or head
    for i, layer in enumerate(grads["layers"]):
        for name, g in layer.items():
            m = mods[f"base_model.model.model.layers.{i}.{HF_NAMES[name]}"]
            for part, key in (("a", "lora_A"), ("b", "lora_B")):
                ref_g = getattr(m, key)["default"].weight.grad
                assert ref_g.abs().max() > 1e-4, (i, name, part)
                assert torch.allclose(g[part], ref_g, atol=1e-5, rtol=1e-4), (i, name, part)


def test_merged_export_and_peft_adapter_export_load_in_transformers(bases, tmp_path):
    ref, path, mcfg, params = bases["qwen2"]
    cfg = lora.LoraConfig(rank=4, alpha=8.0, targets=lora.parse_targets("q,v,up"))
    ad = _nonzero_adapters(params, cfg)
    state = lora.init_state(params, cfg, prng.key(1), prng.key(0))._replace(params=ad)
    tokens, attn = _batch(mcfg.vocab_size)
    with torch.no_grad():
        expected = _peft_model(ref, cfg, ad)(input_ids=tokens, attention_mask=attn).logits
    hf.save_hf(str(tmp_path / "merged"), mcfg, lora.model_params(state, cfg))
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    hf.save_peft_adapter(str(tmp_path / "adapter"), ad, cfg, base_model=path)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"] == [
        "q_proj", "up_proj", "v_proj"]
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(ref), str(tmp_path / "adapter")).eval()
    valid = attn.bool()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens, attention_mask=attn).logits, expected)
        assert (merged(input_ids=tokens, attention_mask=attn).logits - expected).abs()[valid].max() <= 1e-5


# ---- the main job with --lora_rank (tests/test_determinism.py's tiny job: 2 SFT + 4 RL steps, KL to the reference)

TINY = ["--num_steps=4", "--sft_warmup_steps=2", "--save_every=2", "--eval_every=2", "--eval_size=8",
        "--prompts_per_step=4", "--group_size=2", "--hidden_size=32", "--intermediate_size=48", "--kl_coef=0.5",
        "--num_threads=1", "--noprogress", "--notensorboard"]
LORA = ["--lora_rank=2", "--lora_alpha=4", "--lora_targets=q_proj,v,o,gate,up,down"]


def _run(module, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _hash(p) -> str:
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.split("state_hash=")[1].split()[0]


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run"
    return out, _hash(_run("launch.main", *TINY, *LORA, f"--output_dir={out}", "--snapshot_steps=3"))


def test_lora_run_trains_only_adapters_on_an_unchanged_base(lora_run, tmp_path):
    from miles_fn.config import ModelConfig
    from state import checkpoint, snapshot
    from state.tree import tree_leaves

    out, _ = lora_run
    ck = checkpoint.load(checkpoint.latest(str(out / "checkpoints"))).tree
    st = ck["state"]
    assert int(st.step) == 6 and st.base is None  # the base is not saved
    layers = st.params["layers"]
    assert len(layers) == 2 and all(sorted(layer) == ["w_down", "w_gate", "w_up", "wo", "wq", "wv"] for layer in layers)
    assert layers[0]["wq"]["a"].shape == (2, 32) and layers[0]["w_down"]["b"].shape == (32, 2)
    assert all(float(ab["b"].abs().max()) > 0 for layer in layers for ab in layer.values())  # B left 0: trained
    shapes = [tuple(x.shape) for x in tree_leaves(st.params)]
    assert [tuple(x.shape) for x in tree_leaves(st.opt_state.mu)] == shapes  # AdamW moments: the adapters only
    assert [tuple(x.shape) for x in tree_leaves(st.opt_state.nu)] == shapes
    assert [tuple(x.shape) for x in tree_leaves(ck["ref_params"])] == shapes  # the KL reference: adapters too
    warm = checkpoint.load(str(out / "checkpoints" / "step_00000002")).tree["state"].params
    assert not any(torch.equal(x, y) for x, y in zip(tree_leaves(warm), tree_leaves(st.params), strict=True))
    # the snapshot of RL step 3 holds the whole state: its base is the seed's random init, untouched by 4 updates
    snap = snapshot.load(str(out / "snapshots" / "rl_00000003"))
    cfg = ModelConfig(**snap.info["model"])
    init = model.init_params(cfg, prng.fold_in(prng.key(0), 0x1417), 0.02)  # launch.main's INIT_STREAM
    assert [torch.equal(x, y) for x, y in zip(tree_leaves(snap.state.base), tree_leaves(init), strict=True)] == [
        True] * len(tree_leaves(init))
    # and the replay of that step, which rebuilds the LoRA step from the flags, matches bit for bit
    p = _run("launch.replay", f"--snapshot={out / 'snapshots' / 'rl_00000003'}")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    # a full fine-tune of the same job writes a checkpoint several times the size
    full = tmp_path / "full"
    p = _run("launch.main", *[a for a in TINY if not a.startswith("--num_steps")], "--num_steps=0",
             f"--output_dir={full}")
    assert p.returncode == 0, p.stderr[-2000:]
    size = lambda d: (d / "tensors.safetensors").stat().st_size  # noqa: E731
    lora_bytes, full_bytes = size(out / "checkpoints" / "step_00000006"), size(full / "checkpoints" / "step_00000002")
    assert lora_bytes * 4 < full_bytes, (lora_bytes, full_bytes)


def test_lora_resume_equals_the_straight_run(lora_run, tmp_path):
    out, straight = lora_run
    mine = tmp_path / "run"
    first = [a for a in TINY if not a.startswith("--num_steps")]
    p = _run("launch.main", *first, *LORA, "--num_steps=2", f"--output_dir={mine}")
    assert p.returncode == 0, p.stderr[-2000:]
    p = _run("launch.main", *first, *LORA, "--num_steps=4", f"--output_dir={mine}", "--resume")
    assert "resumed from" in p.stderr and _hash(p) == straight
    drop = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]  # noqa: E731
    assert drop(_metrics(mine)) == drop(_metrics(out))


def test_lora_true_on_policy_mismatch_is_exactly_zero(tmp_path):
    # with --kl_coef every row trains (none is skipped), so the mismatch is over the whole batch
    p = _run("launch.main", *TINY, "--num_steps=3", *LORA, "--true_on_policy", f"--output_dir={tmp_path}")
    assert p.returncode == 0, p.stderr[-2000:]
    rows = _metrics(tmp_path)
    assert len(rows) == 3
    assert all(r[k] == 0.0 for r in rows for k in ("mismatch_mean", "mismatch_max", "mismatch_k3"))


@pytest.mark.parametrize("args,needle", [(["--lora_targets=q,qkv"], "--lora_targets"),
                                         (["--lora_rank=2", "--advantage_estimator=gae"], "--lora_rank")])
def test_bad_lora_flags_are_named(tmp_path, args, needle):
    p = _run("launch.main", *args, f"--output_dir={tmp_path}", timeout=60)
    assert p.returncode != 0 and needle in p.stderr, p.stderr[-2000:]
