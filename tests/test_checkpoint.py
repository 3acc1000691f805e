"""Checkpoints: exact round trip, atomic replacement, and clear errors on damage."""

import os

import pytest
import torch

from miles_fn import model, prng, train
from miles_fn.config import ModelConfig
from state import checkpoint
from state.tree import tree_hash


def _state():
    cfg = ModelConfig(vocab_size=20, hidden_size=16, intermediate_size=24, num_heads=2, num_kv_heads=1)
    return train.init_state(model.init_params(cfg, prng.key(0)), prng.key(9))


def test_round_trip_is_bitwise(tmp_path):
    st = _state()
    path = str(tmp_path / "ck")
    checkpoint.save(path, st, {"step": 3, "note": "x"})
    loaded = checkpoint.load(path)
    assert loaded.metadata == {"step": 3, "note": "x"}
    assert type(loaded.tree) is type(st)
    assert tree_hash(loaded.tree) == tree_hash(st)
    assert torch.equal(loaded.tree.params["layers"][1]["wq"], st.params["layers"][1]["wq"])


def test_overwrite_is_atomic_and_latest_ignores_temporaries(tmp_path):
    root = str(tmp_path)
    st = _state()
    checkpoint.save(checkpoint.step_dir(root, 1), st)
    checkpoint.save(checkpoint.step_dir(root, 1), st._replace(step=torch.tensor(5)))
    os.makedirs(os.path.join(root, "step_00000009.tmp-123"))
    assert checkpoint.latest(root) == checkpoint.step_dir(root, 1)
    assert int(checkpoint.load(checkpoint.latest(root)).tree.step) == 5
    assert sorted(os.listdir(root)) == ["step_00000001", "step_00000009.tmp-123"]


@pytest.mark.parametrize("victim", ["tensors.safetensors", "meta.msgpack"])
def test_flipped_byte_gives_a_clear_error_naming_the_file(tmp_path, victim):
    path = str(tmp_path / "ck")
    checkpoint.save(path, _state())
    f = os.path.join(path, victim)
    data = bytearray(open(f, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(f, "wb").write(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match=victim):
        checkpoint.load(path)


def test_truncated_or_missing_files_are_refused(tmp_path):
    path = str(tmp_path / "ck")
    checkpoint.save(path, _state())
    f = os.path.join(path, "tensors.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data[: len(data) - 100])
    with pytest.raises(checkpoint.CheckpointError, match="truncated or corrupted"):
        checkpoint.load(path)
    os.remove(f)
    with pytest.raises(checkpoint.CheckpointError, match="missing"):
        checkpoint.load(path)
