"""The speculative draft's online training: soft cross-entropy to the updated target, isolated from the policy.

The draft is a small separate LM (a ModelConfig with the target's vocabulary) whose params and AdamW
moments are a TrainState of their own inside SpeculativeState (state/train_state.py). After each RL
update it takes `steps` AdamW steps on that step's rollout buffer, with loss

    L = sum_{t in response} sum_v p_target(v | x_<=t) * -log q_draft(v | x_<=t) / #response tokens

(the forward KL up to the target's entropy, as NeMo-RL's DraftCrossEntropyLossFn). The teacher is the
*updated* policy, detached: one no-grad forward of the new params over the buffer (the train forward's
logits belong to the params before the update, and reusing them would mean changing every policy loss).
The policy's update never sees the draft (separate params, optimizer and key), so it is bitwise what it
is without speculation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import ops
from miles_fn import model, optim, prng, train
from miles_fn.config import ModelConfig
from state.train_state import RolloutBuffer, SpeculativeState, TrainState

ALGORITHMS = ("none", "STANDALONE")  # SGLang's names: STANDALONE = a separate small draft LM


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """--speculative_*/--draft_* flags: the draft LM, its proposal length and its online training."""

    algorithm: str = "none"
    num_steps: int = 3  # k: draft tokens proposed per verify forward
    draft_checkpoint: str = ""  # HF directory of a small LM of the target's vocabulary ("" = random init)
    draft_hidden_size: int = 64
    draft_num_layers: int = 1
    draft_train_steps: int = 1  # AdamW steps of the draft per RL step
    draft_lr: float = 3e-3
    freeze_draft: bool = False  # keep the start-of-run draft (for comparison)
    disable_by_batch_size: int = 0  # decode plainly while more rows than this are live (0: always speculate)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"--speculative_algorithm={self.algorithm!r}: expected one of {ALGORITHMS}")
        if self.num_steps < 1:
            raise ValueError(f"--speculative_num_steps must be >= 1, got {self.num_steps}")
        if self.disable_by_batch_size < 0:
            raise ValueError(f"--speculative_disable_by_batch_size must be >= 0, got {self.disable_by_batch_size}")
        if self.draft_hidden_size < 2 or self.draft_num_layers < 1 or self.draft_train_steps < 0:
            raise ValueError("--draft_hidden_size >= 2, --draft_num_layers >= 1 and --draft_train_steps >= 0 needed")

    @property
    def enabled(self) -> bool:
        return self.algorithm != "none"

    @property
    def train_steps(self) -> int:
        return 0 if self.freeze_draft else self.draft_train_steps


def random_draft_config(cfg: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """A random-init draft's shape: the target's vocabulary, positions and family, --draft_hidden_size wide."""
    h = cfg.draft_hidden_size
    heads = max(1, h // 32)
    return dataclasses.replace(target, hidden_size=h, intermediate_size=3 * h, num_layers=cfg.draft_num_layers,
                               num_heads=heads, num_kv_heads=1 if heads % 2 else min(2, heads), head_dim=None,
                               recompute=False)


def _columns(buf: RolloutBuffer) -> torch.Tensor:
    """The columns the draft learns: response tokens' predictions (loss_mask > 0), [N, T-1] bool."""
    return buf.loss_mask > 0


def _column_logits(params: model.Params, cfg: ModelConfig, buf: RolloutBuffer, ops_cfg: ops.OpsConfig
                   ) -> torch.Tensor:
    """Logits [C, V] at the buffer's C response columns, in row-major order: the output layer runs there only
    (on SmolLM2's 49k vocabulary a rollout's prompt is most of its columns, and the head most of a draft)."""
    h = model.hidden_states(params, cfg, buf.tokens[:, :-1], buf.positions[:, :-1],
                            model.causal_segment_mask(buf.segment_ids[:, :-1]), ops_cfg=ops_cfg)
    return model.output_layer(params, h[_columns(buf)], ops_cfg)


def teacher_logprobs(params: model.Params, cfg: ModelConfig, buf: RolloutBuffer, temperature: float,
                     ops_cfg: ops.OpsConfig = ops.REFERENCE) -> torch.Tensor:
    """The target's next-token log-distribution [C, V] at the C response columns (loss_mask > 0, row-major),
    detached (no grad)."""
    with torch.no_grad():
        return torch.log_softmax(_column_logits(params, cfg, buf, ops_cfg).to(torch.float32) / temperature, -1)


def make_draft_loss(draft_cfg: ModelConfig, temperature: float = 1.0) -> train.LossFn:
    """Soft CE of the draft to `batch.teacher` ([C, V] log-probs at the response columns), weighted by
    loss_mask. `batch` is a DraftBatch; the draft is trained at the sampling temperature the engine uses.
    """

    def loss_fn(params: Any, batch: DraftBatch, key: prng.Key) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        del key
        buf = batch.buf
        logq = torch.log_softmax(_column_logits(params, draft_cfg, buf, ops.REFERENCE).to(torch.float32)
                                 / temperature, -1)
        ce = -(batch.teacher.exp() * logq).sum(-1)  # [C]
        w = buf.loss_mask[_columns(buf)]
        n = w.sum().clamp(min=1.0)
        loss = (ce * w).sum() / n
        with torch.no_grad():  # greedy-draft acceptance: the target's mass on the draft's argmax
            agree = batch.teacher.gather(-1, logq.argmax(-1, keepdim=True)).squeeze(-1).exp()
            accept = (agree * w).sum() / n
        return loss, {"draft_expected_accept": accept}

    return loss_fn


class DraftBatch:
    """A rollout buffer and its teacher log-probs: what the draft's loss reads."""

    def __init__(self, buf: RolloutBuffer, teacher: torch.Tensor):
        self.buf, self.teacher = buf, teacher


def draft_update(
    draft: TrainState, target_params: model.Params, target_cfg: ModelConfig, draft_cfg: ModelConfig,
    buf: RolloutBuffer, key: prng.Key, optim_cfg: optim.OptimConfig, steps: int, temperature: float = 1.0,
    ops_cfg: ops.OpsConfig = ops.REFERENCE,
) -> tuple[TrainState, dict[str, torch.Tensor]]:
    """`steps` AdamW steps of the draft on one buffer against the target `target_params` (detached).

    Metrics: draft_loss (soft CE) and draft_expected_accept (E_target[1{x = draft argmax}], the acceptance a
    greedy draft gets under quantile coupling) of the first step, i.e. before this update.
    """
    teacher = teacher_logprobs(target_params, target_cfg, buf, temperature, ops_cfg)
    batch = DraftBatch(buf, teacher)
    loss_fn = make_draft_loss(draft_cfg, temperature)
    first: dict[str, torch.Tensor] = {}
    for i in range(steps):
        draft, m = train.train_step(draft, batch, prng.fold_in(key, i), loss_fn, optim_cfg)
        if i == 0:
            first = {"draft_loss": m["loss"], "draft_expected_accept": m["draft_expected_accept"],
                     "draft_grad_norm": m["grad_norm"]}
        if not bool(m["finite"]):
            raise FloatingPointError(f"draft update step {i}: non-finite loss or gradients; lower --draft_lr")
    return draft, first


def with_draft(update: Any, target_cfg: ModelConfig, draft_cfg: ModelConfig, optim_cfg: optim.OptimConfig,
               steps: int, temperature: float = 1.0, ops_cfg: ops.OpsConfig = ops.REFERENCE) -> Any:
    """An RL update `(state, buf, key) -> (state, metrics)` extended to SpeculativeState: the policy's
    update exactly as before, then the draft's on the same buffer against the updated policy.
    steps = 0 (--freeze_draft) keeps the draft as it is (its loss is still measured)."""
    k_draft = 0xD4AF7

    def spec_update(state: SpeculativeState, buf: RolloutBuffer, key: prng.Key):
        inner, metrics = update(state.inner, buf, key)  # the policy's own key: its update is untouched
        if steps == 0:
            teacher = teacher_logprobs(inner.params, target_cfg, buf, temperature, ops_cfg)
            with torch.no_grad():
                loss, aux = make_draft_loss(draft_cfg, temperature)(state.draft.params, DraftBatch(buf, teacher), key)
            return state._replace(inner=inner), {**metrics, "draft_loss": loss, **aux}
        draft, dm = draft_update(state.draft, inner.params, target_cfg, draft_cfg, buf, prng.fold_in(key, k_draft),
                                 optim_cfg, steps, temperature, ops_cfg)
        return SpeculativeState(inner, draft), {**metrics, **dm}

    return spec_update
