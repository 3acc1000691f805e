"""The pieces of resume and replay, in process: snapshots, bitwise comparison, JSONL truncation,
the flag check, the code version, and the activations path of the forward."""

import json
import math
import os
import shutil

import pytest
import torch

from launch import metrics, resume
from launch.steps import StepFailed, StepGuard
from miles_fn import model, prng, train
from miles_fn.config import ModelConfig
from state import checkpoint, snapshot
from state.train_state import RolloutBuffer
from state.tree import tree_hash

CFG = ModelConfig(vocab_size=20, hidden_size=16, intermediate_size=24, num_layers=3, num_heads=2, num_kv_heads=1)


def _state():
    return train.init_state(model.init_params(CFG, prng.key(0)), prng.key(9))


def _batch(n=3, t=6):
    tokens = prng.randint(prng.key(1), (n, t), 1, CFG.vocab_size)
    seg = torch.ones(n, t, dtype=torch.int64)
    seg[0, 4:] = 0
    positions = torch.arange(t).expand(n, t).clone()
    mask = torch.ones(n, t - 1)
    return RolloutBuffer(tokens, positions, seg, mask, torch.zeros(n, t - 1), torch.full((n, t - 1), float("nan")),
                         torch.zeros(n), torch.zeros(n, dtype=torch.int64))


def test_snapshot_round_trip_keeps_every_bit_nan_included(tmp_path):
    rec = snapshot.Outcome(torch.tensor(float("nan")), torch.tensor(1.5), False, "abc", None)
    snap = snapshot.Snapshot(_state(), _batch(), prng.key(3), {"lr": 0.001, "snapshot_steps": ["1", "5"]}, rec,
                             {"phase": "rl", "index": 7})
    snapshot.save(str(tmp_path / "s"), snap)
    back = snapshot.load(str(tmp_path / "s"))
    assert tree_hash(back.state) == tree_hash(snap.state) and tree_hash(back.batch) == tree_hash(snap.batch)
    assert back.flags == snap.flags and back.info == snap.info and back.recorded.new_state_hash == "abc"
    assert all(snapshot.compare(snap.recorded, back.recorded).values())


def test_bitwise_equal_is_about_bits_not_values():
    nan = torch.tensor(float("nan"))
    assert snapshot.bitwise_equal(nan, nan.clone())
    assert not snapshot.bitwise_equal(torch.tensor(0.0), torch.tensor(-0.0))  # equal values, other bits
    assert not snapshot.bitwise_equal(torch.tensor(1.0), torch.tensor(1.0, dtype=torch.float64))
    assert not snapshot.bitwise_equal(torch.tensor(1.0), torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)))
    assert snapshot.bitwise_equal(None, None) and not snapshot.bitwise_equal(None, nan)


def test_a_plain_checkpoint_is_not_taken_for_a_snapshot(tmp_path):
    checkpoint.save(str(tmp_path / "ck"), _state())
    with pytest.raises(checkpoint.CheckpointError, match="not a step snapshot"):
        snapshot.load(str(tmp_path / "ck"))


def test_checkpoint_of_aliased_tensors_round_trips(tmp_path):
    st = _state()
    checkpoint.save(str(tmp_path / "ck"), {"state": st, "ref_params": st.params})
    back = checkpoint.load(str(tmp_path / "ck")).tree
    assert tree_hash(back["ref_params"]) == tree_hash(st.params) == tree_hash(back["state"].params)


def test_truncate_jsonl_keeps_rows_up_to_the_step_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "m.jsonl"
    whole = "".join(metrics.jsonl_row(s, {"loss": s / 3}) for s in (1, 2, 3))
    path.write_text(whole + '{"step": 4, "lo')
    metrics.truncate_jsonl(str(path), 2)
    assert path.read_text() == "".join(metrics.jsonl_row(s, {"loss": s / 3}) for s in (1, 2))
    assert json.loads(path.read_text().splitlines()[1]) == {"step": 2, "loss": 2 / 3}
    path.write_text(whole + '{"step": 4, "lo')
    metrics.truncate_jsonl(str(path), 9)
    assert path.read_text() == whole


def test_writer_puts_timings_aside_and_resumes_after_the_step(tmp_path):
    w = metrics.MetricsWriter(str(tmp_path), tensorboard=False)
    for s in (1, 2, 3):
        w.write(s, {"loss": float(s), "time_train": 0.5})
    w.close()
    w = metrics.MetricsWriter(str(tmp_path), tensorboard=False, resume_step=1)
    w.write(2, {"loss": 20.0, "time_train": 0.25})
    w.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 20.0}\n'
    assert (tmp_path / "timings.jsonl").read_text() == ('{"step": 1, "time_train": 0.5}\n'
                                                        '{"step": 2, "time_train": 0.25}\n')


def test_check_flags_allows_bookkeeping_flags_and_names_a_math_flag():
    saved = {"lr": 0.001, "num_threads": 1, "num_steps": 10, "save_every": 5, "output_dir": "a"}
    resume.check_flags(saved, {**saved, "num_steps": 20, "save_every": 1, "output_dir": "b"}, "ck")
    with pytest.raises(resume.ResumeError, match="--num_threads=2 differs from --num_threads=1 of the checkpoint ck"):
        resume.check_flags(saved, {**saved, "num_threads": 2}, "ck")
    with pytest.raises(resume.ResumeError, match="--new_flag=3 differs from --new_flag=<absent>"):
        resume.check_flags(saved, {**saved, "new_flag": 3}, "ck")


def test_code_version_changes_with_one_byte_of_source(tmp_path):
    root = tmp_path / "src"
    shutil.copytree(resume._ROOT / "state", root / "state")
    before = resume.code_version(root, ("state",))
    assert before == resume.code_version(root, ("state",))
    f = root / "state" / "tree.py"
    f.write_text(f.read_text() + " ")
    assert resume.code_version(root, ("state",)) != before


def _rms_norm64(x, w, eps):
    x = x.to(torch.float64)
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.to(torch.float64)


def test_forward_with_activations_is_forward_plus_the_residual_stream():
    params = model.init_params(CFG, prng.key(4), std=0.3)
    b = _batch()
    mask = model.causal_segment_mask(b.segment_ids)
    logits, acts = model.forward_with_activations(params, CFG, b.tokens, b.positions, mask)
    assert torch.equal(logits, model.forward(params, CFG, b.tokens, b.positions, mask))  # bit for bit
    assert list(acts) == ["embed", "layer_00", "layer_01", "layer_02", "final_norm"]
    assert torch.equal(acts["embed"], params["embed"][b.tokens])
    ref = _rms_norm64(acts["layer_02"], params["final_norm"], CFG.rms_norm_eps)
    assert torch.allclose(acts["final_norm"].to(torch.float64), ref, atol=1e-5)
    ref_logits = ref @ params["embed"].to(torch.float64).T  # tied embeddings
    assert torch.allclose(logits.to(torch.float64), ref_logits, atol=1e-4)
    assert not torch.equal(acts["layer_00"], acts["layer_01"]) and math.isfinite(float(acts["layer_02"].sum()))


def test_a_write_stopped_before_commit_leaves_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ck")
    checkpoint.save(path, _state())

    def die():
        raise KeyboardInterrupt  # stands in for a SIGKILL between the complete temp dir and the rename

    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(path, _state()._replace(step=torch.tensor(7)), before_commit=die)
    assert int(checkpoint.load(path).tree.step) == 0
    assert checkpoint.latest(str(tmp_path)) is None  # "ck" is not a step dir; temporaries never count


def test_remove_partial_writes_deletes_temporaries_and_puts_back_an_orphaned_old(tmp_path):
    st = _state()
    root = str(tmp_path)
    for name in ("step_00000002", "step_00000004.tmp-11", "step_00000006.old-12", "step_00000002.old-13"):
        checkpoint.save(os.path.join(root, name), st)
    gone = resume.remove_partial_writes(root)
    assert gone == ["step_00000002.old-13", "step_00000004.tmp-11", "step_00000006.old-12"]
    assert sorted(os.listdir(root)) == ["step_00000002", "step_00000006"]


def _guard(tmp_path, fn, snapshot_steps=()):
    return StepGuard({"rl": fn, "sft": fn}, str(tmp_path), snapshot_steps, {"lr": 0.5}, CFG)


def test_guard_snapshots_a_step_that_raises_and_stops_naming_it(tmp_path):
    def boom(state, batch, key):
        raise ValueError("boom in the loss")

    st = _state()
    with pytest.raises(StepFailed, match=r"rl step 3 raised ValueError: boom in the loss") as e:
        _guard(tmp_path, boom)("rl", 3, st, _batch(), prng.key(5))
    path = str(tmp_path / "snapshots" / "rl_00000003")
    assert f"--snapshot={path}" in str(e.value)
    snap = snapshot.load(path)
    assert snap.recorded.error == "ValueError: boom in the loss" and snap.recorded.loss is None
    assert tree_hash(snap.state) == tree_hash(st) and torch.equal(snap.key, prng.key(5))
    assert snap.flags == {"lr": 0.5} and snap.info["model"]["num_layers"] == 3


def test_guard_snapshots_requested_and_non_finite_steps_only(tmp_path):
    loss_fn = train.make_sft_loss(CFG)
    from miles_fn.optim import OptimConfig

    step = lambda s, b, k: train.train_step(s, b, k, loss_fn, OptimConfig())
    guard = _guard(tmp_path, step, snapshot_steps=(2,))
    st, b = _state(), _batch()
    new, _ = guard("rl", 1, st, b, prng.key(0))
    assert not (tmp_path / "snapshots").exists()
    new2, m = guard("rl", 2, new, b, prng.key(0))
    snap = snapshot.load(str(tmp_path / "snapshots" / "rl_00000002"))
    assert snap.recorded.finite and snap.recorded.new_state_hash == tree_hash(new2)
    assert snapshot.bitwise_equal(snap.recorded.loss, m["loss"]) and snap.info["reason"] == "requested"
    nan_batch = b._replace(loss_mask=b.loss_mask * float("nan"))
    with pytest.raises(StepFailed, match="rl step 3: non-finite loss or gradients"):
        guard("rl", 3, new2, nan_batch, prng.key(0))
    snap = snapshot.load(str(tmp_path / "snapshots" / "rl_00000003"))
    assert not snap.recorded.finite and snap.recorded.new_state_hash == tree_hash(new2)


def test_guard_lets_configuration_errors_through_unsnapshotted(tmp_path):
    def bad_plan(state, batch, key):
        raise KeyError("a flag error, not a failed step")

    guard = StepGuard({"rl": bad_plan}, str(tmp_path), (), {}, CFG, passthrough=(KeyError,))
    with pytest.raises(KeyError):
        guard("rl", 1, _state(), _batch(), prng.key(0))
    assert not (tmp_path / "snapshots").exists()
