"""An HTTP client for SGLang's native API (and launch.rollout_server, which speaks the same subset).

asyncio drives many calls at once; each call is a blocking urllib request on a worker thread
(no extra dependency). Transport failures (refused, reset, timed out, HTTP 5xx) raise
ServerDown, which the engine answers by recovering the server; a connection the server accepted
and then dropped (reset, closed before or during the reply) raises its subclass ConnectionDropped,
which the engine re-issues while the server is still alive (a full listen queue drops connections
of a healthy server). A 4xx reply is a bad request and raises EngineError at once, with the
server's message.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from launch.engines import sglang_api
from launch.engines.base import EngineError, Request, Sample
from miles_fn.config import ModelConfig
from miles_fn.sampling import SamplingConfig


class ServerDown(Exception):
    """The server did not answer (connection refused or reset, timeout, 5xx)."""


class ConnectionDropped(ServerDown):
    """The connection was reset or closed without a (complete) reply: the server may be dead, or alive
    and overloaded (its listen queue full); the engine asks it before treating it as dead."""


DROPPED = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, http.client.IncompleteRead)


def transport_error(where: str, e: BaseException) -> ServerDown:
    """The ServerDown for a failed call: ConnectionDropped when the connection was cut, not refused or timed out."""
    reason = e.reason if isinstance(e, urllib.error.URLError) else e
    kind = ConnectionDropped if isinstance(reason, DROPPED) else ServerDown
    return kind(f"{where}: {type(e).__name__}: {reason}")


class SGLangClient:
    def __init__(self, url: str, timeout_s: float = 60.0, max_inflight: int = 8, seed_mask: int | None = None,
                 routes_cfg: ModelConfig | None = None):
        self.url = url.rstrip("/")
        self.routes_cfg = routes_cfg if routes_cfg is not None and routes_cfg.num_experts else None  # MoE: ask for R3
        self.timeout_s = timeout_s
        self.max_inflight = max_inflight
        self.seed_mask = seed_mask  # real SGLang: seeds reduced to 63 bits
        self._pool = ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix="sglang-http")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- one blocking call -------------------------------------------------------------------
    def call(self, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None
             ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
        where = f"{method} {self.url}{path}"
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            if e.code >= 500:
                raise ServerDown(f"{where}: HTTP {e.code}: {detail}") from None
            raise EngineError(f"{where}: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError, OSError) as e:
            raise transport_error(where, e) from None
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return {"text": raw.decode(errors="replace")}

    # --- the rollout path ----------------------------------------------------------------------
    def generate_chunk(self, chunk: Sequence[Request], sampling: SamplingConfig) -> list[Sample]:
        body = sglang_api.generate_body(chunk, sampling, self.seed_mask, self.routes_cfg is not None)
        return sglang_api.parse_generate_reply(self.call("POST", "/generate", body), len(chunk), self.url,
                                               self.routes_cfg)

    def generate_chunks(self, chunks: Sequence[Sequence[Request]], sampling: SamplingConfig
                        ) -> list[list[Sample] | BaseException]:
        """Every chunk as its own /generate call, up to max_inflight at once; per chunk, its samples
        or the exception it raised (so the caller re-issues exactly the ones that failed)."""

        async def run() -> list[Any]:
            loop = asyncio.get_running_loop()
            gate = asyncio.Semaphore(self.max_inflight)

            async def one(chunk: Sequence[Request]) -> list[Sample]:
                async with gate:
                    return await loop.run_in_executor(self._pool, self.generate_chunk, chunk, sampling)

            return await asyncio.gather(*(one(c) for c in chunks), return_exceptions=True)

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(run())
        # Called from inside an event loop (an async plugin): the same calls on the pool, no nested loop.
        futures = [self._pool.submit(self.generate_chunk, c, sampling) for c in chunks]
        return [f.exception() or f.result() for f in futures]

    # --- control -------------------------------------------------------------------------------
    def health(self, timeout_s: float = 5.0) -> bool:
        try:
            self.call("GET", "/health", timeout_s=timeout_s)
            return True
        except (ServerDown, EngineError):
            return False

    def health_generate(self, timeout_s: float = 30.0) -> bool:
        try:
            self.call("GET", "/health_generate", timeout_s=timeout_s)
            return True
        except (ServerDown, EngineError):
            return False

    def model_info(self) -> dict[str, Any]:
        return self.call("GET", "/get_model_info")

    def weight_version(self) -> int:
        return int(self.model_info()["weight_version"])

    def flush_cache(self) -> None:
        self.call("POST", "/flush_cache", {})

    def pause_generation(self, mode: str = "in_place") -> None:
        self.call("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self.call("POST", "/continue_generation", {})

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort the request `rid` (or all): it finishes with finish_reason "abort" and its output so far."""
        self.call("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    def _checked(self, path: str, body: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        reply = self.call("POST", path, body, timeout_s)
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineError(f"POST {self.url}{path}: {reply.get('message')}")
        return reply

    def update_weights_from_tensor(self, named: dict[str, Any], version: int, draft_only: bool = False) -> None:
        """draft_only: the tensors are the speculative draft's (SGLang's field of the same name)."""
        self._checked("/update_weights_from_tensor", sglang_api.tensor_update_body(named, version, draft_only))

    def update_weights_from_disk(self, model_path: str, version: int) -> None:
        self._checked("/update_weights_from_disk",
                      {"model_path": model_path, "weight_version": str(version), "flush_cache": True})

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl",
                                  timeout_s: float | None = None) -> None:
        """Ask the server to join a weight-update group (it blocks until the trainer, rank 0, joins too)."""
        self._checked("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}, timeout_s)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        version: int, group_name: str = "weight_update_group",
                                        timeout_s: float | None = None) -> None:
        """Announce a broadcast; the reply comes once the trainer has broadcast the tensors over the group."""
        self._checked("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name, "flush_cache": True,
            "weight_version": str(version)}, timeout_s)

    def destroy_weights_update_group(self, group_name: str) -> bool:
        """Best effort (the server may be gone): whether the server released the group."""
        try:
            self._checked("/destroy_weights_update_group", {"group_name": group_name}, timeout_s=5.0)
            return True
        except (ServerDown, EngineError):
            return False
