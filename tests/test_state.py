"""State pytrees: optree sees through them, updates return new trees, hashes track exact bytes."""

import optree
import torch

from miles_fn import model, prng, train
from miles_fn.config import ModelConfig
from state.train_state import TrainState
from state.tree import global_norm, tree_hash, tree_map


def _state():
    cfg = ModelConfig(vocab_size=12, hidden_size=16, intermediate_size=24, num_heads=2, num_kv_heads=1)
    return train.init_state(model.init_params(cfg, prng.key(0)), prng.key(1))


def test_train_state_is_a_pytree_of_tensors():
    st = _state()
    leaves, spec = optree.tree_flatten(st)
    n_params = len(optree.tree_leaves(st.params))
    assert len(leaves) == 3 * n_params + 3  # params, mu, nu, count, step, key
    rebuilt = optree.tree_unflatten(spec, leaves)
    assert isinstance(rebuilt, TrainState) and tree_hash(rebuilt) == tree_hash(st)
    doubled = tree_map(lambda x: x * 2, st)
    assert isinstance(doubled, TrainState) and isinstance(doubled.opt_state, type(st.opt_state))


def test_updates_leave_the_original_untouched():
    st = _state()
    before = tree_hash(st)
    new = st._replace(step=st.step + 1)
    assert tree_hash(st) == before and tree_hash(new) != before


def test_hash_changes_with_one_bit():
    st = _state()
    w = st.params["layers"][0]["wq"].clone()
    w.view(torch.int32)[0, 0] ^= 1
    flipped = st._replace(params={**st.params, "layers": [{**st.params["layers"][0], "wq": w}, st.params["layers"][1]]})
    assert tree_hash(flipped) != tree_hash(st)


def test_global_norm_hand_computed():
    assert float(global_norm({"a": torch.tensor([3.0]), "b": [torch.tensor([4.0, 0.0])]})) == 5.0
