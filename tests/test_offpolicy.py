"""Off-policy corrections and the mismatch metric, against hand-computed values."""

import math

import pytest
import torch
from torch.func import grad

from miles_fn import model, offpolicy, prng, train
from miles_fn.config import ModelConfig
from state.train_state import RolloutBuffer

# pi_train / pi_engine = 2, 0.5, 3 on three trained tokens; a fourth, masked token carries garbage.
TRAIN = torch.log(torch.tensor([[0.5, 0.2, 0.9, 0.5]]))
ENGINE = torch.log(torch.tensor([[0.25, 0.4, 0.3, 1e-30]]))
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])


def test_tis_truncates_the_ratio_at_the_cap():
    w = offpolicy.tis_weights(TRAIN, ENGINE, MASK, cap=2.5)
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 2.5, 0.0]]))
    w = offpolicy.tis_weights(TRAIN, ENGINE, MASK, cap=1.0)
    assert torch.allclose(w, torch.tensor([[1.0, 0.5, 1.0, 0.0]]))


def test_mis_masks_tokens_outside_the_band():
    w = offpolicy.mis_weights(TRAIN, ENGINE, MASK, low=0.6, high=2.5)
    assert torch.allclose(w, torch.tensor([[2.0, 0.0, 0.0, 0.0]]))
    w, aux = offpolicy.importance_weights(TRAIN, ENGINE, MASK, offpolicy.OffPolicyConfig("mis", mis_low=0.4,
                                                                                       mis_high=2.5))
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 0.0, 0.0]]))
    assert aux["is_kept_frac"].item() == pytest.approx(2 / 3)
    assert aux["is_weight_mean"].item() == pytest.approx(2.5 / 3)


def test_mismatch_metrics_hand_computed():
    m = offpolicy.mismatch_metrics(TRAIN, ENGINE, MASK)
    ln2, ln3 = math.log(2), math.log(3)
    assert m["mismatch_mean"].item() == pytest.approx((2 * ln2 + ln3) / 3, rel=1e-6)
    assert m["mismatch_max"].item() == pytest.approx(ln3, rel=1e-6)
    k3 = ((2 - 1 - ln2) + (0.5 - 1 + ln2) + (3 - 1 - ln3)) / 3
    assert m["mismatch_k3"].item() == pytest.approx(k3, rel=1e-6)
    zero = offpolicy.mismatch_metrics(TRAIN, TRAIN, MASK)
    assert all(v.item() == 0.0 for v in zero.values())


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="bogus"):
        offpolicy.OffPolicyConfig("bogus")
    with pytest.raises(ValueError, match="mis_low"):
        offpolicy.OffPolicyConfig("mis", mis_low=1.5)


def _batch(cfg, params):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, cfg.vocab_size, (3, 7), generator=g)
    positions = torch.arange(7).expand(3, 7)
    seg = torch.ones(3, 7, dtype=torch.int64)
    mask = torch.zeros(3, 6)
    mask[:, 3:] = 1.0
    mask[2, 5] = 0.0
    with torch.no_grad():
        logp = model.sequence_logprobs(params, cfg, tokens, positions, seg)
    engine = logp + 0.6 * torch.randn(3, 6, generator=g)  # a far-off engine
    adv = torch.randn(3, 6, generator=g)
    return RolloutBuffer(tokens, positions, seg, mask, engine, adv, torch.zeros(3), torch.arange(3)), logp


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_grpo_loss_with_correction_is_the_weighted_policy_gradient(correction):
    cfg = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1)
    params = model.init_params(cfg, prng.key(0), std=0.5)
    batch, logp = _batch(cfg, params)
    oc = offpolicy.OffPolicyConfig(correction, tis_cap=1.5, mis_low=0.7, mis_high=1.4)
    ratio = torch.exp(logp - batch.old_logprobs)
    w = torch.clamp(ratio, max=1.5) if correction == "tis" else ratio * ((ratio >= 0.7) & (ratio <= 1.4))
    w = w * batch.loss_mask
    assert bool((ratio * batch.loss_mask > 1.5).any())  # the cap binds somewhere
    assert 0 < int((w > 0).sum()) < int(batch.loss_mask.sum()) or correction == "tis"
    loss_fn = train.make_grpo_loss(cfg, train.PolicyLossConfig(), offpolicy_cfg=oc)
    loss, aux = loss_fn(params, batch, prng.key(0))
    m = batch.loss_mask
    assert loss.item() == pytest.approx(float(-(m * batch.advantages * w).sum() / m.sum()), rel=1e-5)

    def surrogate(p):  # -mean(w A log pi), w constant: the gradient the corrected loss must have
        lp = model.sequence_logprobs(p, cfg, batch.tokens, batch.positions, batch.segment_ids)
        return -(m * batch.advantages * w * lp).sum() / m.sum()

    ga = grad(lambda p: loss_fn(p, batch, prng.key(0))[0])(params)
    gb = grad(surrogate)(params)
    assert torch.allclose(ga["embed"], gb["embed"], atol=1e-6)
    assert aux["mismatch_mean"].item() > 0.1


def test_grpo_loss_reports_mismatch_to_the_engine():
    cfg = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1)
    params = model.init_params(cfg, prng.key(0), std=0.5)
    batch, logp = _batch(cfg, params)
    _, aux = train.make_grpo_loss(cfg, train.PolicyLossConfig())(params, batch, prng.key(0))
    d = (logp - batch.old_logprobs).abs()[batch.loss_mask > 0]
    assert aux["mismatch_mean"].item() == pytest.approx(d.mean().item(), rel=1e-5)
    assert aux["mismatch_max"].item() == pytest.approx(d.max().item(), rel=1e-5)
