"""The draft in the run's state: online training, the policy update untouched, resume and replay exact."""

import json
import os
import subprocess
import sys

import optree
import torch

from miles_fn import draft, model, prng, train
from miles_fn.config import ModelConfig
from miles_fn.generate import generate
from miles_fn.optim import OptimConfig
from miles_fn.rollout_buffer import build_rollout_buffer
from miles_fn.sampling import SamplingConfig
from miles_fn.speculative import generate_speculative
from state import checkpoint
from state.train_state import SpeculativeState
from state.tree import tree_hash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = ModelConfig(vocab_size=24, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2)
DCFG = draft.random_draft_config(draft.SpeculativeConfig(draft_hidden_size=32), CFG)
SAMPLING = SamplingConfig(temperature=0.5, max_new_tokens=8)
PROMPTS = [[1 + (i * 7) % 20, 2 + (i * 3) % 19, 3 + i % 17] for i in range(16)]


def _rollout_buffer(params, key):
    gen = generate(params, CFG, PROMPTS, key, SAMPLING)
    return build_rollout_buffer(PROMPTS, gen.tokens, gen.logprobs, [float(i % 2) for i in range(len(PROMPTS))],
                                [i // 2 for i in range(len(PROMPTS))])


def _acceptance(target, draft_params, key):
    _, st = generate_speculative(target, CFG, draft_params, DCFG, PROMPTS, key, SAMPLING, 3)
    return st.accept_rate


def test_policy_update_is_bitwise_unchanged_by_draft_training():
    target = model.init_params(CFG, prng.key(0), std=0.2)
    buf = _rollout_buffer(target, prng.key(1))
    loss = train.make_grpo_loss(CFG, train.PolicyLossConfig())
    opt = OptimConfig(lr=1e-2)

    def update(s, b, k):
        return train.train_step(s, b, k, loss, opt)

    plain, pm = update(train.init_state(target, prng.key(2)), buf, prng.key(3))
    before = train.init_state(model.init_params(DCFG, prng.key(4)), prng.key(5))
    spec = SpeculativeState(train.init_state(target, prng.key(2)), before)
    new, sm = draft.with_draft(update, CFG, DCFG, OptimConfig(lr=3e-3), 2)(spec, buf, prng.key(3))
    assert tree_hash(new.inner) == tree_hash(plain)
    assert float(sm["loss"]) == float(pm["loss"]) and float(sm["grad_norm"]) == float(pm["grad_norm"])
    assert tree_hash(new.draft.params) != tree_hash(before.params) and int(new.draft.step) == 2
    assert "draft_loss" in sm and "draft_expected_accept" in sm
    frozen, fm = draft.with_draft(update, CFG, DCFG, OptimConfig(lr=3e-3), 0)(spec, buf, prng.key(3))
    assert tree_hash(frozen.draft) == tree_hash(before) and tree_hash(frozen.inner) == tree_hash(plain)


def test_draft_loss_is_soft_cross_entropy_hand_computed():
    target = model.init_params(CFG, prng.key(0), std=0.2)
    dp = model.init_params(DCFG, prng.key(4))
    buf = _rollout_buffer(target, prng.key(1))
    teacher = draft.teacher_logprobs(target, CFG, buf, 0.5)
    loss, _ = draft.make_draft_loss(DCFG, 0.5)(dp, draft.DraftBatch(buf, teacher), prng.key(0))
    # float64 reference, column by column, only where loss_mask is 1
    total, n = 0.0, 0
    for r in range(buf.tokens.shape[0]):
        seq = buf.tokens[r:r + 1, :-1]
        t = seq.shape[1]
        q = model.forward(dp, DCFG, seq, torch.arange(t)[None], torch.tril(torch.ones(1, t, t, dtype=torch.bool)))
        p = model.forward(target, CFG, seq, torch.arange(t)[None], torch.tril(torch.ones(1, t, t, dtype=torch.bool)))
        for c in range(t):
            if buf.loss_mask[r, c] > 0 and buf.segment_ids[r, c + 1] > 0:
                pp = torch.softmax(p[0, c].double() / 0.5, -1)
                total += float(-(pp * torch.log_softmax(q[0, c].double() / 0.5, -1)).sum())
                n += 1
    assert abs(float(loss) - total / n) < 1e-4


def test_online_update_raises_acceptance_after_the_policy_drifts():
    t0 = model.init_params(CFG, prng.key(0), std=0.5)
    opt = OptimConfig(lr=1e-2, max_grad_norm=1.0)
    d = train.init_state(model.init_params(DCFG, prng.key(4)), prng.key(5))
    for s in range(30):  # the start-of-run draft: distilled on the first policy
        d, _ = draft.draft_update(d, t0, CFG, DCFG, _rollout_buffer(t0, prng.key(100 + s)), prng.key(s), opt, 2,
                                  SAMPLING.temperature)
    # the policy drifts: mostly another (peaked) model, as late RL is to early RL
    t1 = optree.tree_map(lambda a, b: 0.3 * a + b, t0, model.init_params(CFG, prng.key(9), std=0.5))
    held_out = prng.key(777)
    frozen_on_t0, frozen_on_t1 = _acceptance(t0, d.params, held_out), _acceptance(t1, d.params, held_out)
    online = d
    for s in range(30):  # the online draft: one update per "RL step" on that step's rollouts of the new policy
        online, _ = draft.draft_update(online, t1, CFG, DCFG, _rollout_buffer(t1, prng.key(300 + s)), prng.key(s),
                                       opt, 2, SAMPLING.temperature)
    online_on_t1 = _acceptance(t1, online.params, held_out)
    assert frozen_on_t1 < frozen_on_t0  # the drift hurts the frozen draft
    assert online_on_t1 > frozen_on_t1 + 0.1, (frozen_on_t0, frozen_on_t1, online_on_t1)


def _main(out, *args, timeout=300):
    flags = ["--sft_warmup_steps=2", "--save_every=2", "--eval_every=2", "--eval_size=8", "--prompts_per_step=4",
             "--group_size=2", "--hidden_size=32", "--intermediate_size=48", "--kl_coef=0.5", "--num_threads=1",
             "--noprogress", "--notensorboard", "--speculative_algorithm=STANDALONE", "--speculative_num_steps=2",
             "--draft_hidden_size=32", "--draft_train_steps=2", f"--output_dir={out}"]
    p = subprocess.run([sys.executable, "-m", "launch.main", *flags, *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.split("state_hash=")[1].split()[0]


def test_resume_and_replay_with_a_draft_are_exact(tmp_path):
    straight = _main(tmp_path / "a", "--num_steps=4", "--snapshot_steps=3")
    _main(tmp_path / "b", "--num_steps=2")
    assert _main(tmp_path / "b", "--num_steps=4", "--resume") == straight
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert all("spec_accept_length" in r and "draft_loss" in r for r in rows)
    assert (tmp_path / "a" / "metrics.jsonl").read_bytes() == (tmp_path / "b" / "metrics.jsonl").read_bytes()
    ck = checkpoint.load(checkpoint.latest(str(tmp_path / "a" / "checkpoints")))
    assert isinstance(ck.tree["state"], SpeculativeState) and int(ck.tree["state"].draft.step) == 8  # 4 RL x 2
    snap = tmp_path / "a" / "snapshots" / "rl_00000003"
    p = subprocess.run([sys.executable, "-m", "launch.replay", f"--snapshot={snap}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "bit-exact match" in p.stdout, p.stdout + p.stderr[-2000:]


def test_the_sglang_backend_is_refused_by_name(tmp_path):
    p = subprocess.run([sys.executable, "-m", "launch.main", "--speculative_algorithm=STANDALONE",
                        "--rollout_backend=sglang", f"--output_dir={tmp_path}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode != 0 and "--speculative_algorithm=STANDALONE" in p.stderr and "pickle" in p.stderr
