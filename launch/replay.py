"""Re-execute one snapshotted train step and compare it with what the run recorded, bit for bit.

    python -m launch.replay --snapshot=runs/x/snapshots/rl_00000003 [--dump_activations=DIR]

The step is rebuilt from the flags stored in the snapshot (launch.steps.make_step_fn, the
function the job ran) under the same torch settings, and run on the stored state, batch
and key. Exit 0 when loss, gradient norm, finiteness and the new state's hash (or the
exception raised) all match what was recorded, NaNs included; 1 when any differs;
2 when the snapshot cannot be read. --dump_activations writes the residual stream of the
input params on the step's batch (miles_fn.model.forward_with_activations).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
from absl import app, flags

from launch import flags as run_flags
from launch import resume, steps
from launch.main import config_from_flags, setup_torch
from miles_fn import lora, model
from miles_fn.config import ModelConfig
from state import checkpoint, snapshot
from state.tree import tree_hash

flags.DEFINE_string("snapshot", None, "A snapshot directory (<output_dir>/snapshots/<phase>_<step>).")
flags.DEFINE_string("dump_activations", "", "Write per-layer activations of the step's forward pass into this "
                    "directory (activations.safetensors).")
FLAGS = flags.FLAGS


def config_for(snap: snapshot.Snapshot) -> run_flags.RunConfig:
    """The run's RunConfig: its stored flags, and its stored model config (which may come from an HF checkpoint)."""
    for name, value in snap.flags.items():
        if name in FLAGS:
            FLAGS[name].value = value
    cfg = config_from_flags()
    return dataclasses.replace(cfg, model=ModelConfig(**snap.info["model"]))


def execute(snap: snapshot.Snapshot, cfg: run_flags.RunConfig) -> snapshot.Outcome:
    step_fn = steps.make_step_fn(cfg, snap.info["phase"])
    try:
        new_state, m = step_fn(snap.state, snap.batch, snap.key)
    except Exception as e:
        return snapshot.Outcome(None, None, False, None, f"{type(e).__name__}: {e}")
    return snapshot.Outcome(m["loss"], m["grad_norm"], bool(m["finite"]), tree_hash(new_state), None)


def dump_activations(snap: snapshot.Snapshot, cfg: run_flags.RunConfig, out_dir: str) -> list[str]:
    """Write the forward's residual stream and logits; returns one summary line per tensor."""
    from safetensors.torch import save_file

    b = snap.batch
    with torch.no_grad():
        params = lora.model_params(snap.state, cfg.lora)  # --lora_rank: the merged weights the step ran on
        logits, acts = model.forward_with_activations(params, cfg.model, b.tokens, b.positions,
                                                      model.causal_segment_mask(b.segment_ids))
    acts = {**acts, "logits": logits}
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in acts.items()}, os.path.join(out_dir, "activations.safetensors"))
    lines = []
    for k, v in acts.items():
        bad = int((~torch.isfinite(v)).sum())
        lines.append(f"  {k:<12} {tuple(v.shape)!s:<16} max|x|={float(v.abs().max()):.6g} non-finite={bad}")
    return lines


def _show(t: torch.Tensor | None) -> str:
    return "-" if t is None else repr(float(t))


def report(snap: snapshot.Snapshot, replayed: snapshot.Outcome) -> tuple[bool, list[str]]:
    rec, same = snap.recorded, snapshot.compare(snap.recorded, replayed)
    rows = [
        ("loss", _show(rec.loss), _show(replayed.loss)),
        ("grad_norm", _show(rec.grad_norm), _show(replayed.grad_norm)),
        ("finite", str(rec.finite), str(replayed.finite)),
        ("new_state_hash", str(rec.new_state_hash), str(replayed.new_state_hash)),
        ("error", str(rec.error), str(replayed.error)),
    ]
    lines = [f"  {name:<15} recorded={a:<24} replayed={b:<24} {'match' if same[name] else 'MISMATCH'}"
             for name, a, b in rows]
    return all(same.values()), lines


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected positional arguments: {argv[1:]}")
    if not FLAGS.snapshot:
        raise app.UsageError("--snapshot=PATH is required")
    try:
        snap = snapshot.load(FLAGS.snapshot)
    except checkpoint.CheckpointError as e:
        print(f"error: --snapshot={FLAGS.snapshot}: {e}", file=sys.stderr)
        sys.exit(2)
    info = snap.info
    out_dir = FLAGS.dump_activations
    cfg = config_for(snap)
    setup_torch(cfg)
    if info.get("code_version") != resume.running_code_version():
        print("warning: the snapshot was taken with other code; a mismatch may come from the code change",
              file=sys.stderr)
    print(f"snapshot {FLAGS.snapshot}: {info['phase']} step {info['index']} ({info['reason']})")
    ok, lines = report(snap, execute(snap, cfg))
    print("\n".join(lines))
    if out_dir:
        print(f"activations -> {os.path.join(out_dir, 'activations.safetensors')}")
        print("\n".join(dump_activations(snap, cfg, out_dir)))
    print("replay: bit-exact match" if ok else "replay: MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    app.run(main)
