"""AdamW, clipping and schedules against torch.optim and hand-computed values."""

import math

import pytest
import torch

from miles_fn import optim


def _tree(g):
    return {"w": torch.randn(6, 5, generator=g, dtype=torch.float64).float(),
            "layers": [{"b": torch.randn(5, generator=g)}, {"b": torch.randn(3, generator=g)}]}


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_ten_steps_match_torch_optim(wd):
    g = torch.Generator().manual_seed(0)
    params = _tree(g)
    flat = [params["w"], params["layers"][0]["b"], params["layers"][1]["b"]]
    ref = [p.clone().requires_grad_() for p in flat]
    cfg = optim.OptimConfig(lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=wd)
    torch_opt = torch.optim.AdamW(ref, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=wd)
    state = optim.adamw_init(params)
    for _ in range(10):
        grads = _tree(g)
        for r, gr in zip(ref, [grads["w"], grads["layers"][0]["b"], grads["layers"][1]["b"]]):
            r.grad = gr.clone()
        torch_opt.step()
        params, state = optim.adamw_update(grads, state, params, cfg, cfg.lr)
    ours = [params["w"], params["layers"][0]["b"], params["layers"][1]["b"]]
    for a, b in zip(ours, ref):
        assert (a - b.detach()).abs().max().item() <= 1e-6
    assert int(state.count) == 10


def test_adamw_update_does_not_mutate_inputs():
    params = {"w": torch.ones(3)}
    state = optim.adamw_init(params)
    grads = {"w": torch.ones(3)}
    new, new_state = optim.adamw_update(grads, state, params, optim.OptimConfig(), 0.1)
    assert torch.equal(params["w"], torch.ones(3)) and torch.equal(state.mu["w"], torch.zeros(3))
    assert not torch.equal(new["w"], params["w"]) and int(new_state.count) == 1


def test_clip_by_global_norm_matches_torch():
    g = torch.Generator().manual_seed(1)
    grads = _tree(g)
    flat = [grads["w"].clone(), grads["layers"][0]["b"].clone(), grads["layers"][1]["b"].clone()]
    hand = math.sqrt(sum(float((x.double() ** 2).sum()) for x in flat))
    ps = [torch.zeros_like(x, requires_grad=True) for x in flat]
    for p, x in zip(ps, flat):
        p.grad = x
    ref_norm = torch.nn.utils.clip_grad_norm_(ps, 0.5)
    clipped, norm = optim.clip_by_global_norm(grads, 0.5)
    assert math.isclose(float(norm), float(ref_norm), rel_tol=1e-6)
    assert torch.allclose(clipped["w"], ps[0].grad, atol=1e-7)
    assert math.isclose(float(norm), hand, rel_tol=1e-6)
    same, _ = optim.clip_by_global_norm(grads, 1e9)
    assert torch.equal(same["w"], grads["w"])


def test_warmup_cosine_schedule_values():
    cfg = optim.OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=10)
    assert [optim.lr_at(cfg, s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert optim.lr_at(cfg, 4) == 1.0
    assert math.isclose(optim.lr_at(cfg, 9), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert math.isclose(optim.lr_at(cfg, 14), 0.1) and math.isclose(optim.lr_at(cfg, 100), 0.1)
    assert optim.lr_at(optim.OptimConfig(lr=0.3), 1000) == 0.3


def test_warmup_linear_schedule_values():
    cfg = optim.OptimConfig(lr=1.0, min_lr=0.2, warmup_steps=2, decay_steps=8, decay="linear")
    # p = (s - 2) / 8: 1.0 at s=2, 0.6 at s=6 (halfway), 0.2 from s=10 on
    got = [optim.lr_at(cfg, s) for s in (0, 1, 2, 6, 10, 50)]
    assert all(math.isclose(a, b) for a, b in zip(got, [0.5, 1.0, 1.0, 0.6, 0.2, 0.2], strict=True)), got
    with pytest.raises(ValueError, match="'cosine' or 'linear'"):
        optim.lr_at(optim.OptimConfig(decay_steps=4, decay="step"), 1)


def test_schedule_start_offsets_the_schedule():
    cfg = optim.OptimConfig(lr=1.0, warmup_steps=2, schedule_start=10)
    assert [optim.lr_at(cfg, s) for s in (10, 11, 12)] == [0.5, 1.0, 1.0]


@pytest.mark.parametrize("warmup", [0, 2])
def test_schedule_refuses_steps_before_its_start(warmup):
    cfg = optim.OptimConfig(lr=1.0, warmup_steps=warmup, schedule_start=10)
    with pytest.raises(ValueError, match="before its start at step 10"):
        optim.lr_at(cfg, 9)
