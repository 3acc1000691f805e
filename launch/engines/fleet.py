"""A fleet of rollout servers behind the real sglang-router: generation through the router, weights to each server.

    --rollout_backend=http --rollout_num_engines=N --rollout_batch_size=1 [--rollout_router_policy=round_robin]

The run starts N launch.rollout_server processes and `python -m sglang_router.launch_router` in front of
them (or adopts the servers an existing router lists, --rollout_router_url). Every /generate call goes
through the router; every weight update goes to each server directly (the router has no weight API), and
each sample is checked to come from the current version.

One request per /generate call: the router parses a /generate body into its own schema, which has one
sampling_params object (a list is refused with 422) and drops unknown fields, so a batched call through it
can carry only one sampling_seed. With one request a call, each request keeps its own seed and each server
runs it as a batch of one, whichever server it is: a fleet gives the bits of --rollout_batch_size=1 on one
engine (embedded or http), for any N and any routing policy.

Failover: the router retries a call that a dead server dropped on another server. Before each generate
and weight update, and after a call fails through the router, the fleet checks its servers: a dead one
is removed from the router and, when this run started it, restarted, given the current weights and
added back; the calls that got no reply are re-issued. With no server left, EngineError names them all.
A router this run started that dies is restarted over the live servers.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import json
import os
import sys
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from launch.engines import sglang_api
from launch.engines.base import EngineError, Request, Sample, SpecDraft, SpecMeter, chunked
from launch.engines.remote import RecoveryPolicy, ServerProcess, check_samples, check_spec, free_port, push_draft
from launch.engines.sglang_client import ServerDown, SGLangClient
from miles_fn.config import ModelConfig
from miles_fn.sampling import SamplingConfig

POLICIES = ("round_robin", "cache_aware", "power_of_two", "random")

Sync = Callable[[SGLangClient, int, Any], None]


def router_command(port: int, worker_urls: Sequence[str], policy: str) -> list[str]:
    """argv of the real sglang-router over worker_urls (its metrics port is a free one, not the fixed 29000)."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy, "--prometheus-port", str(free_port()),
            "--log-level", "warn"]


def served_by(reply: Any) -> list[str]:
    """Which server answered each output of a /generate reply ("" where it does not say: real SGLang)."""
    items = reply if isinstance(reply, list) else [reply]
    return [str((it.get("meta_info") or {}).get("served_by", "")) if isinstance(it, dict) else "" for it in items]


class Router:
    """The router's admin API (sglang-router 0.3: GET /workers, POST /workers {"url"}, DELETE /workers/{id})."""

    def __init__(self, url: str, timeout_s: float, process: ServerProcess | None = None):
        self.process = process
        self.timeout_s = timeout_s
        self.client = SGLangClient(url, timeout_s, max_inflight=1)

    @property
    def url(self) -> str:
        return self.client.url

    def workers(self) -> list[dict[str, Any]]:
        reply = self.client.call("GET", "/workers", timeout_s=5.0)
        return list(reply.get("workers", [])) if isinstance(reply, dict) else []

    def worker_urls(self) -> list[str]:
        return [str(w["url"]).rstrip("/") for w in self.workers()]

    def add(self, url: str) -> None:
        self.client.call("POST", "/workers", {"url": url}, timeout_s=5.0)

    def remove(self, url: str) -> None:
        for w in self.workers():
            if str(w.get("url", "")).rstrip("/") == url:
                self.client.call("DELETE", "/workers/" + urllib.parse.quote(str(w["id"]), safe=""), timeout_s=5.0)

    def wait_for(self, urls: Sequence[str], timeout_s: float) -> None:
        """Until the router lists every url as healthy (registration is asynchronous), or ServerDown."""
        want, deadline = set(urls), time.monotonic() + timeout_s
        while True:
            try:
                healthy = {str(w["url"]).rstrip("/") for w in self.workers() if w.get("is_healthy", True)}
            except (ServerDown, EngineError, KeyError, TypeError):
                healthy = set()
            if want <= healthy:
                return
            if time.monotonic() > deadline:
                raise ServerDown(f"the router {self.url} did not list {sorted(want - healthy)} as healthy workers "
                                 f"within {timeout_s:.0f} s")
            time.sleep(0.1)

    def alive(self) -> bool:
        if self.process is not None and not self.process.alive():
            return False
        return self.client.health(timeout_s=2.0)


@dataclasses.dataclass
class Member:
    """One server of the fleet: its direct client (weights, health), and its process when this run started it."""

    index: int
    client: SGLangClient
    sync: Sync
    process: ServerProcess | None = None

    @property
    def url(self) -> str:
        return self.client.url

    def alive(self) -> bool:
        if self.process is not None and not self.process.alive():
            return False
        return self.client.health(timeout_s=2.0)


class FleetEngine:
    """The engine interface over N rollout servers behind one sglang-router.

    `members` are the servers (owned ones carry their ServerProcess); `router` is the router, owned when it
    has a process (restarted over the live servers if it dies). `router_fault=N` (tests): kill the router
    inside the fleet's Nth generate call, just before its requests are sent.
    """

    def __init__(self, cfg: ModelConfig, params: Any, version: int, *, members: list[Member], router: Router,
                 timeout_s: float = 60.0,
                 max_inflight: int = 8, recovery: RecoveryPolicy | None = None, router_fault: int = 0,
                 record_path: str = "", draft_cfg: ModelConfig | None = None, num_steps: int = 0):
        if not members:
            raise EngineError(f"the rollout fleet behind {router.url} has no servers")
        self.cfg, self.params, self._version = cfg, params, version
        self.members, self.router = members, router
        self.timeout_s, self.max_inflight, self.recovery = timeout_s, max_inflight, recovery or RecoveryPolicy()
        self.router_fault, self.generate_calls = router_fault, 0
        self.client = SGLangClient(router.url, timeout_s, max_inflight, routes_cfg=cfg)  # generation, via the router
        self.removed: list[str] = []  # servers taken out of the fleet for good, with why
        self.restarts = collections.Counter[str]()  # kind ("engine", "router") -> restarts
        self.served = collections.Counter[str]()  # server URL -> samples it served (as its replies say)
        self.record_path = record_path  # JSONL: per generate call, the server of each sample, in request order
        self.draft_cfg, self.num_steps = draft_cfg, num_steps  # speculating servers (RemoteEngine's draft_cfg)
        self.draft: SpecDraft | None = None
        self.meter = SpecMeter()
        atexit.register(self._report)
        for m in members:
            self._sync(m)

    @property
    def version(self) -> int:
        return self._version

    # --- generation --------------------------------------------------------------------------
    def _call(self, chunk: Sequence[Request], sampling: SamplingConfig) -> tuple[list[Sample], list[str]]:
        (req,) = chunk  # one request a call: the router forwards one sampling_params object (module docstring)
        body = sglang_api.generate_body([req], sampling, return_routed_experts=self.client.routes_cfg is not None)
        body["sampling_params"] = body["sampling_params"][0]
        reply = self.client.call("POST", "/generate", body)
        return sglang_api.parse_generate_reply(reply, 1, self.client.url, self.client.routes_cfg), served_by(reply)

    def generate(self, requests: Sequence[Request], sampling: SamplingConfig) -> list[Sample]:
        self.generate_calls += 1
        t0 = time.perf_counter()
        self._heal()
        if self.router_fault == self.generate_calls and self.router.process is not None:
            assert self.router.process.proc is not None
            self.router.process.proc.kill()  # tests: the router dies as the batch is sent
            self.router.process.proc.wait()
        chunks = chunked(requests, 1)
        results: list[tuple[list[Sample], list[str]] | None] = [None] * len(chunks)
        failures = 0
        with ThreadPoolExecutor(max_workers=self.max_inflight, thread_name_prefix="fleet") as pool:
            while True:
                todo = [i for i, r in enumerate(results) if r is None]
                if not todo:
                    break
                futures = {i: pool.submit(self._call, chunks[i], sampling) for i in todo}
                down: BaseException | None = None
                for i, f in futures.items():
                    e = f.exception()
                    if e is None:
                        results[i] = f.result()
                    elif isinstance(e, ServerDown):
                        down = e
                    elif isinstance(e, EngineError):
                        raise e
                    else:
                        raise EngineError(f"rollout request through the router {self.router.url} failed: "
                                          f"{type(e).__name__}: {e}")
                if down is None:
                    continue
                failures += 1
                if failures > self.recovery.max_restarts:
                    raise EngineError(f"rollout calls through the router {self.router.url} failed {failures} times "
                                      f"in one batch; giving up (last error: {down}){self._state()}")
                n = sum(r is None for r in results)
                print(f"rollout fleet: {n} call(s) through {self.router.url} got no reply ({down}); checking the "
                      "servers and re-issuing them", file=sys.stderr, flush=True)
                time.sleep(min(self.recovery.backoff_s * 2 ** (failures - 1), 30.0))
                self._heal()
        samples = [s for r in results for s in r[0]]  # type: ignore[index]
        engines = [u for r in results for u in r[1]]  # type: ignore[index]
        self.served.update(engines)
        if self.record_path:
            with open(self.record_path, "a") as f:
                f.write(json.dumps({"call": self.generate_calls, "weight_version": self._version,
                                    "served_by": engines}) + "\n")
        check_samples(samples, self._version, sampling.vocab_limit, f"the rollout fleet behind {self.router.url}")
        if self.draft is not None:
            check_spec(samples, self.draft, f"the rollout fleet behind {self.router.url}")
            self.meter.record(samples, time.perf_counter() - t0)
        return samples

    # --- failover ------------------------------------------------------------------------------
    def _heal(self) -> None:
        """Restart the router if ours died; take dead servers out (restarting ours with current weights)."""
        if not self.router.alive():
            self._restart_router()
        for m in list(self.members):
            if not m.alive():
                self._replace(m, "it does not answer /health")
        if not self.members:
            raise EngineError(f"every rollout server of the fleet behind {self.router.url} is down and none could "
                              f"be restarted: {'; '.join(self.removed)}")

    def _replace(self, m: Member, why: str) -> None:
        old = m.url
        try:
            self.router.remove(old)
        except (ServerDown, EngineError):
            pass  # the router drops a dead server by itself too (health checks, circuit breaker)
        if m.process is not None:
            last: Exception | None = None
            for attempt in range(self.recovery.max_restarts):
                time.sleep(min(self.recovery.backoff_s * 2**attempt, 30.0))
                try:
                    m.client.close()
                    m.client = SGLangClient(m.process.start(), self.timeout_s, 1)
                    self._sync(m)
                    self.router.add(m.url)
                    self.router.wait_for([m.url], self.recovery.start_timeout_s)
                    self.restarts["engine"] += 1
                    print(f"rollout fleet: server {old} down ({why}); restarted as {m.url} with weight version "
                          f"{self._version} and added to the router", file=sys.stderr, flush=True)
                    return
                except (ServerDown, EngineError) as e:
                    last = e
            why = f"{why}; {self.recovery.max_restarts} restarts failed, last: {last}"
        self.members.remove(m)
        self.removed.append(f"{old} ({why})")
        print(f"rollout fleet: server {old} removed ({why}); {len(self.members)} left", file=sys.stderr, flush=True)

    def _restart_router(self) -> None:
        if self.router.process is None:
            raise EngineError(f"the router --rollout_router_url={self.router.url} does not answer /health; "
                              "restart it (this run did not start it)")
        last: Exception | None = None
        urls = [m.url for m in self.members if m.alive()]
        for attempt in range(self.recovery.max_restarts):
            time.sleep(min(self.recovery.backoff_s * 2**attempt, 30.0))
            try:
                url = self.router.process.start()
                self.router.client.close()
                self.router.client = SGLangClient(url, self.timeout_s, 1)
                self.router.wait_for(urls, self.recovery.start_timeout_s)
                old, self.client = self.client, SGLangClient(url, self.timeout_s, self.max_inflight,
                                                             routes_cfg=self.cfg)
                old.close()
                self.restarts["router"] += 1
                print(f"rollout fleet: the router died; restarted at {url} over {len(urls)} server(s)",
                      file=sys.stderr, flush=True)
                return
            except ServerDown as e:
                last = e
        raise EngineError(f"the router did not come back after {self.recovery.max_restarts} attempts (last: {last}; "
                          f"log: {self.router.process.log_path})")

    def _state(self) -> str:
        gone = f"; removed: {'; '.join(self.removed)}" if self.removed else ""
        return f"; servers: {', '.join(m.url for m in self.members) or 'none'}{gone}"

    # --- weights and control -----------------------------------------------------------------
    def _sync(self, m: Member) -> None:
        """All a (re)started server needs: the current weights and draft."""
        m.sync(m.client, self._version, self.params)
        push_draft(m.client, self.draft)

    def update_draft(self, version: int, params: Any) -> None:
        """Every server gets the speculative draft's weights directly (a restarted one with its target's)."""
        if self.draft_cfg is None:
            raise EngineError(f"the rollout fleet behind {self.router.url} was started without a draft")
        self.draft = SpecDraft(self.draft_cfg, params, version, self.num_steps)
        self._each(lambda m: push_draft(m.client, self.draft))

    def take_stats(self) -> dict[str, float]:
        return self.meter.take()

    def update_weights(self, version: int, params: Any) -> None:
        """Every server gets the weights directly; one that fails is replaced (restarted ones get them too)."""
        self.params, self._version = params, version
        self._each(lambda m: m.sync(m.client, version, params))  # the draft follows by update_draft

    def _each(self, send: Callable[[Member], None]) -> None:
        """A weight update to each server; one that fails is replaced (a restarted one gets every weight)."""
        self._heal()
        for m in list(self.members):
            try:
                send(m)
            except ServerDown as e:
                self._replace(m, f"the weight update failed: {e}")
        if not self.members:
            raise EngineError(f"every rollout server of the fleet behind {self.router.url} is down: "
                              f"{'; '.join(self.removed)}")

    def health(self) -> bool:
        return self.router.alive() and any(m.alive() for m in self.members)

    def pause(self) -> None:
        for m in self.members:
            m.client.pause_generation()

    def resume(self) -> None:
        for m in self.members:
            m.client.continue_generation()

    def flush_cache(self) -> None:
        for m in self.members:
            m.client.flush_cache()

    def _report(self) -> None:
        if self.served:
            print(f"rollout fleet: samples served per server: {json.dumps(dict(sorted(self.served.items())))}; "
                  f"restarts: {dict(self.restarts)}", file=sys.stderr, flush=True)
            self.served.clear()

    def close(self) -> None:
        self._report()
        self.client.close()
        self.router.client.close()
        for m in self.members:
            m.client.close()
            if m.process is not None:
                m.process.stop()
        if self.router.process is not None:
            self.router.process.stop()


def start_fleet(cfg: ModelConfig, params: Any, version: int, *, n: int, server_command: Callable[[int, int, bool],
                list[str]], sync_for: Callable[[], Sync], output_dir: str, policy: str, timeout_s: float,
                max_inflight: int, recovery: RecoveryPolicy, cwd: str, router_fault: int = 0,
                draft_cfg: ModelConfig | None = None, num_steps: int = 0) -> FleetEngine:
    """Start n servers (server_command(index, port, first)) and the router over them; the engine over both."""
    procs = [ServerProcess(lambda port, first, i=i: server_command(i, port, first),
                           os.path.join(output_dir, f"rollout_server_{i}.log"), recovery.start_timeout_s, cwd=cwd)
             for i in range(n)]
    router_proc: ServerProcess | None = None
    try:
        with ThreadPoolExecutor(max_workers=n) as pool:
            urls = list(pool.map(lambda p: p.start(), procs))
        router_proc = ServerProcess(lambda port, first: router_command(port, urls_now(), policy),
                                    os.path.join(output_dir, "rollout_router.log"), recovery.start_timeout_s, cwd=cwd)
        members = [Member(i, SGLangClient(u, timeout_s, 1), sync_for(), p)
                   for i, (u, p) in enumerate(zip(urls, procs, strict=True))]

        def urls_now() -> list[str]:  # a restarted router gets the servers of that moment
            return [m.url for m in members if m.process is None or m.process.alive()]

        router = Router(router_proc.start(), timeout_s, router_proc)
        router.wait_for(urls, recovery.start_timeout_s)
    except ServerDown as e:
        for p in [*procs, *([router_proc] if router_proc else [])]:
            p.stop()
        raise EngineError(f"the rollout fleet did not start: {e}") from None
    return FleetEngine(cfg, params, version, members=members, router=router, timeout_s=timeout_s,
                       max_inflight=max_inflight, recovery=recovery, router_fault=router_fault,
                       record_path=os.path.join(output_dir, "rollout_fleet.jsonl"), draft_cfg=draft_cfg,
                       num_steps=num_steps)


def adopt_fleet(cfg: ModelConfig, params: Any, version: int, *, router_url: str, sync_for: Callable[[], Sync],
                timeout_s: float, max_inflight: int, recovery: RecoveryPolicy,
                draft_cfg: ModelConfig | None = None, num_steps: int = 0) -> FleetEngine:
    """The servers an existing router lists (on any machine): generation through it, weights to each directly."""
    router = Router(router_url, timeout_s)
    try:
        urls = router.worker_urls()
    except ServerDown as e:
        raise EngineError(f"--rollout_router_url={router_url} does not answer: {e}") from None
    if not urls:
        raise EngineError(f"--rollout_router_url={router_url} lists no workers (GET /workers); start "
                          "launch.rollout_server processes and give the router their URLs (--worker-urls)")
    members = [Member(i, SGLangClient(u, timeout_s, 1), sync_for()) for i, u in enumerate(urls)]
    try:
        return FleetEngine(cfg, params, version, members=members, router=router, timeout_s=timeout_s,
                           max_inflight=max_inflight, recovery=recovery, draft_cfg=draft_cfg, num_steps=num_steps)
    except ServerDown as e:
        raise EngineError(f"--rollout_router_url={router_url}: a server it lists does not take weights: {e}") from None
