"""R3 (rollout routing replay): the engine's recorded experts drive the trainer's MoE layers.

The reference for "routes as recorded" is the engine's own record (generate's routed_experts);
the perturbed router is an independent second model whose own top-k differs.
"""

import optree
import pytest
import torch

import ops
from miles_fn import model, moe, prng, routing, train
from miles_fn.config import ModelConfig
from miles_fn.generate import generate
from miles_fn.rollout_buffer import build_rollout_buffer
from miles_fn.sampling import SamplingConfig

CFG = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=16, model_type="qwen3_moe", attention_bias=False, max_position_embeddings=64,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=(1,),
                  router_aux_loss_coef=0.01)
PARAMS = model.init_params(CFG, prng.key(0), std=0.3)
INV = ops.OpsConfig(mode="invariant", tile_rows=8, kv_block=4)
PROMPTS = [[3, 5, 7], [3, 5, 7], [11, 2, 9, 4, 1], [8]]


def _buffer(params, oc=ops.REFERENCE):
    gen = generate(params, CFG, PROMPTS, prng.key(1), SamplingConfig(temperature=1.0, max_new_tokens=5), ops_cfg=oc)
    buf = build_rollout_buffer(PROMPTS, gen.tokens, gen.logprobs, [1.0, 0.0, 1.0, 0.0], [0, 0, 1, 1])
    rec = routing.buffer_routes(gen.routed_experts, buf.loss_mask.shape[1], 2, 2)
    return buf._replace(routed_experts=rec)


def _perturbed():
    p = optree.tree_map(torch.clone, PARAMS)
    g = torch.Generator().manual_seed(7)
    for i in CFG.moe_layers:
        p["layers"][i]["router"] = p["layers"][i]["router"] + torch.randn(8, 32, generator=g) * 0.5
    return p


def _routes(params, buf, replay, oc=ops.REFERENCE):
    routes: list = []
    model.sequence_logprobs(params, CFG, buf.tokens, buf.positions, buf.segment_ids, ops_cfg=oc,
                            replay=buf.routed_experts if replay else None, routes_out=routes)
    n, t = buf.loss_mask.shape
    stack = lambda f: torch.stack([getattr(r, f).view(n, t, -1) for r in routes], 2)  # noqa: E731
    return stack("used"), stack("own")


def test_replay_routes_exactly_as_recorded_with_a_perturbed_router():
    buf = _buffer(PARAMS)
    rec = buf.routed_experts.to(torch.int64)
    has = rec[..., 0] >= 0
    assert has.sum() > 20
    with torch.no_grad():
        used, own = _routes(_perturbed(), buf, replay=True)
        plain_used, _ = _routes(_perturbed(), buf, replay=False)
    assert torch.equal(used[has], rec[has])  # replayed: the engine's experts
    assert not torch.equal(own[has].sort(-1).values, rec[has].sort(-1).values)  # its own top-k differs
    assert not torch.equal(plain_used[has], rec[has])  # and without replay it would run those


def test_mismatch_metric_sees_the_difference_and_is_zero_on_policy():
    buf = _buffer(PARAMS, INV)
    for replay in (False, True):
        loss = train.make_grpo_loss(CFG, train.PolicyLossConfig(routing_replay=replay), INV)
        with torch.no_grad():
            _, same = loss(PARAMS, buf, None)
            _, moved = loss(_perturbed(), buf, None)
        assert same["route_mismatch"].item() == 0.0 and same["mismatch_max"].item() == 0.0  # true on-policy
        assert moved["route_mismatch"].item() > 0.05  # trainer's own top-k vs the engine's, replay or not
    # the metric by hand (the last loop's, with replay): recorded token-layer routes whose top-k sets differ
    with torch.no_grad():
        _, own = _routes(_perturbed(), buf, replay=True, oc=INV)
    rec = buf.routed_experts.to(torch.int64)
    has = (rec >= 0).all(-1)
    hand = ((own.sort(-1).values != rec.sort(-1).values).any(-1) & has).sum() / has.sum()
    assert abs(moved["route_mismatch"].item() - hand.item()) < 1e-6


def test_router_gradient_under_replay_and_aux_loss_term():
    buf = _buffer(PARAMS)
    params = optree.tree_map(lambda t: t.requires_grad_(True), _perturbed())
    lossf = train.make_grpo_loss(CFG, train.PolicyLossConfig(routing_replay=True))
    loss, aux = lossf(params, buf, None)
    grads = torch.autograd.grad(loss, [params["layers"][i]["router"] for i in CFG.moe_layers])
    assert all(g.abs().sum() > 0 for g in grads)
    # the aux term: the loss minus the same loss without it is coef * load_balancing_loss
    no_aux = train.make_grpo_loss(ModelConfig(**{**CFG.__dict__, "router_aux_loss_coef": 0.0}),
                                  train.PolicyLossConfig(routing_replay=True))
    base, _ = no_aux(params, buf, None)
    assert abs((loss - base).item() - 0.01 * aux["router_aux_loss"].item()) < 1e-7
    assert aux["router_aux_loss"].item() > 0.9  # E * sum f_e p_e >= 1 up to imbalance of a finite batch


def test_replay_refused_on_dense_models_and_packed_batches():
    dense = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, model_type="qwen3", attention_bias=False)
    with pytest.raises(ValueError, match="--routing_replay needs a MoE model"):
        routing.forward_args(dense, _buffer(PARAMS), True)
    with pytest.raises(ValueError, match="no routed_experts"):
        routing.forward_args(CFG, _buffer(PARAMS)._replace(routed_experts=None), True)


def test_replay_gate_weights_are_the_trainers_probabilities_at_the_recorded_ids():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, r = moe.route(logits, 2, True, replay=torch.tensor([[3, 1]]))
    p = torch.softmax(logits, -1)[0]
    assert r.used.tolist() == [[3, 1]] and r.own.tolist() == [[0, 1]]
    assert torch.allclose(w[0], torch.stack([p[3], p[1]]) / (p[3] + p[1]))
