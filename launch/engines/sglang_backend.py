"""The SGLang backend: start `python -m sglang.launch_server` (or connect to --sglang_url) and drive it
through its native API with the same client and recovery as the HTTP backend.

Weights reach SGLang through /update_weights_from_disk (a Hugging Face checkpoint per version), or
with --rollout_weight_sync=distributed through /init_weights_update_group and
/update_weights_from_distributed: the trainer hosts a group of 1 + --sglang_tp_size ranks and
broadcasts each update into it (NCCL when the weights are on CUDA; weight_group.py). Its
/update_weights_from_tensor payload is pickle-based, which this project never produces or reads.
sglang is imported only through third_party, and only to check that it is installed.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import third_party
from launch.engines.base import EngineError
from launch.engines.config import RolloutConfig
from launch.engines.remote import RecoveryPolicy, RemoteEngine, ServerProcess, disk_sync
from launch.engines.sglang_api import SEED_MASK_63
from launch.engines.weight_group import DistributedSync
from miles_fn.config import ModelConfig
from state import hf


def launch_command(model_path: str, port: int, rcfg: RolloutConfig, version: int, host: str = "127.0.0.1",
                   moe: bool = False) -> list[str]:
    """argv of an SGLang server for this run (ids in and out, so no tokenizer is needed); a MoE model's
    server returns the experts it ran (R3: the client asks with return_routed_experts)."""
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host,
            "--port", str(port), "--tp-size", str(rcfg.tp_size), "--mem-fraction-static",
            str(rcfg.mem_fraction_static), "--skip-tokenizer-init", "--weight-version", str(version)]
    if rcfg.true_on_policy:
        argv.append("--enable-deterministic-inference")
    if moe:
        argv.append("--enable-return-routed-experts")
    return argv


def make_sglang_engine(rcfg: RolloutConfig, mcfg: ModelConfig, params: Any, output_dir: str, version: int
                       ) -> RemoteEngine:
    wdir = os.path.join(output_dir, "rollout_weights")
    if rcfg.weight_sync == "distributed":
        sync: Any = DistributedSync(mcfg, host=rcfg.weight_group_host, timeout_s=rcfg.timeout_s,
                                    server_ranks=rcfg.tp_size)
    else:  # tensor (the default) means disk here: SGLang's tensor payload is pickle
        sync = disk_sync(mcfg, wdir)
    common = dict(sync=sync, batch_size=rcfg.batch_size, timeout_s=rcfg.timeout_s,
                  max_inflight=rcfg.max_inflight,
                  recovery=RecoveryPolicy(rcfg.max_restarts, rcfg.backoff_s, rcfg.start_timeout_s),
                  seed_mask=SEED_MASK_63)
    if rcfg.sglang_url:
        return RemoteEngine(mcfg, params, version, url=rcfg.sglang_url, **common)
    try:
        third_party.require("sglang", "--rollout_backend=sglang without --sglang_url")
    except third_party.MissingPackageError as e:
        raise EngineError(str(e)) from None
    init = os.path.abspath(os.path.join(wdir, "init"))
    hf.save_hf(init, mcfg, params)
    proc = ServerProcess(lambda port, first: launch_command(init, port, rcfg, version,
                                                             moe=bool(mcfg.num_experts)),
                         os.path.join(output_dir, "sglang_server.log"), rcfg.start_timeout_s)
    return RemoteEngine(mcfg, params, version, process=proc, **common)
