"""A rollout engine behind HTTP (launch.rollout_server or SGLang), with versions and recovery.

A batch is cut into the same chunks the embedded engine runs; each chunk is one /generate call,
several in flight. If the server stops answering, the engine recovers it (restarts it when this
run started it, else waits for it), gives it the current weights again and re-issues exactly
the chunks that had no reply, so the run resumes in place. Recovery is bounded (back-off
doubling from backoff_s); past it, EngineError says which server, how often, and the last error.
A connection dropped by a server that is still alive (its process runs, /health answers and it
holds the current weights) is no failure of the server: those chunks are re-issued without a
restart and without counting against max_restarts (bounded too, by max_reissues).
generate returns every sample, each checked to come from the current weight version, or raises:
the loop never sees a partial batch.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from launch.engines.base import EngineError, Request, Sample, SpecDraft, SpecMeter, chunked
from launch.engines.sglang_client import ConnectionDropped, ServerDown, SGLangClient
from miles_fn.config import ModelConfig
from miles_fn.sampling import SamplingConfig
from state import hf


@dataclasses.dataclass(frozen=True)
class RecoveryPolicy:
    max_restarts: int = 3  # recoveries per generate call before giving up
    backoff_s: float = 0.5  # first wait; doubles per attempt, capped at 30 s
    start_timeout_s: float = 120.0  # how long a started server may take to answer /health
    max_reissues: int = 8  # rounds of dropped connections from an alive server re-issued per call


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server this run started: `command(port, first)` builds its argv; output goes to log_path."""

    def __init__(self, command: Callable[[int, bool], list[str]], log_path: str, start_timeout_s: float,
                 host: str = "127.0.0.1", cwd: str | None = None):
        self.command, self.log_path, self.start_timeout_s, self.host = command, log_path, start_timeout_s, host
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        atexit.register(self.stop)

    def start(self) -> str:
        """Start (or restart) the server and wait until it answers /health; its URL, or ServerDown."""
        self.stop()
        port = free_port(self.host)
        argv = self.command(port, self.starts == 0)
        self.starts += 1
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {self.starts}: {' '.join(argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=self.cwd)
        url = f"http://{self.host}:{port}"
        probe = SGLangClient(url, timeout_s=2.0, max_inflight=1)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while time.monotonic() < deadline:
                code = self.proc.poll()
                if code is not None:
                    raise ServerDown(f"the server exited with code {code} while starting (log: {self.log_path})")
                if probe.health(timeout_s=2.0):
                    return url
                time.sleep(0.1)
        finally:
            probe.close()
        self.stop()
        raise ServerDown(f"the server did not answer /health within {self.start_timeout_s:.0f} s "
                         f"(log: {self.log_path})")

    def alive(self) -> bool:
        """Whether the started process still runs (it may be alive yet drop a connection)."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None


def check_samples(samples: Sequence[Sample], version: int, vocab_limit: int, who: str) -> None:
    """Refuse samples the trainer must not see: from other weights than `version`, or with an id the tokenizer
    does not have (a padded vocabulary's row: decoding it would fail later). `who` names the source.

    launch.rollout_server started by this run never samples such an id (--vocab-limit); SGLang samples every row."""
    stale = [s.weight_version for s in samples if s.weight_version != version]
    if stale:
        raise EngineError(f"{who} produced samples with weight version {stale[0]}, expected {version}: "
                          "its weights are not the trainer's")
    bad = next((t for s in samples for t in s.tokens if not 0 <= t < vocab_limit), None) if vocab_limit else None
    if bad is not None:
        raise EngineError(f"{who} sampled token id {bad}, outside the tokenizer's {vocab_limit} ids "
                          "(the checkpoint's vocabulary is padded past its tokenizer); start launch.rollout_server "
                          f"with --vocab-limit {vocab_limit} so those rows are never sampled")


def check_spec(samples: Sequence[Sample], draft: SpecDraft, who: str) -> None:
    """Refuse samples that a speculating server produced without the current draft (or did not speculate at all):
    they are still plain decoding's, but its acceptance would be the stale draft's (Miles #1926 hid such a bug)."""
    for s in samples:
        if s.spec is None:
            raise EngineError(f"{who} returned a sample without speculation counts (meta_info.spec_accept_histogram): "
                              "start it with --speculative-algorithm STANDALONE --speculative-draft-model-path DIR")
        if s.spec.draft_version != draft.version or len(s.spec.histogram) != draft.num_steps + 1:
            raise EngineError(f"{who} speculated with draft version {s.spec.draft_version} and k = "
                              f"{len(s.spec.histogram) - 1}, expected version {draft.version} and k = "
                              f"{draft.num_steps} (--speculative_num_steps): its draft is not the trainer's")


def push_draft(client: SGLangClient, draft: SpecDraft | None) -> None:
    """Send a draft's weights to a speculating server (draft_only: the target's weights stay)."""
    if draft is not None:
        client.update_weights_from_tensor(hf.named_tensors(draft.cfg, draft.params), draft.version, draft_only=True)


class RemoteEngine:
    """The engine interface over an SGLang-compatible server.

    `sync(client, version, params)` pushes weights to the server (by tensor, disk or a process group);
    a sync with state (weight_group.DistributedSync) has `reset(client)`, called on recovery and close.
    With `process`, this engine owns the server: it starts it now and restarts it on failure.
    With `draft_cfg` the server speculates: update_draft sends it the draft's weights (again after a recovery),
    and take_stats returns the acceptance its replies report.
    """

    def __init__(self, cfg: ModelConfig, params: Any, version: int, *, url: str = "",
                 process: ServerProcess | None = None, sync: Callable[[SGLangClient, int, Any], None],
                 batch_size: int = 0, timeout_s: float = 60.0, max_inflight: int = 8,
                 recovery: RecoveryPolicy = RecoveryPolicy(), seed_mask: int | None = None,
                 draft_cfg: ModelConfig | None = None, num_steps: int = 0):
        if not url and process is None:
            raise ValueError("RemoteEngine needs a server URL or a server process to start")
        self.cfg, self.params, self._version = cfg, params, version
        self.process, self.sync, self.batch_size = process, sync, batch_size
        self.timeout_s, self.max_inflight, self.recovery, self.seed_mask = timeout_s, max_inflight, recovery, seed_mask
        self.recoveries = 0
        self.reissues = 0  # rounds of dropped connections re-issued to a server that was alive
        self.draft_cfg, self.num_steps = draft_cfg, num_steps
        self.draft: SpecDraft | None = None
        self.meter = SpecMeter()
        self.client = self._client(url) if url else self._start_owned()
        if url:
            try:
                self.sync(self.client, version, params)
            except ServerDown as e:
                raise EngineError(f"rollout server {url} does not answer: {e}") from None

    @property
    def version(self) -> int:
        return self._version

    def _client(self, url: str) -> SGLangClient:
        return SGLangClient(url, self.timeout_s, self.max_inflight, self.seed_mask, routes_cfg=self.cfg)

    def _start_owned(self) -> SGLangClient:
        assert self.process is not None
        try:
            return self._client(self.process.start())
        except ServerDown as e:
            raise EngineError(f"the rollout server did not start: {e}") from None

    # --- generation --------------------------------------------------------------------------
    def generate(self, requests: Sequence[Request], sampling: SamplingConfig) -> list[Sample]:
        t0 = time.perf_counter()
        chunks = chunked(requests, self.batch_size)
        results: list[list[Sample] | None] = [None] * len(chunks)
        recoveries = reissues = 0
        while True:
            todo = [i for i, r in enumerate(results) if r is None]
            if not todo:
                break
            outs = self.client.generate_chunks([chunks[i] for i in todo], sampling)
            down: ServerDown | None = None
            dropped_only = True
            for i, out in zip(todo, outs, strict=True):
                if isinstance(out, ServerDown):
                    down = out
                    dropped_only = dropped_only and isinstance(out, ConnectionDropped)
                elif isinstance(out, EngineError):
                    raise out
                elif isinstance(out, BaseException):
                    raise EngineError(f"rollout request to {self.client.url} failed: {type(out).__name__}: {out}")
                else:
                    results[i] = out
            if down is not None and dropped_only and reissues < self.recovery.max_reissues \
                    and self._still_serving(check_version=True):
                reissues += 1
                self.reissues += 1
                n = sum(r is None for r in results)
                print(f"rollout: {n} call(s) to {self.client.url} lost their connection ({down}) while the server "
                      "is alive; re-issuing them (no restart)", file=sys.stderr, flush=True)
                time.sleep(min(self.recovery.backoff_s * 2 ** (reissues - 1), 5.0))
                continue
            if down is not None:
                recoveries += 1
                if recoveries > self.recovery.max_restarts:
                    raise EngineError(f"rollout server {self.client.url} failed the same batch "
                                      f"{recoveries} times; giving up (last error: {down}){self._log_hint()}")
                self._recover(down)
        samples = [s for chunk in results for s in chunk]  # type: ignore[union-attr]
        check_samples(samples, self._version, sampling.vocab_limit, f"rollout server {self.client.url}")
        if self.draft is not None:
            check_spec(samples, self.draft, f"rollout server {self.client.url}")
            self.meter.record(samples, time.perf_counter() - t0)
        return samples

    def _recover(self, cause: ServerDown) -> None:
        """Bring the server back with the current weights, or raise EngineError after bounded tries."""
        last: Exception = cause
        for attempt in range(self.recovery.max_restarts):
            time.sleep(min(self.recovery.backoff_s * 2**attempt, 30.0))
            try:
                if self.process is not None:
                    old = self.client
                    self.client = self._client(self.process.start())
                    old.close()
                elif not self.client.health():
                    raise ServerDown(f"{self.client.url} does not answer /health")
                self._reset_sync()  # a stateful sync (a weight-update group) starts afresh with this server
                self.sync(self.client, self._version, self.params)
                push_draft(self.client, self.draft)
                self.recoveries += 1
                print(f"rollout: server down ({cause}); recovered at {self.client.url} with weight version "
                      f"{self._version}, re-issuing its unanswered requests", file=sys.stderr, flush=True)
                return
            except ServerDown as e:
                last = e
        raise EngineError(f"rollout server {self.client.url} did not come back after {self.recovery.max_restarts} "
                          f"attempts with back-off (first error: {cause}; last: {last}){self._log_hint()}")

    def _still_serving(self, check_version: bool) -> bool:
        """Whether the server that dropped a connection is alive: its process (if ours) runs, /health answers,
        and (check_version) it holds the current weights, so re-issuing to it needs no restart or sync."""
        if self.process is not None and not self.process.alive():
            return False
        if not self.client.health():
            return False
        if not check_version:
            return True
        try:
            return self.client.weight_version() == self._version
        except (ServerDown, EngineError, KeyError, TypeError, ValueError):  # no version to read: recover
            return False

    def _reset_sync(self) -> None:
        reset = getattr(self.sync, "reset", None)
        if reset is not None:
            reset(self.client)

    def _log_hint(self) -> str:
        return f"; server log: {self.process.log_path}" if self.process is not None else ""

    # --- weights and control -----------------------------------------------------------------
    def update_weights(self, version: int, params: Any) -> None:
        self.params, self._version = params, version
        self._deliver(lambda: self.sync(self.client, version, params))

    def update_draft(self, version: int, params: Any) -> None:
        """The speculative draft's new weights (kept, so a recovered server gets them too)."""
        if self.draft_cfg is None:
            raise EngineError(f"rollout server {self.client.url}: this engine was started without a draft")
        self.draft = SpecDraft(self.draft_cfg, params, version, self.num_steps)
        self._deliver(lambda: push_draft(self.client, self.draft))

    def take_stats(self) -> dict[str, float]:
        return self.meter.take()

    def _deliver(self, send: Callable[[], None]) -> None:
        """Run an idempotent weight update, again while the server lives, else recover it (which resends all)."""
        for attempt in range(self.recovery.max_reissues + 1):
            try:
                send()
                return
            except ConnectionDropped as e:  # the update is idempotent: send it again while the server lives
                if attempt == self.recovery.max_reissues or not self._still_serving(check_version=False):
                    self._recover(e)
                    return
                self.reissues += 1
                self._reset_sync()
                time.sleep(min(self.recovery.backoff_s * 2**attempt, 5.0))
            except ServerDown as e:
                self._recover(e)  # a restarted server is given these weights
                return

    def health(self) -> bool:
        return self.client.health()

    def pause(self) -> None:
        self.client.pause_generation()

    def resume(self) -> None:
        self.client.continue_generation()

    def flush_cache(self) -> None:
        self.client.flush_cache()

    def close(self) -> None:
        self._reset_sync()
        self.client.close()
        if self.process is not None:
            self.process.stop()


def tensor_sync(cfg: ModelConfig) -> Callable[[SGLangClient, int, Any], None]:
    def sync(client: SGLangClient, version: int, params: Any) -> None:
        client.update_weights_from_tensor(hf.named_tensors(cfg, params), version)

    return sync


def disk_sync(cfg: ModelConfig, root: str) -> Callable[[SGLangClient, int, Any], None]:
    """Write the weights as a Hugging Face checkpoint under root/v<version>, then point the server at it."""

    def sync(client: SGLangClient, version: int, params: Any) -> None:
        name = f"v{version:08d}"
        path = os.path.abspath(os.path.join(root, name))
        if not os.path.isfile(os.path.join(path, "config.json")):
            hf.save_hf(path, cfg, params)
        client.update_weights_from_disk(path, version)
        for old in os.listdir(root):  # the server holds these weights now: older versions can go
            if old.startswith("v") and old != name:
                shutil.rmtree(os.path.join(root, old), ignore_errors=True)

    return sync
