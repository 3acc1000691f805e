"""The embedded engine behind an SGLang-compatible HTTP subset, so rollout runs as its own process.

    python -m launch.rollout_server --model-path DIR --port 30000 [--host 127.0.0.1]

DIR is a Hugging Face checkpoint (config.json + safetensors), as for `sglang.launch_server`.
Endpoints and body shapes: launch/engines/sglang_api.py. Each /generate call runs as one batch
(calls run one at a time), so a client that sends the same chunks gets the same bits as the
in-process engine. Only stdlib http.server: no web framework, and no pickle anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from launch.engines import sglang_api
from launch.engines.base import Request
from launch.engines.embedded import run_chunk
from miles_fn.config import ModelConfig
from state import hf

MAX_BODY = 1 << 31


class RolloutState:
    """The server's mutable state (weights, version, pause flag), guarded by one lock."""

    def __init__(self, cfg: ModelConfig, params: Any, version: int, exit_after: int = 0):
        self.cfg, self.params, self.version = cfg, params, version
        self.lock = threading.Lock()
        self.waiting_lock = threading.Lock()
        self.wake = threading.Condition(self.waiting_lock)
        self.running = threading.Event()
        self.running.set()
        self.generate_calls = 0
        self.exit_after = exit_after  # fault injection for tests: die on this /generate call
        # Abort (SGLang's /abort_request, /pause_generation mode "abort"): a call runs as one batch, so
        # abort reaches calls still waiting: paused ones come back at once, queued ones when the running
        # batch ends, with finish_reason "abort" and the output so far (empty: they never started).
        self.waiting: dict[int, list[str]] = {}  # waiting call id -> its request ids
        self.aborted: set[int] = set()  # waiting call ids to answer with an abort
        self.calls = 0

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Mark waiting calls that hold `rid` (or all) as aborted; how many. An unknown rid is a no-op, as in SGLang."""
        with self.waiting_lock:
            hit = [c for c, rids in self.waiting.items() if abort_all or rid in rids]
            self.aborted.update(hit)
            self.wake.notify_all()
        return len(hit)

    def generate(self, body: dict[str, Any], probe: bool = False) -> list[dict[str, Any]]:
        prompts, seeds, sampling = sglang_api.parse_generate_body(body)
        rid = body.get("rid")
        rids = [str(r) for r in rid] if isinstance(rid, list) else [str(rid)] * len(prompts) if rid else []
        with self.waiting_lock:
            self.calls += 1
            call = self.calls
            self.waiting[call] = rids
            while not self.running.is_set() and call not in self.aborted:
                self.wake.wait(0.05)
        try:
            with self.lock:
                with self.waiting_lock:
                    if call in self.aborted:
                        return [sglang_api.abort_reply(len(p)) for p in prompts]
                    del self.waiting[call]
                return self._run(prompts, seeds, sampling, probe)
        finally:
            with self.waiting_lock:
                self.waiting.pop(call, None)
                self.aborted.discard(call)

    def _run(self, prompts: list[list[int]], seeds: list[int], sampling: Any, probe: bool) -> list[dict[str, Any]]:
        """One call as one batch (the caller holds self.lock)."""
        self.generate_calls += not probe
        if self.exit_after and self.generate_calls >= self.exit_after:
            os._exit(17)  # a crash mid-batch: other calls are in flight, no reply is sent
        reqs = [Request(i, p, s) for i, (p, s) in enumerate(zip(prompts, seeds, strict=True))]
        samples = run_chunk(self.params, self.cfg, reqs, sampling, self.version)
        return sglang_api.generate_reply(samples, [len(p) for p in prompts])

    def update_from_tensors(self, body: dict[str, Any]) -> dict[str, Any]:
        fmt = body.get("load_format")
        if fmt != sglang_api.TENSOR_FORMAT:
            raise ValueError(f"load_format: only {sglang_api.TENSOR_FORMAT!r} is accepted (got {fmt!r}); "
                             "pickled tensors are never loaded")
        blobs = body.get("serialized_named_tensors")
        if not isinstance(blobs, list) or len(blobs) != 1 or not isinstance(blobs[0], str):
            raise ValueError("serialized_named_tensors: one base64 string (tp_size 1) is required")
        named = sglang_api.decode_tensors(blobs[0])
        version = _version(body)
        with self.lock:
            self.params = replace_named(self.cfg, self.params, named)
            self.version = version
        return {"success": True, "message": f"updated {len(named)} tensors to weight_version {version}"}

    def update_from_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise ValueError("model_path: a checkpoint directory is required")
        try:
            cfg, params = hf.load_hf(path)
        except (OSError, KeyError) as e:
            raise ValueError(f"model_path={path}: {e}") from None
        if cfg != self.cfg:
            raise ValueError(f"model_path={path}: its config differs from the served model's")
        version = _version(body)
        with self.lock:
            self.params, self.version = params, version
        return {"success": True, "message": f"loaded {path} as weight_version {version}"}


def _version(body: dict[str, Any]) -> int:
    v = body.get("weight_version")
    try:
        return int(v)
    except (TypeError, ValueError):
        raise ValueError(f"weight_version: an integer (as a string) is required, got {v!r}") from None


def replace_named(cfg: ModelConfig, params: Any, named: dict[str, torch.Tensor]) -> Any:
    """A new params tree with the Hugging Face-named tensors swapped in (shapes and dtypes checked)."""
    where = hf.hf_names(cfg)
    unknown = sorted(set(named) - set(where))
    if unknown:
        raise ValueError(f"serialized_named_tensors: names the model does not have: {unknown[:5]}")
    new = {k: v for k, v in params.items() if k != "layers"}
    new["layers"] = [dict(layer) for layer in params["layers"]]
    for name, t in named.items():
        node = new
        path = where[name]
        for w in path[:-1]:
            node = node[w]
        old = node[path[-1]]
        if t.shape != old.shape or t.dtype != old.dtype:
            raise ValueError(f"serialized_named_tensors: {name} is {t.dtype}{tuple(t.shape)}, "
                             f"the model has {old.dtype}{tuple(old.shape)}")
        node[path[-1]] = t
    return new


def make_handler(state: RolloutState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per error only
            pass

        def _send(self, code: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict[str, Any]:
            n = int(self.headers.get("Content-Length") or 0)
            if n > MAX_BODY:
                raise ValueError(f"body of {n} bytes is over the {MAX_BODY}-byte limit")
            raw = self.rfile.read(n) if n else b"{}"
            try:
                body = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"body is not JSON: {e}") from None
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
            return body

        def _route(self, method: str) -> None:
            path = self.path.split("?")[0]
            try:
                body = self._body() if method == "POST" else {}
                if path == "/health":
                    return self._send(200, {})
                if path == "/health_generate":
                    state.generate({"input_ids": [[0]], "sampling_params": {"max_new_tokens": 1}}, probe=True)
                    return self._send(200, {})
                if path in ("/get_model_info", "/model_info"):
                    return self._send(200, {"model_path": "miles-fn", "is_generation": True,
                                            "weight_version": str(state.version)})
                if path in ("/get_weight_version", "/weight_version"):
                    return self._send(200, {"weight_version": str(state.version)})
                if method != "POST":
                    return self._send(404, {"error": f"no GET endpoint {path}"})
                if path == "/generate":
                    return self._send(200, state.generate(body))
                if path == "/update_weights_from_tensor":
                    return self._send(200, state.update_from_tensors(body))
                if path == "/update_weights_from_disk":
                    return self._send(200, state.update_from_disk(body))
                if path == "/flush_cache":
                    return self._send(200, {"success": True})
                if path == "/pause_generation":
                    state.running.clear()
                    if body.get("mode") == "abort":
                        state.abort(abort_all=True)
                    return self._send(200, {"success": True})
                if path == "/continue_generation":
                    state.running.set()
                    return self._send(200, {"success": True})
                if path == "/abort_request":
                    n = state.abort(str(body.get("rid") or ""), bool(body.get("abort_all")))
                    return self._send(200, {"success": True, "message": f"aborted {n} waiting call(s)"})
                if path in ("/init_weights_update_group", "/update_weights_from_distributed"):
                    return self._send(400, {"success": False, "message": f"{path}: needs NCCL and real SGLang; "
                                            "this server syncs through /update_weights_from_tensor or _disk"})
                return self._send(404, {"error": f"no endpoint {path}"})
            except ValueError as e:
                return self._send(400, {"success": False, "message": str(e)})

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._route("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._route("POST")

    return Handler


def watch_parent(parent: int) -> None:
    """Exit when the process that started us is gone, so a killed run never leaks a server."""
    while True:
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(0.5)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launch.rollout_server", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1, help="must be 1 (accepted for SGLang compatibility)")
    p.add_argument("--mem-fraction-static", type=float, default=None, help="ignored (SGLang compatibility)")
    p.add_argument("--enable-deterministic-inference", action="store_true", help="always on here")
    p.add_argument("--skip-tokenizer-init", action="store_true", help="always on here: ids in, ids out")
    p.add_argument("--weight-version", default="0", help="version of the weights at --model-path")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--watch-parent", action="store_true", help="exit when the parent process exits")
    p.add_argument("--debug-exit-after", type=int, default=0, help="tests: crash on the Nth /generate call")
    p.add_argument("--debug-fail-start", action="store_true", help="tests: exit at once, as a broken server")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.debug_fail_start:
        sys.exit("error: --debug-fail-start: exiting as asked")
    if args.tp_size != 1:
        sys.exit(f"error: --tp-size={args.tp_size}: this server runs one process (use real SGLang for TP)")
    if args.watch_parent:
        threading.Thread(target=watch_parent, args=(os.getppid(),), daemon=True).start()
    torch.set_num_threads(args.num_threads)
    torch.use_deterministic_algorithms(True)
    try:
        cfg, params = hf.load_hf(args.model_path)
        version = int(args.weight_version)
    except (OSError, KeyError, ValueError) as e:
        sys.exit(f"error: --model-path={args.model_path}: {e}")
    state = RolloutState(cfg, params, version, args.debug_exit_after)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(state))
    server.daemon_threads = True
    print(f"rollout server listening on http://{args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
