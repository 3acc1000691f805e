"""Data-parallel training on torch.distributed (gloo on 127.0.0.1, 2 ranks) against one process.

References are independent of the sharded path: the whole batch's gradient in one process in
float64, and train.train_step on the whole batch (float32).
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles_fn import model, optim, prng, sharding, train
from miles_fn.config import ModelConfig
from state.tree import global_norm, tree_leaves, tree_map
from tests.test_packing import make_buffer

CFG = ModelConfig(vocab_size=37, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)
LOSS = train.PolicyLossConfig()
OPT = optim.OptimConfig(lr=1e-2, weight_decay=0.01, max_grad_norm=0.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        params = model.init_params(CFG, prng.key(0), std=0.3)
        buf = make_buffer()
        loss_fn = train.make_grpo_loss(CFG, LOSS)
        sp = sharding.shard_tree(params, mesh)
        mb = sharding.rank_batch(buf, rank, world)
        good, _ = train.loss_and_grad(sp, mb, prng.key(1), sharding.sharded_loss(loss_fn))
        bad_loss = lambda p, b, k: loss_fn(tree_map(lambda x: x.full_tensor(), p), b, k)  # noqa: E731
        bad, _ = train.loss_and_grad(sp, mb, prng.key(1), bad_loss)
        state = train.init_state(params, prng.key(2))
        s1, m1 = sharding.dp_train_step(state, buf, prng.key(1), loss_fn, OPT, mesh)
        s2, m2 = sharding.dp_train_step(s1, buf, prng.key(1), loss_fn, OPT, mesh)
        res = {"good": sharding.gather_tree(good), "bad": sharding.gather_tree(bad),
               "params": sharding.gather_tree(s2.params), "metrics": [m1, m2],
               "local_bytes": sharding.local_bytes((s2.params, s2.opt_state)),
               "sharded": all(isinstance(x, dist.tensor.DTensor) for x in tree_leaves(s2.params))}
        with pytest.raises(ValueError, match="use_autograd=False"):
            sharding.check_autograd(sp, use_autograd=False)
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dp"))
    mp.spawn(_worker, args=(2, _free_port(), out), nprocs=2, join=True)
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(2)]


def _reference_grads_f64():
    params = tree_map(lambda x: x.to(torch.float64), model.init_params(CFG, prng.key(0), std=0.3))
    buf = make_buffer()
    buf = buf._replace(**{f: getattr(buf, f).to(torch.float64) for f in ("loss_mask", "old_logprobs", "advantages",
                                                                          "ref_logprobs")})
    g, _ = train.loss_and_grad(params, buf, prng.key(1), train.make_grpo_loss(CFG, LOSS))
    return g


def test_sharded_gradient_equals_float64_whole_batch_and_default_placements_do_not(two_ranks):
    ref = _reference_grads_f64()
    for res in two_ranks:
        for x, y in zip(tree_leaves(res["good"]), tree_leaves(ref), strict=True):
            assert float((x.double() - y).abs().max()) <= 1e-5 * float(y.abs().max()) + 1e-8
        # the default grad_placements (Replicate) keeps each rank's partial gradient as if it were whole
        assert abs(float(global_norm(res["bad"])) - float(global_norm(ref))) > 0.05 * float(global_norm(ref))


def test_two_rank_steps_equal_one_process_to_float32_rounding(two_ranks):
    loss_fn = train.make_grpo_loss(CFG, LOSS)
    state = train.init_state(model.init_params(CFG, prng.key(0), std=0.3), prng.key(2))
    ms = []
    for _ in range(2):
        state, m = train.train_step(state, make_buffer(), prng.key(1), loss_fn, OPT)
        ms.append(m)
    for res in two_ranks:
        assert res["sharded"]
        for x, y in zip(tree_leaves(res["params"]), tree_leaves(state.params), strict=True):
            # Adam divides by sqrt(nu): float32 rounding of a near-zero gradient moves a weight by a share of lr
            # (measured: up to 1e-4 lr on an Intel Xeon, 2.1e-4 lr on an AMD EPYC, whose BLAS sums differently).
            # A wrong shard or reduction moves weights by O(lr), and the metrics below are held to 1e-5.
            assert float((x - y).abs().max()) <= 1e-3 * OPT.lr + 1e-5 * float(y.abs().max())
        for mr, m in zip(res["metrics"], ms, strict=True):
            for k, v in m.items():
                assert float(mr[k]) == pytest.approx(float(v), rel=1e-5, abs=1e-6), k
    # every rank reports the same reduced metrics (its own shard's byte count aside)
    assert all(float(two_ranks[0]["metrics"][i][k]) == float(two_ranks[1]["metrics"][i][k])
               for i in range(2) for k in two_ranks[0]["metrics"][i] if k != "state_bytes_per_rank")


def test_params_and_moments_per_rank_are_about_half(two_ranks):
    state = train.init_state(model.init_params(CFG, prng.key(0), std=0.3), prng.key(2))
    full = sharding.local_bytes((state.params, state.opt_state))
    per_rank = [r["local_bytes"] for r in two_ranks]
    scalars = sum(x.numel() * x.element_size() for x in tree_leaves((state.params, state.opt_state)) if x.dim() == 0)
    assert sum(per_rank) == full + scalars  # 0-d leaves (AdamW's count) are replicated, not sharded
    assert all(0.4 * full <= b <= 0.6 * full for b in per_rank), (per_rank, full)
