"""examples/custom_loss.py: its loss is the formula it states, it trains the way REINFORCE should,
and the script runs, deterministically, as a user runs it."""

import importlib.util
import os
import subprocess
import sys

from miles_fn import model, prng, train
from miles_fn.config import ModelConfig
from miles_fn.optim import OptimConfig
from miles_fn.rollout_buffer import build_rollout_buffer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "custom_loss.py")
CFG = ModelConfig(vocab_size=12, hidden_size=16, intermediate_size=24, num_heads=2, num_kv_heads=1)


def _example():
    spec = importlib.util.spec_from_file_location("custom_loss_example", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _batch():
    # Two groups: rewards (1, 0, 0.5) and (0, 1); responses of different lengths.
    prompts = [[1, 2], [1, 3], [1, 4], [2, 5], [2, 6]]
    responses = [[7, 8, 9], [7], [8, 8], [9, 10], [11]]
    lps = [[-1.0] * len(r) for r in responses]
    return build_rollout_buffer(prompts, responses, lps, [1.0, 0.0, 0.5, 0.0, 1.0], [0, 0, 0, 1, 1])


def test_rloo_loss_equals_the_formula_in_float64():
    params = model.init_params(CFG, prng.key(2), std=0.3)
    batch = _batch()
    loss, _ = _example().make_rloo_loss(CFG)(params, batch, prng.key(0))
    logp = model.sequence_logprobs(params, CFG, batch.tokens, batch.positions, batch.segment_ids).double()
    r, g = batch.rewards.tolist(), batch.group_ids.tolist()
    per_seq = []
    for i in range(len(r)):
        others = [r[j] for j in range(len(r)) if g[j] == g[i] and j != i]
        a = r[i] - sum(others) / len(others)
        m = batch.loss_mask[i].double()
        per_seq.append(float((-a * logp[i] * m).sum() / m.sum()))
    # hand: group 0 baselines (0.25, 0.75, 0.5) -> A = (0.75, -0.75, 0); group 1 -> A = (-1, 1)
    assert abs(float(loss) - sum(per_seq) / len(per_seq)) < 1e-6


def test_training_on_it_raises_the_logprob_of_the_better_sample():
    params = model.init_params(CFG, prng.key(2), std=0.3)
    batch = _batch()
    state = train.init_state(params, prng.key(0))
    loss_fn = _example().make_rloo_loss(CFG)

    def seq_logp(p):
        lp = model.sequence_logprobs(p, CFG, batch.tokens, batch.positions, batch.segment_ids)
        return (lp * batch.loss_mask).sum(-1)

    before = seq_logp(state.params)
    for _ in range(5):
        state, m = train.train_step(state, batch, prng.key(0), loss_fn, OptimConfig(lr=1e-2))
        assert bool(m["finite"])
    delta = seq_logp(state.params) - before
    assert delta[0] > 0 > delta[1] and delta[4] > 0 > delta[3]  # A > 0 up, A < 0 down


def test_the_script_runs_and_is_deterministic():
    outs = [subprocess.run([sys.executable, SCRIPT, "--steps=3"], capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    for p in outs:
        assert p.returncode == 0, p.stderr[-2000:]
        assert p.stdout.count("step ") == 3
    hashes = [p.stdout.split("state_hash=")[1].strip() for p in outs]
    assert hashes[0] == hashes[1] and len(hashes[0]) == 64
