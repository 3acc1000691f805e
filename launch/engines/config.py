"""Configuration of the rollout engine (built from flags in launch/flags.py)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    backend: str = "embedded"  # embedded | http (launch.rollout_server) | sglang
    batch_size: int = 0  # requests per engine call (0 = the whole step): results depend on it
    prefix_cache_mb: int = 256  # embedded and http engines: prompt turns kept across calls (speed only; 0 = off)
    url: str = ""  # http: an already running rollout server (else this run starts one)
    num_engines: int = 1  # http: servers this run starts, behind a sglang-router it starts (launch/engines/fleet.py)
    router_url: str = ""  # http: an existing sglang-router; its workers are the fleet
    router_policy: str = "round_robin"  # the started router's --policy
    sglang_url: str = ""  # sglang: an already running server or router (else this run starts one)
    max_inflight: int = 8
    timeout_s: float = 120.0
    max_restarts: int = 3
    backoff_s: float = 0.5
    start_timeout_s: float = 120.0
    weight_sync: str = "tensor"  # tensor | disk | distributed (sglang: disk unless distributed)
    weight_group_host: str = "127.0.0.1"  # distributed: where the trainer hosts the group's rendezvous
    tp_size: int = 1
    mem_fraction_static: float = 0.7
    true_on_policy: bool = False  # sglang: --enable-deterministic-inference
    server_fault: str = ""  # tests only: see launch.engines.FAULTS
    # What is rolled out and how it is scored (launch/rollout.py, launch/plugins.py, launch/data.py)
    custom_generate_fn: str = ""  # module:function
    custom_reward_fn: str = ""  # module:function
    reward_errors: str = "raise"  # raise | zero
    reward_timeout_s: float = 300.0  # one reward call's limit (0 = none)
    prompt_data: str = ""  # JSONL path
    eval_data: str = ""  # JSONL path of held-out prompts, evaluated as --prompt_data rollouts are scored
    input_key: str = "input"
    label_key: str = "label"
    save_rollouts: str = ""  # DIR: write each RL step's buffer (launch/rollout_io.py)
    over_sampling: float = 1.0  # draw this many times the prompts, keep groups with differing rewards
    eval_pass_k: int = 0  # k of pass@k at each evaluation (k samples per held-out prompt; 0 = off)
    load_rollouts: str = ""  # DIR: train from saved buffers instead of rolling out
