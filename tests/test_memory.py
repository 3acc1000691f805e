"""Host offload round trips, the token-budget planner and the activation estimate."""

import pytest
import torch

from miles_fn import memory, model, prng, train
from miles_fn.config import ModelConfig
from state.tree import tree_hash, tree_leaves, tree_map

CFG = ModelConfig(vocab_size=37, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)


def test_offload_round_trip_leaves_the_train_state_bitwise_unchanged():
    state = train.init_state(model.init_params(CFG, prng.key(0), std=0.3), prng.key(7))
    state = state._replace(opt_state=state.opt_state._replace(
        mu=tree_map(lambda x: x + 0.25, state.opt_state.mu)), step=torch.tensor(5))
    before = tree_hash(state)
    host = memory.offload(state)
    assert tree_hash(host) == before
    assert all(x.device.type == "cpu" for x in tree_leaves(host))
    back = memory.reload(host, "cpu")
    assert tree_hash(back) == before == tree_hash(state)
    # the copies share no storage with the original: writing one leaves the other alone
    leaf = tree_leaves(back)[3]
    leaf.add_(1.0)
    assert tree_hash(state) == before and tree_hash(host) == before
    assert {x.data_ptr() for x in tree_leaves(host)}.isdisjoint({x.data_ptr() for x in tree_leaves(state)})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned, non_blocking copies need CUDA")
def test_offload_from_cuda_is_pinned_and_round_trips():
    state = train.init_state(model.init_params(CFG, prng.key(0)), prng.key(7))
    dev = memory.reload(state, "cuda")
    host = memory.offload(dev)
    assert all(x.is_pinned() for x in tree_leaves(host))
    assert tree_hash(memory.reload(host, "cuda")) == tree_hash(state)


def test_token_budget_planner_keeps_the_margin():
    gib = memory.GIB
    assert memory.plan_token_budget(4096, free_bytes=10 * gib, margin_gb=2.0, bytes_per_token=1 << 20) == 4096
    # 8 GiB usable at 4 MiB a token: 2048 tokens
    assert memory.plan_token_budget(4096, free_bytes=10 * gib, margin_gb=2.0, bytes_per_token=4 << 20) == 2048
    assert memory.plan_token_budget(4096, free_bytes=10 * gib, margin_gb=6.0, bytes_per_token=4 << 20) == 1024
    with pytest.raises(ValueError, match="--memory_margin_gb=12"):
        memory.plan_token_budget(4096, free_bytes=10 * gib, margin_gb=12.0, bytes_per_token=1)


def test_activation_estimate_counts_by_hand():
    # per layer 7*32 + 3*16 + 4*48 + 4*10 = 504 floats; 2 layers + 3*37 logits floats; + 10 mask bytes
    assert memory.activation_bytes_per_token(CFG, row_len=10, recompute=False) == 4 * (2 * 504 + 111) + 10
    # recompute: 2 layer inputs of 32 + one live layer
    assert memory.activation_bytes_per_token(CFG, row_len=10, recompute=True) == 4 * (64 + 504 + 111) + 10


class _Holder:
    def __init__(self, state, engine):
        self.state, self.engine = state, engine


class _ServerEngine:
    """An engine with its own copy of the weights (a colocated server); keeps the trainer's for a restart."""

    def __init__(self, params):
        self.params = params


def _offload_state():
    state = train.init_state(model.init_params(CFG, prng.key(0), std=0.3), prng.key(7))
    return state._replace(opt_state=state.opt_state._replace(mu=tree_map(lambda x: x + 0.5, state.opt_state.mu)))


def test_offload_around_a_server_engine_frees_the_trainers_params_and_the_engines_restart_copy():
    import weakref

    from launch.memory import offloaded

    state = _offload_state()
    before = tree_hash(state)
    holder = _Holder(state, _ServerEngine(state.params))
    device_leaves = [weakref.ref(x) for x in tree_leaves(state)]
    del state
    with offloaded(holder, True):
        # nothing holds the device tensors any more: the body (the rollout) has their memory
        assert all(r() is None for r in device_leaves)
        assert holder.engine.params is holder.state.params and tree_hash(holder.state) == before
    assert tree_hash(holder.state) == before
    assert holder.engine.params is holder.state.params  # one copy of the params, shared again


def test_offload_around_the_embedded_engine_moves_only_the_optimizer_state():
    import weakref

    from launch.engines.embedded import EmbeddedEngine
    from launch.memory import offloaded

    state = _offload_state()
    before = tree_hash(state)
    engine = EmbeddedEngine(CFG, state.params)
    holder = _Holder(state, engine)
    moments = [weakref.ref(x) for x in tree_leaves(state.opt_state.mu) + tree_leaves(state.opt_state.nu)]
    del state
    with offloaded(holder, True):
        assert all(r() is None for r in moments)  # the optimizer moments left the device
        assert engine.params is not None and holder.state.params is None
    assert tree_hash(holder.state) == before
    assert holder.state.params is engine.params  # the params the engine generated from, not a second copy


def test_the_planner_budgets_free_memory_over_the_autograd_estimate(monkeypatch):
    # With 1 GiB free and no margin, the budget is free / bytes-a-token of the estimate (plain autograd's,
    # the train step's gradient), with and without --recompute.
    from launch import memory as launch_memory
    from miles_fn.memory import MemoryConfig

    monkeypatch.setattr(launch_memory, "free_bytes", lambda device: memory.GIB)
    bpt = memory.activation_bytes_per_token(CFG, 64, recompute=False)
    cfg = MemoryConfig(max_tokens_per_micro_batch=10**9, pack_row_len=64)
    budget, _ = launch_memory.plan_budget(cfg, CFG, [64], torch.device("cpu"))
    assert budget == memory.GIB // bpt
    rbpt = memory.activation_bytes_per_token(CFG, 64, recompute=True)
    budget, _ = launch_memory.plan_budget(MemoryConfig(10**9, 64, recompute=True), CFG, [64], torch.device("cpu"))
    assert budget == memory.GIB // rbpt
