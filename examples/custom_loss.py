"""Research code on miles-fn: your own loss and reward, the library's pure step.

RLOO (REINFORCE with a leave-one-out baseline; Ahmadian et al., 2024) with a partial-credit
reward on one-digit addition, written from the library's pieces and handed to `train_step`:

    loss_fn(params, batch, key) -> (loss, aux)

    python examples/custom_loss.py [--steps=8] [--seed=0]     # a few seconds on a CPU

Every draw comes from the seed's key, so two runs print the same state_hash.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from miles_fn import advantages, losses, model, prng, train  # noqa: E402
from miles_fn.config import ModelConfig  # noqa: E402
from miles_fn.generate import generate  # noqa: E402
from miles_fn.optim import OptimConfig  # noqa: E402
from miles_fn.rollout_buffer import build_rollout_buffer  # noqa: E402
from miles_fn.sampling import SamplingConfig  # noqa: E402
from miles_fn.tasks.addition import AdditionTask  # noqa: E402
from state.train_state import RolloutBuffer  # noqa: E402
from state.tree import tree_hash  # noqa: E402


def make_rloo_loss(cfg: ModelConfig) -> train.LossFn:
    """A_i = r_i - (sum_{j in g(i), j != i} r_j) / (n_g - 1)
    loss = mean_i [ sum_t -A_i log pi(y_it) m_it / sum_t m_it ]

    On-policy REINFORCE: the gradient is -A_i grad log pi. The baseline of a sample excludes
    the sample itself, so it stays unbiased without a learned critic.
    """

    def loss_fn(params: Any, batch: RolloutBuffer, key: prng.Key) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        del key  # this loss draws no randomness
        logp = model.sequence_logprobs(params, cfg, batch.tokens, batch.positions, batch.segment_ids)
        mean, _, n = advantages.group_stats(batch.rewards, batch.group_ids)
        r = batch.rewards.to(torch.float64)
        baseline = (n * mean - r) / torch.clamp(n - 1, min=1)
        adv = advantages.broadcast_to_tokens((r - baseline).to(torch.float32), batch.loss_mask)
        loss = losses.aggregate(-adv * logp, batch.loss_mask, "seq_mean_token_mean")
        return loss, {"adv_abs_mean": losses.aggregate(adv.abs(), batch.loss_mask).detach()}

    return loss_fn


def partial_credit(task: AdditionTask, response: list[int], pair: tuple[int, int]) -> float:
    """The fraction of the answer's tokens (EOS included) that the response gets right, left to right."""
    want = task.answer_ids(*pair)
    right = 0
    for got, exp in zip(response, want, strict=False):
        if got != exp:
            break
        right += 1
    return right / len(want)


def main(steps: int = 8, seed: int = 0, prompts: int = 8, group: int = 8) -> str:
    task = AdditionTask(digits=1)
    tok = task.tokenizer
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=32)
    root = prng.key(seed)
    state = train.init_state(model.init_params(cfg, prng.fold_in(root, 0)), root)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=task.max_answer_tokens, stop_token_ids=(tok.eos_id,))
    loss_fn, optim = make_rloo_loss(cfg), OptimConfig(lr=3e-3, max_grad_norm=1.0)
    for s in range(steps):
        key = prng.fold_in(root, 1 + s)
        pairs = task.sample_pairs(prng.fold_in(key, 0), prompts)
        ids = [task.prompt_ids(*p) for p in pairs for _ in range(group)]
        gen = generate(state.params, cfg, ids, prng.fold_in(key, 1), sampling)
        rewards = [partial_credit(task, r, pairs[i // group]) for i, r in enumerate(gen.tokens)]
        batch = build_rollout_buffer(ids, gen.tokens, gen.logprobs, rewards, [i // group for i in range(len(ids))])
        state, m = train.train_step(state, batch, prng.fold_in(key, 2), loss_fn, optim)
        print(f"step {s + 1}: reward={sum(rewards) / len(rewards):.3f} loss={float(m['loss']):+.5f} "
              f"grad_norm={float(m['grad_norm']):.4f} |A|={float(m['adv_abs_mean']):.4f}")
    h = tree_hash(state)
    print(f"state_hash={h}")
    return h


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    main(a.steps, a.seed)
