"""Engine selection: `--rollout_backend=embedded|http|sglang` -> an object with the Engine interface."""

from __future__ import annotations

import os
import sys
from typing import Any

from absl import logging

import ops
from launch.engines.base import Engine, EngineError, SpecDraft
from launch.engines.config import RolloutConfig
from launch.engines.embedded import EmbeddedEngine
from miles_fn.config import ModelConfig

__all__ = ["Engine", "EngineError", "RolloutConfig", "make_engine"]


def make_engine(rcfg: RolloutConfig, mcfg: ModelConfig, params: Any, output_dir: str, num_threads: int = 1,
                version: int = 0, ops_cfg: ops.OpsConfig = ops.REFERENCE, vocab_limit: int = 0,
                draft: SpecDraft | None = None) -> Engine:
    """The rollout engine --rollout_backend names; vocab_limit (the tokenizer's length, when the checkpoint pads
    its vocabulary) goes to a server this run starts, so the padded rows are never sampled. `draft` (http only:
    the embedded engine gets its draft from launch.speculative) starts the servers speculating with it."""
    if rcfg.backend == "embedded":
        return EmbeddedEngine(mcfg, params, version, rcfg.batch_size, ops_cfg, rcfg.prefix_cache_mb)
    if rcfg.backend == "http":
        return _http_engine(rcfg, mcfg, params, output_dir, num_threads, version, ops_cfg, vocab_limit, draft)
    if rcfg.backend == "sglang":
        from launch.engines.sglang_backend import make_sglang_engine

        if ops_cfg.invariant:
            # SGLang's deterministic inference is batch-invariant, but with its kernels, not ops.INVARIANT:
            # its tokens do not depend on the batch, yet its log-probs differ from the trainer's in the last bits.
            logging.warning("--true_on_policy with --rollout_backend=sglang: SGLang runs its own deterministic "
                            "kernels, so mismatch_* will be small but not exactly 0 (exactly 0 needs "
                            "--rollout_backend=embedded or http)")
        return make_sglang_engine(rcfg, mcfg, params, output_dir, version)
    raise ValueError(f"--rollout_backend={rcfg.backend}: expected embedded, http or sglang")


FAULTS = ("crash_once:N, crash_always:N, crash_permanent:N, crash_in_sync:N, group_unreachable, "
          "fleet_down:N or router_crash:N")


def valid_fault(fault: str) -> bool:
    mode, _, n = fault.partition(":")
    if mode == "group_unreachable":
        return not n
    return mode in ("crash_once", "crash_always", "crash_permanent", "crash_in_sync", "fleet_down",
                    "router_crash") and n.isdigit()


def _fault_args(fault: str, first: bool) -> list[str]:
    """Fault injection for tests: the server crashes on its Nth /generate call; after that a
    restarted server works (crash_once), crashes again (crash_always) or cannot start (crash_permanent).
    crash_in_sync:N: the first server dies inside its Nth distributed weight update (mid-broadcast);
    group_unreachable: every server fails to reach the weight-update group. In a fleet (launch/engines/fleet.py)
    these apply to server 0 only, but fleet_down:N (every server crashes on its Nth call and cannot restart) and
    router_crash:N (the run kills its router inside its Nth generate call)."""
    if not fault:
        return []
    if not valid_fault(fault):
        raise ValueError(f"--debug_rollout_server_fault={fault}: expected {FAULTS}")
    mode, _, n = fault.partition(":")
    if mode == "router_crash":
        return []
    if mode == "fleet_down":  # in a fleet, every server (one server: as crash_permanent)
        return ["--debug-exit-after", n] if first else ["--debug-fail-start"]
    if mode == "group_unreachable":
        return ["--debug-group-fault", "unreachable"]
    if mode == "crash_in_sync":
        return ["--debug-group-fault", f"crash_in_update:{n}"] if first else []
    if first or mode == "crash_always":
        return ["--debug-exit-after", n]
    return ["--debug-fail-start"] if mode == "crash_permanent" else []


def server_ops_args(ops_cfg: ops.OpsConfig) -> list[str]:
    """launch.rollout_server flags that make it run the trainer's kernels."""
    if not ops_cfg.invariant:
        return ["--decode-backend", ops_cfg.decode_backend]
    return ["--enable-deterministic-inference", "--invariant-tile-rows", str(ops_cfg.tile_rows),
            "--invariant-kv-block", str(ops_cfg.kv_block)]


def check_server_ops(info: dict[str, Any], ops_cfg: ops.OpsConfig, url: str) -> None:
    """Refuse a server whose kernels are not the trainer's invariant ones when the run is true on-policy."""
    if not ops_cfg.invariant:
        return
    from launch.engines.sglang_api import ops_info

    want = ops_info(ops_cfg)
    if any(info.get(k) != v for k, v in want.items()):
        raise EngineError(
            f"--rollout_url={url}: --true_on_policy needs the server to run the trainer's batch-invariant kernels "
            f"({want['invariant_ops']}), but it reports deterministic_inference={info.get('deterministic_inference')}, "
            f"invariant_ops={info.get('invariant_ops')}; start it with python -m launch.rollout_server "
            f"{' '.join(server_ops_args(ops_cfg))}")


def check_server_draft(info: dict[str, Any], draft: SpecDraft | None, url: str) -> None:
    """Refuse a server that does not speculate as the run does (k and the plain-step threshold) when the run has
    a draft: its tokens would still be plain decoding's, but not its speed or its spec_* metrics."""
    if draft is None:
        return
    if info.get("speculative_algorithm") != "STANDALONE" or info.get("speculative_num_steps") != draft.num_steps:
        raise EngineError(
            f"--rollout_url={url}: --speculative_algorithm=STANDALONE --speculative_num_steps={draft.num_steps} needs "
            f"a server that speculates with k = {draft.num_steps}, but it reports speculative_algorithm="
            f"{info.get('speculative_algorithm')}, speculative_num_steps={info.get('speculative_num_steps')}; start it "
            f"with python -m launch.rollout_server --speculative-algorithm STANDALONE --speculative-draft-model-path "
            f"DIR --speculative-num-steps {draft.num_steps} (the run sends its draft's weights)")
    served = info.get("speculative_disable_by_batch_size", 0)
    if served != draft.disable_by_batch_size:
        raise EngineError(
            f"--rollout_url={url}: the run has --speculative_disable_by_batch_size={draft.disable_by_batch_size}, but "
            f"the server decodes plainly past {served} live rows (0: never); restart it with "
            f"--speculative-disable-by-batch-size {draft.disable_by_batch_size}, or run with "
            f"--speculative_disable_by_batch_size={served}")


def draft_args(draft: SpecDraft | None, root: str) -> list[str]:
    """launch.rollout_server flags that make it speculate with the run's draft (saved under root)."""
    if draft is None:
        return []
    from state import hf

    path = os.path.abspath(os.path.join(root, "draft_init"))
    hf.save_hf(path, draft.cfg, draft.params)
    return ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", path,
            "--speculative-num-steps", str(draft.num_steps),
            "--speculative-disable-by-batch-size", str(draft.disable_by_batch_size)]


def _http_engine(rcfg: RolloutConfig, mcfg: ModelConfig, params: Any, output_dir: str, num_threads: int,
                 version: int, ops_cfg: ops.OpsConfig = ops.REFERENCE, vocab_limit: int = 0,
                 draft: SpecDraft | None = None) -> Engine:
    from launch.engines.remote import RecoveryPolicy, RemoteEngine, ServerProcess, disk_sync, tensor_sync
    from launch.engines.weight_group import DistributedSync
    from state import hf

    wdir = os.path.join(output_dir, "rollout_weights")
    if rcfg.weight_sync == "distributed":
        sync: Any = DistributedSync(mcfg, host=rcfg.weight_group_host, timeout_s=rcfg.timeout_s)
    else:
        sync = disk_sync(mcfg, wdir) if rcfg.weight_sync == "disk" else tensor_sync(mcfg)
    recovery = RecoveryPolicy(rcfg.max_restarts, rcfg.backoff_s, rcfg.start_timeout_s)
    spec = dict(draft_cfg=draft.cfg if draft else None, num_steps=draft.num_steps if draft else 0)
    common = dict(sync=sync, batch_size=rcfg.batch_size, timeout_s=rcfg.timeout_s, max_inflight=rcfg.max_inflight,
                  recovery=recovery, **spec)
    if rcfg.url:
        engine = RemoteEngine(mcfg, params, version, url=rcfg.url, **common)
        try:
            info = engine.client.model_info()
            check_server_ops(info, ops_cfg, rcfg.url)
            check_server_draft(info, draft, rcfg.url)
        except EngineError:
            engine.close()
            raise
        return engine
    if rcfg.router_url:
        from launch.engines.fleet import adopt_fleet

        if ops_cfg.invariant:
            raise EngineError(f"--rollout_router_url={rcfg.router_url} with --true_on_policy: the run cannot check "
                              "the kernels of servers behind a router; start them with this run "
                              "(--rollout_num_engines)")
        return adopt_fleet(mcfg, params, version, router_url=rcfg.router_url, sync_for=lambda: sync,
                           timeout_s=rcfg.timeout_s, max_inflight=rcfg.max_inflight, recovery=recovery, **spec)
    _fault_args(rcfg.server_fault, True)  # validate before starting anything
    init = os.path.abspath(os.path.join(wdir, "init"))
    hf.save_hf(init, mcfg, params)
    speculate = draft_args(draft, wdir)

    def server_command(index: int, port: int, first: bool) -> list[str]:
        fault = rcfg.server_fault if index == 0 or rcfg.server_fault.startswith("fleet_down") else ""
        return [sys.executable, "-m", "launch.rollout_server", "--model-path", init, "--host", "127.0.0.1",
                "--port", str(port), "--weight-version", str(version), "--num-threads", str(num_threads),
                "--weight-group-timeout-s", str(rcfg.timeout_s), "--watch-parent", *server_ops_args(ops_cfg),
                "--vocab-limit", str(vocab_limit), "--prefix-cache-mb", str(rcfg.prefix_cache_mb), *speculate,
                *_fault_args(fault, first)]

    def command(port: int, first: bool) -> list[str]:
        return server_command(0, port, first)

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if rcfg.num_engines > 1:
        from launch.engines.fleet import start_fleet

        mode, _, n = rcfg.server_fault.partition(":")
        return start_fleet(mcfg, params, version, n=rcfg.num_engines, server_command=server_command,
                           sync_for=lambda: sync, output_dir=output_dir, policy=rcfg.router_policy,
                           timeout_s=rcfg.timeout_s, max_inflight=rcfg.max_inflight, recovery=recovery, cwd=root,
                           router_fault=int(n) if mode == "router_crash" else 0, **spec)
    proc = ServerProcess(command, os.path.join(output_dir, "rollout_server.log"), rcfg.start_timeout_s, cwd=root)
    return RemoteEngine(mcfg, params, version, process=proc, **common)
