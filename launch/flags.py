"""Command-line flags (absl) and their translation into frozen configs.

Flags are read in exactly one place, `configs_from_flags`; everything below the
shell receives plain frozen dataclasses.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap

from absl import flags

import ops
from launch import engines
from launch.engines.config import RolloutConfig
from launch.modes import LoopModes
from launch.profiling import parse_profile_steps
from launch.rl import RolloutShaping
from miles_fn.advantages import ESTIMATORS
from miles_fn.config import ModelConfig
from miles_fn.draft import ALGORITHMS as SPEC_ALGORITHMS
from miles_fn.draft import SpeculativeConfig
from miles_fn.lora import ALL_TARGETS as ALL_LORA_TARGETS
from miles_fn.lora import LoraConfig, parse_targets
from miles_fn.losses import AGG_MODES, KL_ESTIMATORS, POLICY_LOSSES
from miles_fn.memory import MemoryConfig
from miles_fn.objective import ObjectiveConfig
from miles_fn.offpolicy import OffPolicyConfig
from miles_fn.optim import OptimConfig
from miles_fn.sampling import SamplingConfig
from miles_fn.train import PolicyLossConfig

FLAGS = flags.FLAGS

# == Run: what runs, where its outputs go
flags.DEFINE_integer("seed", 0, "Root seed; every random draw of the run derives from it.", lower_bound=0)
flags.DEFINE_integer("num_steps", 100, "RL steps (rollout + update).", lower_bound=0)
flags.DEFINE_string("output_dir", "runs/default", "Where metrics, checkpoints and plots go.")
flags.DEFINE_integer("save_every", 0, "Checkpoint every N steps (0 = only at the end).", lower_bound=0)
flags.DEFINE_integer("num_threads", 2, "torch intra-op threads.", lower_bound=1)
flags.DEFINE_boolean("deterministic", True, "torch.use_deterministic_algorithms and fixed threading.")
flags.DEFINE_boolean("tensorboard", True, "Also write TensorBoard event files.")
flags.DEFINE_boolean("progress", True, "Show a progress bar.")
flags.DEFINE_boolean("resume", False, "Continue exactly from the latest checkpoint under <output_dir>/checkpoints.")

# == Model: a random init's shape, or a checkpoint
flags.DEFINE_string("hf_checkpoint", "", "Start from this Hugging Face checkpoint directory instead of a random init; "
                    "a .gguf file or a model name (smollm2-135m-instruct, from the real extra) is converted to one "
                    "once, under --model_cache_dir (state/gguf_import.py).")
flags.DEFINE_string("model_cache_dir", "~/.cache/miles_fn/models", "Where --hf_checkpoint=FILE.gguf or a model name "
                    "is converted to a checkpoint directory (one per GGUF file, reused while its sha256 matches).")
flags.DEFINE_integer("hidden_size", 128, "Hidden size of a randomly initialised model.", lower_bound=8)
flags.DEFINE_integer("intermediate_size", 384, "MLP size of a randomly initialised model.", lower_bound=8)
flags.DEFINE_integer("num_layers", 2, "Layers of a randomly initialised model.", lower_bound=1)
flags.DEFINE_integer("num_heads", 4, "Attention heads of a randomly initialised model.", lower_bound=1)
flags.DEFINE_integer("num_kv_heads", 2, "Key/value heads of a randomly initialised model.", lower_bound=1)
flags.DEFINE_enum("model_type", "qwen2", ["qwen2", "llama", "qwen3", "qwen3_moe"],
                  "Architecture of a randomly initialised model (qwen3_moe: see the MoE section).")
flags.DEFINE_float("init_std", 0.02, "Std of the random init.", lower_bound=0.0)

# == Task and data: what is prompted and how it is scored (launch/data.py, launch/plugins.py)
flags.DEFINE_enum("task", "addition", ["addition", "chat_arith"], "The built-in task: addition (the character "
                  "tokenizer's '17+25='), or chat_arith (arithmetic questions through --hf_checkpoint's chat template, "
                  "reward 1 when the reply's last integer is the answer; miles_fn/tasks/chat_arith.py).")
flags.DEFINE_boolean("task_reverse_answer", False, "Addition answers written least-significant digit first.")
flags.DEFINE_boolean("task_fixed_width", False, "Zero-pad addition operands and sums to a fixed width.")
flags.DEFINE_integer("task_digits", 2, "Digits per operand of the addition task (chat_arith: of the first operand).",
                     lower_bound=1, upper_bound=6)
flags.DEFINE_integer("task_second_digits", 0, "chat_arith: digits of the second operand (0 = --task_digits).",
                     lower_bound=0, upper_bound=6)
flags.DEFINE_string("task_ops", "+", "chat_arith: the operators its questions draw from, some of +-* (e.g. +-).")
flags.DEFINE_integer("eval_every", 10, "Evaluate held-out success every N steps (0 = at the end only).", lower_bound=0)
flags.DEFINE_integer("eval_size", 256, "Held-out prompts per evaluation.", lower_bound=1)
flags.DEFINE_string("custom_generate_fn", "", "module:function for multi-turn / tool rollouts (launch/plugins.py).")
flags.DEFINE_string("custom_reward_fn", "", "module:function scoring one sample, sync or async (launch/plugins.py).")
flags.DEFINE_enum("reward_errors", "raise", ["raise", "zero"], "A failing reward function (it raises, returns nan, "
                  "inf or a non-number, or overruns --reward_timeout_s) stops the run, or scores 0.")
flags.DEFINE_float("reward_timeout_s", 300.0, "Seconds one --custom_reward_fn call may take (0 = no limit); past it "
                   "the sample fails as under --reward_errors.", lower_bound=0.0)
flags.DEFINE_string("prompt_data", "", "JSONL prompt dataset instead of the task's prompts (launch/data.py).")
flags.DEFINE_string("eval_data", "", "JSONL held-out prompts (same keys as --prompt_data) for evaluation: greedy, "
                    "generated and scored as the run's rollouts are; needs --prompt_data. Without it a "
                    "--prompt_data run skips evaluation (nan).")
flags.DEFINE_string("input_key", "input", "Field of a --prompt_data row holding the prompt.")
flags.DEFINE_string("label_key", "label", "Field of a --prompt_data row holding the label ('' = none).")
flags.DEFINE_integer("eval_pass_k", 0, "Also report pass@1 and pass@k from k samples per held-out prompt.",
                     lower_bound=0)
flags.DEFINE_string("tokenizer", "", "Hugging Face tokenizer directory for --prompt_data prompts (its chat template, "
                    "if any, is applied; its EOS stops generation). Default: --hf_checkpoint's, when it holds one.")

# == Rollout: sampling and the engine that generates (launch/engines/)
flags.DEFINE_integer("prompts_per_step", 32, "Prompts per RL step.", lower_bound=1)
flags.DEFINE_integer("group_size", 8, "Samples per prompt (the GRPO group).", lower_bound=1)
flags.DEFINE_float("temperature", 1.0, "Sampling temperature (0 = greedy).", lower_bound=0.0)
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass.", lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_integer("top_k", 0, "Top-k sampling (0 = off).", lower_bound=0)
flags.DEFINE_integer("max_new_tokens", 0, "Response length cap (0 = what the task needs).", lower_bound=0)
flags.DEFINE_enum("rollout_backend", "embedded", ["embedded", "http", "sglang"],
                  "Who generates: this process, launch.rollout_server over HTTP, or SGLang.")
flags.DEFINE_integer("rollout_batch_size", 0, "Requests per engine call (0 = the whole step); results depend on it.",
                     lower_bound=0)
flags.DEFINE_integer("prefix_cache_mb", 256, "embedded and http backends: MiB of prompt prefixes (turns cut at a "
                     "stop token) kept across engine calls until the weights change; only speed depends on it "
                     "(0 = off).", lower_bound=0)
flags.DEFINE_string("rollout_url", "", "http backend: an already running launch.rollout_server (else one is started).")
flags.DEFINE_integer("rollout_num_engines", 1, "http backend: rollout servers to start; more than 1 puts the real "
                     "sglang-router in front of them (needs --rollout_batch_size=1).", lower_bound=1)
flags.DEFINE_string("rollout_router_url", "", "http backend: an existing sglang-router; the servers it lists are the "
                    "fleet (weights go to each directly; needs --rollout_batch_size=1).")
flags.DEFINE_enum("rollout_router_policy", "round_robin", ["round_robin", "cache_aware", "power_of_two", "random"],
                  "--policy of the router a --rollout_num_engines fleet starts.")
flags.DEFINE_string("sglang_url", "", "sglang backend: a running SGLang server or router (else one is started).")
flags.DEFINE_integer("rollout_max_inflight", 8, "Engine calls in flight at once (http, sglang).", lower_bound=1)
flags.DEFINE_float("rollout_timeout_s", 120.0, "Seconds one engine call may take before the server counts as down.",
                   lower_bound=0.1)
flags.DEFINE_integer("rollout_max_restarts", 3, "Server recoveries per batch before the run stops.", lower_bound=0)
flags.DEFINE_float("rollout_backoff_s", 0.5, "First wait before a recovery attempt; doubles per attempt.",
                   lower_bound=0.0)
flags.DEFINE_enum("rollout_weight_sync", "tensor", ["tensor", "disk", "distributed"],
                  "Weights to the server by request body (http), checkpoint file, or broadcast over a "
                  "torch.distributed group (NCCL on CUDA, gloo on CPU; http and sglang).")
flags.DEFINE_string("rollout_weight_group_host", "127.0.0.1", "distributed sync: the trainer's address that the "
                    "server dials to join the weight-update group (the trainer listens on it only).")
flags.DEFINE_integer("sglang_tp_size", 1, "sglang: --tp-size of a started server.", lower_bound=1)
flags.DEFINE_float("sglang_mem_fraction_static", 0.7, "sglang: --mem-fraction-static of a started server.",
                   lower_bound=0.05, upper_bound=0.99)
flags.DEFINE_float("over_sampling", 1.0, "Draw this many times --prompts_per_step and train on the groups whose "
                   "rewards differ (then constant ones).", lower_bound=1.0)
flags.DEFINE_string("save_rollouts", "", "Write each RL step's rollout buffer under DIR/step_N.")
flags.DEFINE_string("load_rollouts", "", "Train from buffers saved by --save_rollouts in DIR (no rollout).")

# == Algorithm: advantages, policy loss, KL, DAPO shaping (miles_fn.advantages / losses / objective;
#    launch/flags/*.flags show combinations)
flags.DEFINE_float("eps_clip", 0.2, "PPO clip epsilon (low side).", lower_bound=0.0)
flags.DEFINE_boolean("shared_prefix", True, "Train a group's samples with their common prefix (the prompt) run "
                     "once: the same gradient for fewer tokens (bitwise the same log-probs with --true_on_policy); "
                     "packed micro-batches keep the plain forward.")
flags.DEFINE_boolean("skip_zero_advantage_rows", True, "Train only the rows with a non-zero advantage (a group "
                     "of equal rewards has none): the same update for less work, since those rows add exactly 0 to "
                     "the loss and its gradient; the loss still divides by the whole batch's counts. Applies when "
                     "every loss term scales with the advantage (no KL loss, no entropy bonus, no --custom_loss); "
                     "the policy metrics are then over the trained rows (metric train_rows_frac).")
flags.DEFINE_float("eps_clip_high", -1.0, "PPO clip epsilon, high side (-1 = eps_clip).")
flags.DEFINE_float("kl_coef", 0.0, "Weight of the KL to the initial policy (0 = no reference).", lower_bound=0.0)
flags.DEFINE_enum("loss_agg", "token_mean", list(AGG_MODES), "Loss aggregation (see miles_fn.losses.aggregate).")
flags.DEFINE_boolean("normalize_advantage_std", True, "GRPO std normalisation (off = Dr. GRPO).")
flags.DEFINE_enum("advantage_estimator", "grpo", sorted(ESTIMATORS),
                  "grpo, dr_grpo (no std), rloo, reinforce (batch-mean baseline), reinforce_pp, gae (PPO with a "
                  "value model).")
flags.DEFINE_enum("policy_loss", "ppo_clip", sorted(POLICY_LOSSES), "ppo_clip, dual_clip, gspo (sequence ratio), pg.")
flags.DEFINE_enum("kl_type", "k3", sorted(KL_ESTIMATORS), "KL estimator to the reference (k1, k2, k3).")
flags.DEFINE_float("kl_clamp", 10.0, "Clamp of the log-ratio inside the KL estimators.", lower_bound=0.0)
flags.DEFINE_boolean("use_kl_loss", True, "--kl_coef weighs a KL loss term (True) or a KL penalty in the reward.")
flags.DEFINE_float("entropy_coef", 0.0, "Weight of the entropy bonus (full-vocabulary entropy).", lower_bound=0.0)
flags.DEFINE_float("dual_clip_c", 3.0, "Dual-clip constant c > 1 (--policy_loss=dual_clip).", lower_bound=1.0)
flags.DEFINE_float("value_coef", 1.0, "Weight of the value loss (PPO's critic).", lower_bound=0.0)
flags.DEFINE_float("value_clip", 0.2, "Clip of the value update around the rollout values (0 = off).", lower_bound=0.0)
flags.DEFINE_float("critic_lr", 1e-3, "Learning rate of the value model.", lower_bound=0.0)
flags.DEFINE_float("gamma", 1.0, "Discount (GAE, REINFORCE++).", lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_float("lam", 0.95, "GAE lambda.", lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_boolean("dynamic_sampling", False, "DAPO: drop groups whose rewards are all equal and resample.")
flags.DEFINE_integer("dynamic_sampling_max_rounds", 4, "Generation rounds per step at most.", lower_bound=1)
flags.DEFINE_integer("overlong_buffer", 0, "DAPO soft overlong punishment over the last N tokens (0 = off).",
                     lower_bound=0)
flags.DEFINE_float("overlong_penalty_factor", 1.0, "Size of the overlong punishment.", lower_bound=0.0)
flags.DEFINE_string("custom_loss", "", "module:factory of a policy loss, factory(model_cfg, ObjectiveConfig) -> "
                    "loss_fn (e.g. examples.composed_loss:make_loss); replaces --policy_loss's.")

# == Optimisation: AdamW and the RL phase's learning-rate schedule (miles_fn/optim.py)
flags.DEFINE_float("lr", 1e-3, "Peak learning rate of the RL phase.", lower_bound=0.0)
flags.DEFINE_float("min_lr", 0.0, "Floor the learning rate decays to (--lr_decay).", lower_bound=0.0)
flags.DEFINE_integer("warmup_steps", 0, "Linear warm-up steps of the RL phase.", lower_bound=0)
flags.DEFINE_integer("decay_steps", 0, "Steps after warm-up over which --lr decays to --min_lr (0 = constant).",
                     lower_bound=0)
flags.DEFINE_enum("lr_decay", "cosine", ["cosine", "linear"], "Shape of the decay over --decay_steps.")
flags.DEFINE_float("weight_decay", 0.0, "AdamW decoupled weight decay.", lower_bound=0.0)
flags.DEFINE_float("max_grad_norm", 1.0, "Global-norm gradient clipping (0 = off).", lower_bound=0.0)
flags.DEFINE_float("adam_beta1", 0.9, "AdamW beta1.", lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_float("adam_beta2", 0.999, "AdamW beta2.", lower_bound=0.0, upper_bound=1.0)

# == LoRA: train low-rank adapters of a frozen base instead of every weight (miles_fn/lora.py)
flags.DEFINE_integer("lora_rank", 0, "Rank r of the LoRA adapters (0 = off: every weight trains). Applies to RL, "
                     "the SFT warm-up and --sft alike; the engine is sent the merged weights.", lower_bound=0)
flags.DEFINE_float("lora_alpha", 16.0, "LoRA scale numerator: the adapted weight is W + (alpha / r) B A.",
                   lower_bound=0.0)
flags.DEFINE_string("lora_targets", ",".join(ALL_LORA_TARGETS), "Comma list of the linears each layer adapts, of "
                    f"{','.join(ALL_LORA_TARGETS)} (q_proj-style names too).")

# == Supervised: the warm-up before RL, and --sft runs
flags.DEFINE_integer("sft_warmup_steps", 0, "Supervised steps on task answers before RL (reported).", lower_bound=0)
flags.DEFINE_integer("sft_batch_size", 64, "Examples per supervised step.", lower_bound=1)
flags.DEFINE_float("sft_lr", 1e-3, "Learning rate of the supervised warm-up.", lower_bound=0.0)
flags.DEFINE_boolean("sft", False, "Supervised fine-tuning on --sft_data for --num_steps steps, no rollouts.")
flags.DEFINE_string("sft_data", "", "Prompt/response JSONL for --sft (e.g. examples/addition_sft.jsonl).")

# == Packing and memory: miles_fn.packing, miles_fn.memory, launch.memory
flags.DEFINE_integer("max_tokens_per_micro_batch", 0, "Pack samples into micro-batches of at most this many padded "
                     "tokens and accumulate gradients over them (0 = the whole batch at once, right-padded).",
                     lower_bound=0)
flags.DEFINE_integer("pack_row_len", 0, "Tokens per packed row (0 = the step's longest sample; "
                     "= --max_tokens_per_micro_batch gives one flash-attn varlen row per micro-batch).", lower_bound=0)
flags.DEFINE_boolean("recompute", False, "Recompute each layer's activations in the backward pass (less memory, "
                     "one more forward).")
flags.DEFINE_float("memory_margin_gb", 0.0, "Memory the token-budget planner leaves free (CUDA: of mem_get_info; "
                   "CPU: of MemAvailable).", lower_bound=0.0)
flags.DEFINE_boolean("offload_train_state", False, "Park params and optimizer state in host memory while the "
                     "rollout engine runs (colocated mode).")
flags.DEFINE_integer("max_oom_splits", 3, "Times an out-of-memory micro-batch may be halved and retried "
                     "(micro-batches exist only with --max_tokens_per_micro_batch).", lower_bound=0)

# == True on-policy and kernels: ops/, miles_fn/offpolicy.py
flags.DEFINE_boolean("true_on_policy", False, "Engine and trainer run the batch-invariant ops (ops.INVARIANT): the "
                     "embedded engine's log-probs equal the trainer's bit for bit; sglang: start it with "
                     "--enable-deterministic-inference.")
flags.DEFINE_enum("attention_backend", "torch", list(ops.config.ATTENTION_BACKENDS),
                  "Attention kernels: torch (SDPA / invariant blocked), flash_attn (varlen), flash_attn_3.")
flags.DEFINE_enum("gemm_backend", "torch", list(ops.config.GEMM_BACKENDS), "GEMM kernels: torch or deep_gemm (FP8).")
flags.DEFINE_boolean("compile", False, "torch.compile the model forward (CPU and GPU).")
flags.DEFINE_enum("decode_backend", "auto", list(ops.config.DECODE_BACKENDS),
                  "The embedded engine's decode steps: torch (model.forward), cpu_kernel (each step one C call: "
                  "ops/csrc/decode_cpu.c, built on first use with the system C compiler), or auto (cpu_kernel "
                  "where it runs: CPU float32 weights, no --true_on_policy or --compile, a compiler here).")
flags.DEFINE_integer("invariant_tile_rows", 64, "Rows per GEMM call of the invariant linear.", lower_bound=1)
flags.DEFINE_integer("invariant_grad_tile_tokens", 2048, "With --true_on_policy and --max_tokens_per_micro_batch: "
                     "padded tokens per gradient tile, the fixed unit gradients are computed and summed in, so the "
                     "update does not depend on the budget (which must hold one tile).", lower_bound=1)
flags.DEFINE_integer("invariant_kv_block", 1, "Key positions per block of the invariant attention (1 = one at a "
                     "time: fastest for short sequences; 16+ for long ones).", lower_bound=1)
flags.DEFINE_enum("offpolicy_correction", "none", ["none", "tis", "mis"],
                  "Importance-weight the policy loss for the train/inference mismatch: truncated (tis) or "
                  "masked (mis).")
flags.DEFINE_float("tis_cap", 2.0, "TIS: cap on the importance ratio pi_train / pi_engine.", lower_bound=0.0)
flags.DEFINE_float("mis_low", 0.5, "MIS: tokens with a ratio below this leave the loss.", lower_bound=0.0)
flags.DEFINE_float("mis_high", 2.0, "MIS: tokens with a ratio above this leave the loss.", lower_bound=0.0)

# == Loop modes: launch/modes.py
flags.DEFINE_boolean("debug_rollout_only", False, "Debug the rollout side alone: roll out and score every step, "
                     "log metrics (and --save_rollouts), never train, sync weights or checkpoint.")
flags.DEFINE_boolean("debug_train_only", False, "Debug the trainer alone: no rollout engine is built; each step "
                     "trains on --load_rollouts=DIR (required), and evaluation is skipped.")
flags.DEFINE_boolean("partial_rollouts", False, "With --over_sampling > 1: generate in rounds of "
                     "--partial_rollout_tokens; once a step has enough finished groups the rest stop and carry "
                     "their partial responses into the next step, which continues them (launch/partial.py).")
flags.DEFINE_integer("partial_rollout_tokens", 0, "New tokens per sample per generation round under "
                     "--partial_rollouts (0 = a quarter of max_new_tokens, at least 1).", lower_bound=0)
flags.DEFINE_boolean("async_rollout", False, "Roll out step k+1 while step k trains (one step off-policy: step "
                     "k+1's samples come from the weights before step k's update); logs staleness_mean/max.")

# == Debugging and replay: snapshots for `python -m launch.replay`, profiles, and debug hooks of the tests
flags.DEFINE_string("profile_steps", "", "A:B writes torch.profiler Chrome traces of RL steps A..B (inclusive, "
                    "numbered as in metrics.jsonl) under output_dir/profile/; empty = off.")
flags.DEFINE_string("debug_rollout_server_fault", "", "Tests: crash_once:N, crash_always:N or crash_permanent:N "
                    "(the started server dies on /generate call N), crash_in_sync:N (inside its Nth distributed "
                    "weight update) or group_unreachable; see launch/engines/__init__.py.")
flags.DEFINE_list("snapshot_steps", [], "RL steps (1-based, e.g. 1,5,9) to snapshot for `python -m launch.replay`; "
                  "a failed step is always snapshotted.")
flags.DEFINE_integer("debug_nan_at_step", 0, "Debug: plant a NaN in the advantages of RL step K (0 = off).",
                     lower_bound=0)
flags.DEFINE_string("debug_block_at", "", "Debug: block forever at POINT:STEP, POINT one of sft_step, rl_step "
                    "(before the update of that 1-based step) or checkpoint_write (of the checkpoint of that "
                    "state step), so that a test can kill the job there.")
flags.DEFINE_string("debug_exit_rank", "", "Debug under torchrun: RANK:STEP kills that rank (SIGKILL) as RL step STEP "
                    "starts, to show that the job ends with an error naming it instead of hanging.")
flags.DEFINE_float("dist_timeout_s", 1800.0, "Under torchrun: the longest any collective waits for the other "
                   "ranks before the job fails naming the rank and phase; it must exceed a step's rollout and "
                   "evaluation, which rank 0 runs while the others wait.", lower_bound=1.0)

# == Speculative decoding: a draft LM trained online, samples identical to plain decoding (miles_fn/speculative.py)
flags.DEFINE_enum("speculative_algorithm", "none", list(SPEC_ALGORITHMS), "STANDALONE: a small separate draft LM "
                  "proposes --speculative_num_steps tokens greedily, one target forward verifies them; every token "
                  "is still the target's own sample from its own key (bitwise plain decoding with "
                  "--true_on_policy). The embedded engine and the rollout servers (--rollout_backend=http) speculate.")
flags.DEFINE_integer("speculative_num_steps", 3, "Draft tokens proposed per verify forward (k).", lower_bound=1)
flags.DEFINE_string("draft_checkpoint", "", "Hugging Face directory of a small LM with the target's vocabulary to "
                    "start the draft from (empty = a random draft of --draft_hidden_size x --draft_num_layers).")
flags.DEFINE_integer("draft_hidden_size", 64, "A random draft's hidden size.", lower_bound=2)
flags.DEFINE_integer("draft_num_layers", 1, "A random draft's decoder layers.", lower_bound=1)
flags.DEFINE_integer("draft_train_steps", 1, "AdamW steps of the draft per RL step on that step's rollouts "
                     "(soft cross-entropy to the updated policy).", lower_bound=0)
flags.DEFINE_float("draft_lr", 3e-3, "The draft's AdamW learning rate.", lower_bound=0.0)
flags.DEFINE_boolean("freeze_draft", False, "Keep the start-of-run draft (no online training), for comparison.")
flags.DEFINE_integer("speculative_disable_by_batch_size", 0, "A decode round with more live rows than this is a "
                     "plain step (vLLM's name): where a step is compute-bound a verify of k+1 tokens a row costs k+1 "
                     "steps. The tokens are the same either way. 0 = always speculate.", lower_bound=0)
flags.register_multi_flags_validator(
    ["speculative_algorithm", "rollout_backend"],
    lambda v: v["speculative_algorithm"] == "none" or v["rollout_backend"] != "sglang",
    "--speculative_algorithm=STANDALONE with --rollout_backend=sglang: SGLang takes a draft's new weights only "
    "through /update_weights_from_tensor with draft_only, whose payload is pickle (never sent from here); use "
    "--rollout_backend=embedded or http (launch.rollout_server speculates, its draft synced each step)",
)
flags.register_multi_flags_validator(
    ["speculative_algorithm", "lora_rank", "advantage_estimator", "offload_train_state"],
    lambda v: v["speculative_algorithm"] == "none" or (v["lora_rank"] == 0 and v["advantage_estimator"] != "gae"
                                                      and not v["offload_train_state"]),
    "--speculative_algorithm=STANDALONE does not combine with --lora_rank, --advantage_estimator=gae or "
    "--offload_train_state yet (the draft's state wraps a plain TrainState); turn those off or speculation off",
)

# == MoE and rollout routing replay: a random Qwen3-MoE's experts, R3 (miles_fn/moe.py, miles_fn/routing.py)
flags.DEFINE_integer("num_experts", 8, "--model_type=qwen3_moe: experts per MoE layer.", lower_bound=1)
flags.DEFINE_integer("num_experts_per_tok", 2, "--model_type=qwen3_moe: experts each token is routed to (top-k).",
                     lower_bound=1)
flags.DEFINE_integer("moe_intermediate_size", 96, "--model_type=qwen3_moe: each expert's MLP size.", lower_bound=1)
flags.DEFINE_float("router_aux_loss_coef", 0.001, "--model_type=qwen3_moe: weight of the router's load-balancing "
                   "loss in the policy loss (a checkpoint's config.json value wins).", lower_bound=0.0)
flags.DEFINE_boolean("routing_replay", False, "R3: the trainer's MoE layers run the experts the engine recorded, "
                     "gated by the trainer's own router probabilities. MoE models only; not with packing "
                     "(--max_tokens_per_micro_batch), --shared_prefix, --partial_rollouts or --recompute.")
flags.register_multi_flags_validator(
    ["routing_replay", "model_type", "hf_checkpoint"],
    lambda v: not v["routing_replay"] or v["model_type"] == "qwen3_moe" or bool(v["hf_checkpoint"]),
    "--routing_replay needs a MoE model: --model_type=qwen3_moe (or a Qwen3-MoE --hf_checkpoint)")
flags.register_multi_flags_validator(
    ["routing_replay", "max_tokens_per_micro_batch", "shared_prefix", "partial_rollouts", "recompute"],
    lambda v: not v["routing_replay"] or not (v["max_tokens_per_micro_batch"] or v["shared_prefix"]
                                              or v["partial_rollouts"] or v["recompute"]),
    "--routing_replay is not supported with --max_tokens_per_micro_batch, --shared_prefix, --partial_rollouts or "
    "--recompute: add --noshared_prefix and drop the others")
flags.register_multi_flags_validator(
    ["routing_replay", "speculative_algorithm"],
    lambda v: not v["routing_replay"] or v["speculative_algorithm"] == "none",
    "--routing_replay does not combine with --speculative_algorithm yet (the verify forward records no routes): "
    "set --speculative_algorithm=none or --norouting_replay")

# == Validation: flag combinations and values that no single bound expresses
flags.register_multi_flags_validator(
    ["memory_margin_gb", "pack_row_len", "max_tokens_per_micro_batch"],
    lambda v: v["max_tokens_per_micro_batch"] > 0 or (v["memory_margin_gb"] == 0 and v["pack_row_len"] == 0),
    "--memory_margin_gb and --pack_row_len shape the micro-batches of --max_tokens_per_micro_batch: without a "
    "budget (--max_tokens_per_micro_batch=0, the whole batch at once) they would do nothing; set one",
)
flags.register_multi_flags_validator(
    ["pack_row_len", "max_tokens_per_micro_batch"],
    lambda v: not v["pack_row_len"] or not v["max_tokens_per_micro_batch"]
    or v["pack_row_len"] <= v["max_tokens_per_micro_batch"],
    "--pack_row_len must not exceed --max_tokens_per_micro_batch",
)


def _profile_steps_ok(text: str) -> bool:
    try:
        parse_profile_steps(text)
    except ValueError:
        return False
    return True


flags.register_validator("profile_steps", _profile_steps_ok, "--profile_steps must be A:B with 1 <= A <= B, e.g. 3:5")
flags.register_multi_flags_validator(
    ["eval_data", "prompt_data"], lambda v: not v["eval_data"] or bool(v["prompt_data"]),
    "--eval_data needs --prompt_data (the task's own held-out pairs are its evaluation set otherwise)")
def _fleet_ok(v: dict) -> bool:
    """A fleet (a router in front) runs one request per /generate call and syncs each server by tensor or disk."""
    if v["rollout_num_engines"] == 1 and not v["rollout_router_url"]:
        return True
    return (v["rollout_backend"] == "http" and not v["rollout_url"] and v["rollout_batch_size"] == 1
            and v["rollout_weight_sync"] != "distributed"
            and not (v["rollout_router_url"] and v["rollout_num_engines"] > 1))


flags.register_multi_flags_validator(
    ["rollout_num_engines", "rollout_router_url", "rollout_backend", "rollout_url", "rollout_batch_size",
     "rollout_weight_sync"], _fleet_ok,
    "--rollout_num_engines > 1 and --rollout_router_url need --rollout_backend=http, --rollout_batch_size=1 (the "
    "router forwards one sampling_params, so one seed, per /generate call), --rollout_weight_sync=tensor or disk, "
    "and no --rollout_url; --rollout_router_url adopts the router's servers, so it excludes --rollout_num_engines > 1",
)
flags.register_validator(
    "debug_rollout_server_fault", lambda v: not v or engines.valid_fault(v),
    f"--debug_rollout_server_fault must be {engines.FAULTS}",
)
flags.register_multi_flags_validator(
    ["true_on_policy", "compile", "decode_backend"],
    lambda v: v["decode_backend"] != "cpu_kernel" or not (v["true_on_policy"] or v["compile"]),
    "--decode_backend=cpu_kernel cannot be combined with --true_on_policy or --compile: the C decode kernel is "
    "neither batch-invariant nor compiled (--decode_backend=auto falls back to torch there)",
)
flags.register_multi_flags_validator(
    ["true_on_policy", "compile"],
    lambda v: not (v["true_on_policy"] and v["compile"]),
    "--compile cannot be combined with --true_on_policy: torch.compile re-fuses the reductions the invariant "
    "kernels fix, so engine and trainer would no longer agree bit for bit",
)
flags.register_validator("snapshot_steps", lambda v: all(s.strip().isdigit() and int(s) > 0 for s in v),
                         "--snapshot_steps must be a comma-separated list of positive RL steps, e.g. 1,5,9")
flags.register_validator("debug_block_at", lambda v: v == "" or (
    v.partition(":")[0] in ("sft_step", "rl_step", "checkpoint_write") and v.partition(":")[2].isdigit()),
    "--debug_block_at must be POINT:STEP with POINT one of sft_step, rl_step, checkpoint_write")
flags.register_validator("debug_exit_rank", lambda v: v == "" or (
    v.partition(":")[0].isdigit() and v.partition(":")[2].isdigit()), "--debug_exit_rank must be RANK:STEP, e.g. 1:3")
flags.register_multi_flags_validator(
    ["num_heads", "num_kv_heads"],
    lambda v: v["num_heads"] % v["num_kv_heads"] == 0,
    "--num_heads must be a multiple of --num_kv_heads",
)
flags.register_multi_flags_validator(
    ["hidden_size", "num_heads"],
    lambda v: v["hidden_size"] % v["num_heads"] == 0,
    "--hidden_size must divide by --num_heads",
)
flags.register_multi_flags_validator(
    ["hidden_size", "num_heads"],
    lambda v: v["hidden_size"] % v["num_heads"] or (v["hidden_size"] // v["num_heads"]) % 2 == 0,
    "--hidden_size / --num_heads (the head size) must be even: RoPE rotates pairs of dimensions",
)
flags.register_validator("task_ops", lambda v: bool(v) and set(v) <= set("+-*"),
                         "--task_ops must be one or more of the characters + - * (e.g. --task_ops=+-)")
flags.register_multi_flags_validator(
    ["task", "hf_checkpoint"], lambda v: v["task"] != "chat_arith" or bool(v["hf_checkpoint"]),
    "--task=chat_arith needs --hf_checkpoint (a model whose tokenizer has a chat template, e.g. "
    "--hf_checkpoint=smollm2-135m-instruct)")
flags.register_validator("top_p", lambda v: v > 0, "--top_p must be in (0, 1]: 0 would keep no token")
flags.register_validator("eps_clip_high", lambda v: v == -1 or v >= 0, "--eps_clip_high must be >= 0 (or -1 = "
                         "--eps_clip)")
flags.register_validator("dual_clip_c", lambda v: v > 1, "--dual_clip_c must be > 1")


def _lora_targets_ok(text: str) -> bool:
    try:
        parse_targets(text)
    except ValueError:
        return False
    return True


flags.register_validator("lora_targets", _lora_targets_ok, "--lora_targets must be a comma list of "
                         f"{','.join(ALL_LORA_TARGETS)} (or q_proj, k_proj, ... gate_proj, up_proj, down_proj)")
flags.register_validator("lora_alpha", lambda v: v > 0, "--lora_alpha must be > 0 (0 would freeze the model)")
flags.register_multi_flags_validator(
    ["lora_rank", "advantage_estimator"], lambda v: not v["lora_rank"] or v["advantage_estimator"] != "gae",
    "--lora_rank does not support --advantage_estimator=gae yet (the value model is a full copy of the trunk); "
    "use --lora_rank=0 or another --advantage_estimator")
for _beta in ("adam_beta1", "adam_beta2"):
    flags.register_validator(_beta, lambda v: v < 1, f"--{_beta} must be < 1: at 1 Adam's bias correction divides "
                             "by zero")
flags.register_multi_flags_validator(
    ["mis_low", "mis_high"], lambda v: not v["mis_low"] >= v["mis_high"], "--mis_low must be below --mis_high")
flags.register_multi_flags_validator(
    ["min_lr", "lr"], lambda v: not v["min_lr"] > v["lr"], "--min_lr must not exceed --lr (the schedule decays to it)")
# (The two comparisons above pass NaN on, so that the finite check at the end names the flag.)
# Estimators whose baseline is the group's other samples: with one sample a group every advantage is 0.
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
flags.register_multi_flags_validator(
    ["advantage_estimator", "group_size"],
    lambda v: v["advantage_estimator"] not in GROUP_ESTIMATORS or v["group_size"] >= 2,
    f"--group_size must be at least 2 for --advantage_estimator in {list(GROUP_ESTIMATORS)}: their baseline is the "
    "group's mean, so with one sample a group every advantage is 0 and nothing is learned (use "
    "--advantage_estimator=reinforce or reinforce_pp for one sample a prompt)",
)


@dataclasses.dataclass(frozen=True)
class ReproConfig:
    """Resume, snapshots and debug hooks: none of them changes the math of a step."""

    resume: bool = False
    snapshot_steps: tuple[int, ...] = ()
    debug_nan_at_step: int = 0
    debug_block_at: str = ""
    debug_exit_rank: str = ""  # torchrun: RANK:STEP, that rank kills itself as RL step STEP starts
    dist_timeout_s: float = 1800.0  # torchrun: every collective's timeout


@dataclasses.dataclass(frozen=True)
class RunConfig:
    seed: int
    num_steps: int
    output_dir: str
    save_every: int
    num_threads: int
    deterministic: bool
    tensorboard: bool
    progress: bool
    hf_checkpoint: str
    init_std: float
    task_digits: int
    task_reverse_answer: bool
    task_fixed_width: bool
    eval_every: int
    eval_size: int
    prompts_per_step: int
    group_size: int
    normalize_advantage_std: bool
    sft_warmup_steps: int
    sft_batch_size: int
    model: ModelConfig
    sampling: SamplingConfig
    optim: OptimConfig
    sft_optim: OptimConfig
    loss: PolicyLossConfig
    memory: MemoryConfig = MemoryConfig()
    rollout: RolloutConfig = RolloutConfig()
    profile_steps: tuple[int, int] | None = None
    repro: ReproConfig = ReproConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    shaping: RolloutShaping = RolloutShaping()
    sft: bool = False
    sft_data: str = ""
    custom_loss: str = ""
    ops: ops.OpsConfig = ops.REFERENCE
    offpolicy: OffPolicyConfig = OffPolicyConfig()
    modes: LoopModes = LoopModes()
    tokenizer: str = ""  # HF tokenizer directory for --prompt_data (resolved: --tokenizer or --hf_checkpoint's)
    lora: LoraConfig = LoraConfig()  # --lora_rank > 0: adapters train, the base stays frozen
    task: str = "addition"  # --task: the built-in task (chat_arith also reads task_second_digits, task_ops)
    task_second_digits: int = 0
    task_ops: str = "+"
    speculative: SpeculativeConfig = SpeculativeConfig()  # --speculative_algorithm: a draft LM in the engine


def configs_from_flags(vocab_size: int, stop_token_ids: tuple[int, ...], default_max_new: int,
                       tokenizer: str = "") -> RunConfig:
    """The run's configs; `tokenizer` is the resolved Hugging Face tokenizer directory of --prompt_data ('' = none)."""
    f = FLAGS
    model = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=f.hidden_size,
        intermediate_size=f.intermediate_size,
        num_layers=f.num_layers,
        num_heads=f.num_heads,
        num_kv_heads=f.num_kv_heads,
        model_type=f.model_type,
        attention_bias=f.model_type == "qwen2",
        **({} if f.model_type != "qwen3_moe" else dict(
            num_experts=f.num_experts, num_experts_per_tok=f.num_experts_per_tok,
            moe_intermediate_size=f.moe_intermediate_size, router_aux_loss_coef=f.router_aux_loss_coef)),
        max_position_embeddings=64,
    )
    sampling = SamplingConfig(
        temperature=f.temperature,
        top_k=f.top_k,
        top_p=f.top_p,
        max_new_tokens=f.max_new_tokens or default_max_new,
        stop_token_ids=stop_token_ids,
    )
    optim = OptimConfig(
        lr=f.lr,
        min_lr=f.min_lr,
        warmup_steps=f.warmup_steps,
        decay_steps=f.decay_steps,
        decay=f.lr_decay,
        beta1=f.adam_beta1,
        beta2=f.adam_beta2,
        weight_decay=f.weight_decay,
        max_grad_norm=f.max_grad_norm,
        schedule_start=f.sft_warmup_steps,  # RL's warm-up and decay start after the supervised steps
    )
    loss = PolicyLossConfig(
        eps_clip=f.eps_clip,
        eps_clip_high=None if f.eps_clip_high < 0 else f.eps_clip_high,
        kl_coef=f.kl_coef,
        loss_agg=f.loss_agg,
        temperature=sampling.logprob_temperature,
        shared_prefix=f.shared_prefix,
        routing_replay=f.routing_replay,
    )
    return RunConfig(
        seed=f.seed,
        num_steps=f.num_steps,
        output_dir=f.output_dir,
        save_every=f.save_every,
        num_threads=f.num_threads,
        deterministic=f.deterministic,
        tensorboard=f.tensorboard,
        progress=f.progress,
        hf_checkpoint=f.hf_checkpoint,
        init_std=f.init_std,
        task_digits=f.task_digits,
        task_reverse_answer=f.task_reverse_answer,
        task_fixed_width=f.task_fixed_width,
        eval_every=f.eval_every,
        eval_size=f.eval_size,
        prompts_per_step=f.prompts_per_step,
        group_size=f.group_size,
        normalize_advantage_std=f.normalize_advantage_std,
        sft_warmup_steps=f.sft_warmup_steps,
        sft_batch_size=f.sft_batch_size,
        model=model,
        sampling=sampling,
        optim=optim,
        sft_optim=dataclasses.replace(optim, lr=f.sft_lr, warmup_steps=0, decay_steps=0, schedule_start=0),
        loss=loss,
        memory=MemoryConfig(
            max_tokens_per_micro_batch=f.max_tokens_per_micro_batch,
            pack_row_len=f.pack_row_len,
            recompute=f.recompute,
            memory_margin_gb=f.memory_margin_gb,
            offload_train_state=f.offload_train_state,
            max_oom_splits=f.max_oom_splits,
            grad_tile_tokens=f.invariant_grad_tile_tokens if f.true_on_policy else 0,
        ),
        rollout=rollout_config_from_flags(),
        profile_steps=parse_profile_steps(f.profile_steps),
        repro=ReproConfig(
            resume=f.resume,
            snapshot_steps=tuple(int(s) for s in f.snapshot_steps),
            debug_nan_at_step=f.debug_nan_at_step,
            debug_block_at=f.debug_block_at,
            debug_exit_rank=f.debug_exit_rank,
            dist_timeout_s=f.dist_timeout_s,
        ),
        objective=ObjectiveConfig(
            advantage_estimator=f.advantage_estimator,
            policy_loss=f.policy_loss,
            loss_agg=f.loss_agg,
            max_response_len=sampling.max_new_tokens,
            eps_clip=f.eps_clip,
            eps_clip_high=loss.eps_clip_high,
            dual_clip_c=f.dual_clip_c,
            kl_type=f.kl_type,
            kl_coef=f.kl_coef,
            kl_clamp=f.kl_clamp,
            use_kl_loss=f.use_kl_loss,
            entropy_coef=f.entropy_coef,
            value_coef=f.value_coef,
            value_clip=f.value_clip,
            gamma=f.gamma,
            lam=f.lam,
            normalize_std=f.normalize_advantage_std,
            temperature=sampling.logprob_temperature,
            shared_prefix=f.shared_prefix,
            routing_replay=f.routing_replay,
            skip_zero_advantage_rows=f.skip_zero_advantage_rows,
        ),
        shaping=RolloutShaping(f.dynamic_sampling, f.dynamic_sampling_max_rounds, f.overlong_buffer,
                               f.overlong_penalty_factor, f.critic_lr),
        sft=f.sft,
        sft_data=f.sft_data,
        custom_loss=f.custom_loss,
        ops=ops_config_from_flags(),
        offpolicy=offpolicy_config_from_flags(),
        modes=LoopModes(f.debug_rollout_only, f.debug_train_only, f.partial_rollouts, f.partial_rollout_tokens,
                        f.async_rollout),
        tokenizer=tokenizer,
        lora=LoraConfig(rank=f.lora_rank, alpha=f.lora_alpha, targets=parse_targets(f.lora_targets)),
        task=f.task,
        task_second_digits=f.task_second_digits,
        task_ops=f.task_ops,
        speculative=SpeculativeConfig(f.speculative_algorithm, f.speculative_num_steps, f.draft_checkpoint,
                                      f.draft_hidden_size, f.draft_num_layers, f.draft_train_steps, f.draft_lr,
                                      f.freeze_draft, f.speculative_disable_by_batch_size),
    )


def rollout_config_from_flags() -> RolloutConfig:
    f = FLAGS
    return RolloutConfig(
        backend=f.rollout_backend,
        batch_size=f.rollout_batch_size,
        prefix_cache_mb=f.prefix_cache_mb,
        url=f.rollout_url,
        num_engines=f.rollout_num_engines,
        router_url=f.rollout_router_url,
        router_policy=f.rollout_router_policy,
        sglang_url=f.sglang_url,
        max_inflight=f.rollout_max_inflight,
        timeout_s=f.rollout_timeout_s,
        max_restarts=f.rollout_max_restarts,
        backoff_s=f.rollout_backoff_s,
        weight_sync=f.rollout_weight_sync,
        weight_group_host=f.rollout_weight_group_host,
        tp_size=f.sglang_tp_size,
        mem_fraction_static=f.sglang_mem_fraction_static,
        true_on_policy=f.true_on_policy,
        server_fault=f.debug_rollout_server_fault,
        custom_generate_fn=f.custom_generate_fn,
        custom_reward_fn=f.custom_reward_fn,
        reward_errors=f.reward_errors,
        reward_timeout_s=f.reward_timeout_s,
        prompt_data=f.prompt_data,
        eval_data=f.eval_data,
        input_key=f.input_key,
        label_key=f.label_key,
        save_rollouts=f.save_rollouts,
        load_rollouts=f.load_rollouts,
        eval_pass_k=f.eval_pass_k,
        over_sampling=f.over_sampling,
    )


def flag_values_dict() -> dict[str, object]:
    """The run's flags that this module defines, for checkpoint metadata and snapshots."""
    names = [n for n, fl in FLAGS.__flags.items() if n == fl.name and FLAGS.find_module_defining_flag(n) == __name__]
    return {n: FLAGS[n].value for n in sorted(names)}


def _register_finite_validators() -> None:
    """NaN passes every lower/upper bound (all comparisons are false), so each float flag is checked apart."""
    for name, fl in FLAGS.__flags.items():
        if name == fl.name and fl.flag_type() == "float" and FLAGS.find_module_defining_flag(name) == __name__:
            flags.register_validator(name, lambda v: v is None or math.isfinite(v),
                                     f"--{name} must be a finite number (not nan or inf)")


_register_finite_validators()


def ops_config_from_flags() -> ops.OpsConfig:
    f = FLAGS
    return ops.OpsConfig(mode="invariant" if f.true_on_policy else "reference", attention_backend=f.attention_backend,
                         gemm_backend=f.gemm_backend, compile=f.compile, tile_rows=f.invariant_tile_rows,
                         kv_block=f.invariant_kv_block, decode_backend=f.decode_backend)


def offpolicy_config_from_flags() -> OffPolicyConfig:
    f = FLAGS
    return OffPolicyConfig(correction=f.offpolicy_correction, tis_cap=f.tis_cap, mis_low=f.mis_low,
                           mis_high=f.mis_high)


# What `python -m launch.main --helpshort` lists: the flags a first run needs, by topic, in the order and under the
# names of the "# ==" sections above (tests/test_flags_help.py keeps the two alike); --helpfull lists every flag.
SHORT_HELP: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Run", ("seed", "num_steps", "output_dir", "resume", "save_every", "num_threads")),
    ("Model", ("hf_checkpoint", "model_type", "hidden_size", "num_layers", "num_heads", "num_kv_heads")),
    ("Task and data", ("prompt_data", "eval_data", "tokenizer", "custom_reward_fn", "eval_every", "eval_size")),
    ("Rollout", ("prompts_per_step", "group_size", "temperature", "max_new_tokens", "rollout_backend")),
    ("Algorithm", ("advantage_estimator", "policy_loss", "kl_coef", "eps_clip")),
    ("Optimisation", ("lr", "decay_steps", "min_lr", "max_grad_norm")),
    ("LoRA", ("lora_rank", "lora_alpha", "lora_targets")),
    ("Supervised", ("sft_warmup_steps", "sft", "sft_data")),
    ("Packing and memory", ("max_tokens_per_micro_batch", "recompute")),
    ("True on-policy and kernels", ("true_on_policy",)),
    ("Loop modes", ("debug_rollout_only", "debug_train_only")),
    ("Debugging and replay", ("snapshot_steps", "profile_steps")),
    ("Speculative decoding", ("speculative_algorithm", "speculative_num_steps", "draft_checkpoint",
                              "speculative_disable_by_batch_size")),
    ("MoE and rollout routing replay", ("num_experts", "num_experts_per_tok", "routing_replay")),
)


def short_help() -> str:
    """The --helpshort text: a first run's flags grouped by topic, each with its help and default."""
    out = ["python -m launch.main --flagfile=FILE [--flag=value ...]  (launch/flags/*.flags are examples; flags",
           "given after --flagfile override it). The flags a first run needs; --helpfull lists all of them.", ""]
    for topic, names in SHORT_HELP:
        out.append(f"{topic}:")
        for name in names:
            fl = FLAGS[name]
            out.extend(textwrap.wrap(f"--{name}: {fl.help} (default: {fl.default_as_str})", 100,
                                     initial_indent="  ", subsequent_indent="      "))
        out.append("")
    return "\n".join(out)
