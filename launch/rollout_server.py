"""The embedded engine behind an SGLang-compatible HTTP subset, so rollout runs as its own process.

    python -m launch.rollout_server --model-path DIR --port 30000 [--host 127.0.0.1]

DIR is a Hugging Face checkpoint (config.json + safetensors), as for `sglang.launch_server`.
Endpoints and body shapes: launch/engines/sglang_api.py. Weights arrive by request body, from disk,
or over a torch.distributed group the trainer hosts (/init_weights_update_group, then
/update_weights_from_distributed while the trainer broadcasts; gloo here, as the server is CPU-only).
The OpenAI-compatible /v1/completions, /v1/chat/completions, /v1/models: launch/engines/openai_api.py.
Each /generate call runs as one batch (calls run one at a time), so a client that sends the same
chunks gets the same bits as the in-process engine. Only stdlib http.server: no web framework, and no pickle anywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

import ops
from launch.engines import openai_api, sglang_api, weight_group
from launch.engines.base import Request, SpecDraft
from launch.engines.embedded import run_chunk
from miles_fn.config import ModelConfig
from miles_fn.prefix_cache import PrefixCache
from miles_fn.speculative import check_draft
from state import hf

MAX_BODY = 1 << 31


class RolloutState:
    """The server's mutable state (weights, version, pause flag), guarded by one lock."""

    def __init__(self, cfg: ModelConfig, params: Any, version: int, exit_after: int = 0,
                 group_timeout_s: float = 600.0, group_fault: str = "", ops_cfg: ops.OpsConfig = ops.REFERENCE,
                 vocab_limit: int = 0, prefix_cache_mb: int = 0):
        self.cfg, self.params, self.version = cfg, params, version
        self.prefix_cache = PrefixCache(prefix_cache_mb << 20)  # prompt turns across calls: speed only
        self.vocab_limit = vocab_limit  # ids >= this are never sampled (a padded vocabulary's rows); 0 = none
        self.ops_cfg = ops_cfg  # ops.INVARIANT (--enable-deterministic-inference): the trainer's log-probs bit for bit
        self.lock = threading.Lock()
        self.waiting_lock = threading.Lock()
        self.wake = threading.Condition(self.waiting_lock)
        self.running = threading.Event()
        self.running.set()
        self.generate_calls = 0
        self.exit_after = exit_after  # fault injection for tests: die on this /generate call
        self.groups: dict[str, Any] = {}  # name -> (ProcessGroup, receive device)
        self.groups_lock = threading.Lock()
        self.group_timeout_s = group_timeout_s
        self.group_fault = group_fault  # tests: "unreachable" or "crash_in_update:N"
        self.distributed_updates = 0
        # Abort (SGLang's /abort_request, /pause_generation mode "abort"): a call runs as one batch, so
        # abort reaches calls still waiting: paused ones come back at once, queued ones when the running
        # batch ends, with finish_reason "abort" and the output so far (empty: they never started).
        self.waiting: dict[int, list[str]] = {}  # waiting call id -> its request ids
        self.aborted: set[int] = set()  # waiting call ids to answer with an abort
        self.calls = 0
        self.openai_calls = 0
        self.served_by = ""  # this server's URL, named in each reply's meta_info (a router does not say who served)
        self.codec = openai_api.NO_TOKENIZER  # text <-> ids for /v1/* (--tokenizer-path)
        # --speculative-algorithm STANDALONE: the draft LM (its weights and version change by draft_only updates)
        self.draft: SpecDraft | None = None

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Mark waiting calls that hold `rid` (or all) as aborted; how many. An unknown rid is a no-op, as in SGLang."""
        with self.waiting_lock:
            hit = [c for c, rids in self.waiting.items() if abort_all or rid in rids]
            self.aborted.update(hit)
            self.wake.notify_all()
        return len(hit)

    def generate(self, body: dict[str, Any], probe: bool = False) -> list[dict[str, Any]]:
        prompts, seeds, sampling = sglang_api.parse_generate_body(body, self.cfg.vocab_size)
        routes = body.get("return_routed_experts") is not None and sglang_api.strict_bool(
            body["return_routed_experts"], "return_routed_experts")
        if routes and not self.cfg.num_experts:
            raise ValueError("return_routed_experts: this model has no MoE layers, so no experts to return")
        if routes and self.draft is not None:
            raise ValueError("return_routed_experts: this server speculates (--speculative-algorithm) and its verify "
                             "forward records no routes; start it without a draft for routing replay")
        if self.vocab_limit:
            sampling = dataclasses.replace(sampling, vocab_limit=self.vocab_limit)
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
                reply = self._run(prompts, seeds, sampling, probe, routes)
            for item, r in zip(reply, rids):  # SGLang's meta_info.id: which request each output answers
                item["meta_info"]["id"] = r
            return reply
        finally:
            with self.waiting_lock:
                self.waiting.pop(call, None)
                self.aborted.discard(call)

    def _run(self, prompts: list[list[int]], seeds: list[int], sampling: Any, probe: bool, routes: bool = False
             ) -> list[dict[str, Any]]:
        """One call as one batch (the caller holds self.lock)."""
        self.generate_calls += not probe
        if self.exit_after and self.generate_calls >= self.exit_after:
            os._exit(17)  # a crash mid-batch: other calls are in flight, no reply is sent
        reqs = [Request(i, p, s) for i, (p, s) in enumerate(zip(prompts, seeds, strict=True))]
        samples = run_chunk(self.params, self.cfg, reqs, sampling, self.version, self.ops_cfg,
                            None if probe else self.draft, self.prefix_cache)
        reply = sglang_api.generate_reply(samples, [len(p) for p in prompts], self.cfg if routes else None)
        for item in reply if self.served_by else ():
            item["meta_info"]["served_by"] = self.served_by
        return reply

    def update_from_tensors(self, body: dict[str, Any]) -> dict[str, Any]:
        fmt = body.get("load_format")
        if fmt != sglang_api.TENSOR_FORMAT:
            raise ValueError(f"load_format: only {sglang_api.TENSOR_FORMAT!r} is accepted (got {fmt!r}); "
                             "pickled tensors are never loaded")
        blobs = body.get("serialized_named_tensors")
        if not isinstance(blobs, list) or len(blobs) != 1 or not isinstance(blobs[0], str):
            raise ValueError("serialized_named_tensors: one base64 string (tp_size 1) is required")
        draft_only = body.get("draft_only") is not None and sglang_api.strict_bool(body["draft_only"], "draft_only")
        target_only = body.get("disable_draft_model") is not None and sglang_api.strict_bool(
            body["disable_draft_model"], "disable_draft_model")
        if draft_only and target_only:
            raise ValueError("draft_only and disable_draft_model are mutually exclusive")
        if draft_only and self.draft is None:
            raise ValueError("draft_only: this server has no draft; start it with --speculative-algorithm STANDALONE "
                             "--speculative-draft-model-path DIR")
        named = sglang_api.decode_tensors(blobs[0])
        version = _version(body)
        with self.lock:
            if draft_only:  # the draft is a separate LM: its tensors never reach the target, nor the target's it
                assert self.draft is not None
                self.draft = self.draft._replace(params=replace_named(self.draft.cfg, self.draft.params, named),
                                                 version=version)
                return {"success": True, "message": f"updated {len(named)} draft tensors to version {version}"}
            self.params = replace_named(self.cfg, self.params, named)
            self.version = version
        return {"success": True, "message": f"updated {len(named)} tensors to weight_version {version}"}

    def model_info(self) -> dict[str, Any]:
        spec = {} if self.draft is None else {"speculative_algorithm": "STANDALONE",
                                              "speculative_num_steps": self.draft.num_steps,
                                              "speculative_disable_by_batch_size": self.draft.disable_by_batch_size,
                                              "draft_weight_version": str(self.draft.version)}
        return {"model_path": "miles-fn", "is_generation": True, "weight_version": str(self.version),
                **sglang_api.ops_info(self.ops_cfg), **spec}

    # --- weights over a torch.distributed group (launch/engines/weight_group.py) -----------------
    def init_group(self, body: dict[str, Any]) -> dict[str, Any]:
        """Join the trainer's weight-update group as rank rank_offset (this server is one rank)."""
        addr, port = body.get("master_address"), body.get("master_port")
        rank, world, name = body.get("rank_offset"), body.get("world_size"), body.get("group_name")
        backend = body.get("backend", "nccl")
        if not isinstance(addr, str) or not addr:
            raise ValueError("master_address: the trainer's address is required")
        for field, v in (("master_port", port), ("rank_offset", rank), ("world_size", world)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{field}: a non-negative integer is required, got {v!r}")
        if not 1 <= rank < world:
            raise ValueError(f"rank_offset={rank}, world_size={world}: this server needs rank 1 <= rank_offset < "
                             "world_size (rank 0 is the trainer)")
        if not isinstance(name, str) or not name:
            raise ValueError("group_name: a non-empty name is required")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend: gloo or nccl, got {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend: nccl needs CUDA and this server runs on CPU; use gloo")
        with self.groups_lock:
            if name in self.groups:
                raise ValueError(f"group_name: a group {name!r} already exists")
            self.groups[name] = (None, None)  # reserved while forming
        if self.group_fault == "unreachable":  # tests: dial a port where nobody listens, as a wrong address would
            from launch.engines.remote import free_port

            port = free_port()
        try:
            pg = weight_group.init_group(backend, addr, port, world, rank, name, self.group_timeout_s)
        except Exception as e:  # DistStoreError / RuntimeError: the trainer is not there, or timed out
            with self.groups_lock:
                self.groups.pop(name, None)
            raise GroupFailure(f"group {name} at tcp://{addr}:{port} did not form: {type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}") from None
        with self.groups_lock:
            self.groups[name] = (pg, torch.device("cuda") if backend == "nccl" else torch.device("cpu"))
        return {"success": True, "message": f"joined {name} as rank {rank} of {world} ({backend})"}

    def update_from_distributed(self, body: dict[str, Any]) -> dict[str, Any]:
        """Receive the announced tensors from rank 0, in order, then swap them in as one new version."""
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        name = body.get("group_name", "weight_update_group")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes) and names):
            raise ValueError("names, dtypes, shapes: three non-empty lists of the same length are required")
        if not all(isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes):
            raise ValueError("shapes: every shape must be a list of non-negative ints")
        version = _version(body)
        with self.groups_lock:
            pg, device = self.groups.get(name) or (None, None)
        if pg is None:
            raise ValueError(f"group_name: no weight-update group {name!r} (call /init_weights_update_group first)")
        empties = {n: torch.empty(s, dtype=weight_group.parse_dtype(d)) for n, d, s in zip(names, dtypes, shapes)}
        replace_named(self.cfg, self.params, empties)  # checks names, shapes and dtypes before receiving
        bufs = [t.to(device) for t in empties.values()]  # nccl receives on the GPU
        self.distributed_updates += 1
        mode, _, n = self.group_fault.partition(":")
        try:
            if mode == "crash_in_update" and self.distributed_updates >= int(n):
                weight_group.broadcast(pg, bufs[:1])
                os._exit(18)  # tests: dies mid-broadcast, one tensor in
            weight_group.broadcast(pg, bufs)
        except Exception as e:  # the trainer went away or timed out: this group is done
            with self.groups_lock:
                self.groups.pop(name, None)
            weight_group.destroy_group(pg)
            raise GroupFailure(f"group {name}: receiving the weights failed: {type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}") from None
        received = {n: b.cpu() for n, b in zip(empties, bufs, strict=True)}
        with self.lock:
            self.params = replace_named(self.cfg, self.params, received)
            self.version = version
        return {"success": True, "message": f"received {len(names)} tensors as weight_version {version}"}

    def destroy_group(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("group_name", "weight_update_group")
        with self.groups_lock:
            pg, _ = self.groups.pop(name, None) or (None, None)
        if pg is None:
            raise ValueError(f"group_name: no weight-update group {name!r}")
        weight_group.destroy_group(pg)
        return {"success": True, "message": f"left {name}"}

    def update_from_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise ValueError("model_path: a checkpoint directory is required")
        if body.get("draft_only"):
            raise ValueError("draft_only: a draft's weights arrive by /update_weights_from_tensor here, not from disk")
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


def openai_route(state: RolloutState, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(status, reply) of an OpenAI-compatible endpoint (launch/engines/openai_api.py), 400s in OpenAI's shape."""
    positions = state.cfg.max_position_embeddings
    if path == "/v1/models":
        return 200, openai_api.models(positions)
    parse = {"/v1/completions": openai_api.completion_request, "/v1/chat/completions": openai_api.chat_request}
    if path not in parse or method != "POST":
        return 404, openai_api.error(f"path: no {method} endpoint {path}", 404)
    try:
        gen, plan = parse[path](body, state.codec, state.cfg.vocab_size, positions)
        reply = state.generate(gen)
    except ValueError as e:
        return 400, openai_api.error(str(e))
    with state.waiting_lock:
        state.openai_calls += 1
        rid = f"{'cmpl' if plan.kind == 'completion' else 'chatcmpl'}-{state.openai_calls}"
    return 200, openai_api.response(plan, reply, state.codec, str(body.get("rid") or rid))


class GroupFailure(Exception):
    """A weight-update group failed in transport (peer gone, timeout): answered with HTTP 500."""


def _version(body: dict[str, Any]) -> int:
    v = body.get("weight_version")
    if isinstance(v, str) and v.strip().isdigit():
        return int(v)
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v
    raise ValueError(f"weight_version: a non-negative integer (as a string) is required, got {sglang_api.show(v)}")


def replace_named(cfg: ModelConfig, params: Any, named: dict[str, torch.Tensor]) -> Any:
    """A new params tree with the Hugging Face-named tensors swapped in (shapes and dtypes checked); an
    expert's matrix replaces its row of a copy of the stacked tensor, so `params` is never written."""
    where = hf.weight_names(cfg)
    unknown = sorted(set(named) - set(where))
    if unknown:
        raise ValueError(f"serialized_named_tensors: names the model does not have: {unknown[:5]}")
    new = {k: v for k, v in params.items() if k != "layers"}
    new["layers"] = [dict(layer) for layer in params["layers"]]
    copied: set[tuple] = set()  # stacked expert tensors already copied for this update
    for name, t in named.items():
        path = where[name]
        expert = len(path) == 4  # ("layers", i, "e_gate", j): row j of a stacked tensor
        *parents, leaf = path[:3] if expert else path
        node = new
        for w in parents:
            node = node[w]
        old = node[leaf][path[3]] if expert else node[leaf]
        if t.shape != old.shape or t.dtype != old.dtype:
            raise ValueError(f"serialized_named_tensors: {name} is {t.dtype}{tuple(t.shape)}, "
                             f"the model has {old.dtype}{tuple(old.shape)}")
        if not expert:
            node[leaf] = t
            continue
        if path[:3] not in copied:
            node[leaf] = node[leaf].clone()
            copied.add(path[:3])
        node[leaf][path[3]] = t
    return new


class BodyCut(Exception):
    """The client closed its connection before the body's Content-Length bytes arrived."""


class RolloutHTTPServer(ThreadingHTTPServer):
    """One thread a connection, with a listen queue deep enough for a trainer's in-flight calls.

    http.server's default backlog of 5 resets connections under 50 concurrent /generate calls while
    the server is healthy; each queued connection waits for its turn at the batch lock instead.
    """

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], backlog: int) -> None:
        self.request_queue_size = backlog  # read by server_activate (listen) during __init__
        super().__init__(address, handler)


def make_handler(state: RolloutState, read_timeout_s: float | None = 60.0) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = read_timeout_s  # socket reads (headers, body) that stall longer raise TimeoutError

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
            given = self.headers.get("Content-Length") or "0"
            if not given.strip().isdigit():
                raise ValueError(f"Content-Length: a non-negative integer is required, got {given!r}")
            n = int(given)
            if n > MAX_BODY:
                raise ValueError(f"body of {n} bytes is over the {MAX_BODY}-byte limit")
            raw = self.rfile.read(n) if n else b"{}"
            if len(raw) < n:
                raise BodyCut(f"the connection closed {len(raw)} bytes into a {n}-byte body")
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
            except (TimeoutError, BodyCut) as e:  # half a body: free this handler (the socket read timeout)
                self.close_connection = True
                why = str(e) if isinstance(e, BodyCut) else (
                    f"no complete body within the {self.timeout:g} s read timeout (--read-timeout-s)")
                try:
                    return self._send(408, {"success": False, "message": why})
                except OSError:  # the client is gone already
                    return None
            except ValueError as e:
                self.close_connection = True  # the body's bytes may still be unread: do not parse them as a request
                return self._send(400, {"success": False, "message": str(e)})
            try:
                if path == "/health":
                    return self._send(200, {})
                if path == "/health_generate":
                    state.generate({"input_ids": [[0]], "sampling_params": {"max_new_tokens": 1}}, probe=True)
                    return self._send(200, {})
                if path in ("/get_model_info", "/model_info"):
                    return self._send(200, state.model_info())
                if path in ("/get_weight_version", "/weight_version"):
                    return self._send(200, {"weight_version": str(state.version)})
                if path.startswith("/v1/"):
                    return self._send(*openai_route(state, method, path, body))
                if method != "POST":
                    return self._send(404, {"error": f"no GET endpoint {path}"})
                if path == "/generate":
                    return self._send(200, state.generate(body))
                if path == "/update_weights_from_tensor":
                    return self._send(200, state.update_from_tensors(body))
                if path == "/update_weights_from_disk":
                    return self._send(200, state.update_from_disk(body))
                if path == "/flush_cache":
                    state.prefix_cache.clear()
                    return self._send(200, {"success": True})
                if path == "/pause_generation":
                    state.running.clear()
                    if body.get("mode") == "abort":
                        state.abort(abort_all=True)
                    return self._send(200, {"success": True})
                if path == "/continue_generation":
                    state.running.set()
                    return self._send(200, {"success": True})
                if path == "/init_weights_update_group":
                    return self._send(200, state.init_group(body))
                if path == "/update_weights_from_distributed":
                    return self._send(200, state.update_from_distributed(body))
                if path == "/destroy_weights_update_group":
                    return self._send(200, state.destroy_group(body))
                if path == "/abort_request":
                    n = state.abort(str(body.get("rid") or ""), bool(body.get("abort_all")))
                    return self._send(200, {"success": True, "message": f"aborted {n} waiting call(s)"})
                return self._send(404, {"error": f"no endpoint {path}"})
            except ValueError as e:
                return self._send(400, {"success": False, "message": str(e)})
            except GroupFailure as e:
                return self._send(500, {"success": False, "message": str(e)})

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._route("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._route("POST")

    return Handler


def server_ops(deterministic: bool, tile_rows: int, kv_block: int, decode_backend: str = "auto") -> ops.OpsConfig:
    """The kernels the server runs: the invariant ones (with the trainer's tiling) when deterministic."""
    if not deterministic:
        return ops.OpsConfig(decode_backend=decode_backend)
    return ops.OpsConfig(mode="invariant", tile_rows=tile_rows, kv_block=kv_block)


def watch_parent(parent: int) -> None:
    """Exit when the process that started us is gone, so a killed run never leaks a server."""
    while True:
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(0.5)


def load_draft(args: argparse.Namespace, cfg: ModelConfig, version: int) -> SpecDraft | None:
    """The draft the speculative flags name (None without --speculative-algorithm); ValueError naming the flag."""
    algo = args.speculative_algorithm
    if not algo:
        if args.speculative_draft_model_path:
            raise ValueError("--speculative-draft-model-path needs --speculative-algorithm STANDALONE")
        return None
    if algo.upper() != "STANDALONE":
        raise ValueError(f"--speculative-algorithm={algo}: only STANDALONE (a separate draft LM) is served here; "
                         "EAGLE heads need real SGLang")
    if not args.speculative_draft_model_path:
        raise ValueError("--speculative-algorithm STANDALONE needs --speculative-draft-model-path DIR")
    if args.speculative_disable_by_batch_size < 0:
        raise ValueError(f"--speculative-disable-by-batch-size must be >= 0, got "
                         f"{args.speculative_disable_by_batch_size}")
    try:
        dcfg, dparams = hf.load_hf(args.speculative_draft_model_path)
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"--speculative-draft-model-path={args.speculative_draft_model_path}: {e}") from None
    try:
        check_draft(cfg, dcfg, args.speculative_num_steps)
    except ValueError as e:
        raise ValueError(f"--speculative-draft-model-path={args.speculative_draft_model_path}: {e}") from None
    return SpecDraft(dcfg, dparams, version, args.speculative_num_steps, args.speculative_disable_by_batch_size)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launch.rollout_server", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1, help="must be 1 (accepted for SGLang compatibility)")
    p.add_argument("--mem-fraction-static", type=float, default=None, help="ignored (SGLang compatibility)")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="batch-invariant kernels (ops.INVARIANT): a request's tokens and log-probs do not depend on "
                   "its batch, and equal the trainer's under --true_on_policy bit for bit")
    p.add_argument("--invariant-tile-rows", type=int, default=ops.INVARIANT.tile_rows,
                   help="with --enable-deterministic-inference: the trainer's --invariant_tile_rows")
    p.add_argument("--invariant-kv-block", type=int, default=ops.INVARIANT.kv_block,
                   help="with --enable-deterministic-inference: the trainer's --invariant_kv_block")
    p.add_argument("--decode-backend", default="auto", choices=ops.config.DECODE_BACKENDS,
                   help="decode steps without --enable-deterministic-inference: the trainer's --decode_backend")
    p.add_argument("--skip-tokenizer-init", action="store_true", help="accepted (SGLang compatibility): /generate "
                   "is ids in, ids out; text only on /v1/* with a tokenizer (--tokenizer-path)")
    p.add_argument("--tokenizer-path", default="", help="text for /v1/completions and /v1/chat/completions: a Hugging "
                   "Face tokenizer directory or 'char' (miles_fn's character tokenizer); default: --model-path's "
                   "tokenizer when it has one, else none (token-id prompts only)")
    p.add_argument("--weight-version", default="0", help="version of the weights at --model-path")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--watch-parent", action="store_true", help="exit when the parent process exits")
    p.add_argument("--debug-exit-after", type=int, default=0, help="tests: crash on the Nth /generate call")
    p.add_argument("--weight-group-timeout-s", type=float, default=600.0,
                   help="how long forming a weight-update group, or one broadcast over it, may take")
    p.add_argument("--listen-backlog", type=int, default=1024,
                   help="connections the kernel queues while every handler is busy (more are reset)")
    p.add_argument("--read-timeout-s", type=float, default=60.0,
                   help="a client that sends no byte of its request for this long is answered 408 and dropped")
    p.add_argument("--vocab-limit", type=int, default=0,
                   help="never sample ids >= this (a padded vocabulary's rows past the tokenizer); 0 = every row")
    p.add_argument("--speculative-algorithm", default="", help="STANDALONE: a separate small draft LM "
                   "(--speculative-draft-model-path) proposes tokens; the samples stay exactly plain decoding's "
                   "(docs/speculative-decoding.md). Its weights change by /update_weights_from_tensor with draft_only")
    p.add_argument("--speculative-draft-model-path", default="", help="the draft's Hugging Face checkpoint directory")
    p.add_argument("--speculative-num-steps", type=int, default=3, help="draft tokens proposed per verify forward")
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=0, help="a decode round with more "
                   "live rows than this is a plain step (the same tokens); 0 = always speculate")
    p.add_argument("--prefix-cache-mb", type=int, default=256, help="MiB of prompt prefixes (turns cut at a stop "
                   "token) kept across calls while the weights stay the same: speed only, never the samples")
    p.add_argument("--disable-radix-cache", action="store_true", help="SGLang's name for --prefix-cache-mb=0")
    p.add_argument("--debug-fail-start", action="store_true", help="tests: exit at once, as a broken server")
    p.add_argument("--debug-group-fault", default="", help="tests: 'unreachable' (dial a dead port to join a "
                   "weight-update group) or 'crash_in_update:N' (die inside the Nth distributed update)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.debug_fail_start:
        sys.exit("error: --debug-fail-start: exiting as asked")
    if args.tp_size != 1:
        sys.exit(f"error: --tp-size={args.tp_size}: this server runs one process (use real SGLang for TP)")
    if args.listen_backlog < 1:
        sys.exit(f"error: --listen-backlog={args.listen_backlog}: must be >= 1")
    if not args.read_timeout_s > 0:
        sys.exit(f"error: --read-timeout-s={args.read_timeout_s}: must be > 0 seconds")
    if args.prefix_cache_mb < 0:
        sys.exit(f"error: --prefix-cache-mb={args.prefix_cache_mb}: must be >= 0 (0 = off)")
    if args.vocab_limit < 0:
        sys.exit(f"error: --vocab-limit={args.vocab_limit}: must be >= 0 (0 = no limit)")
    if args.watch_parent:
        threading.Thread(target=watch_parent, args=(os.getppid(),), daemon=True).start()
    torch.set_num_threads(args.num_threads)
    ops.use_deterministic_algorithms(True)
    try:
        cfg, params = hf.load_hf(args.model_path)
        version = int(args.weight_version)
    except (OSError, KeyError, ValueError) as e:
        sys.exit(f"error: --model-path={args.model_path}: {e}")
    try:
        ops_cfg = server_ops(args.enable_deterministic_inference, args.invariant_tile_rows, args.invariant_kv_block,
                             args.decode_backend)
        ops.require_backends(ops_cfg)
    except (ValueError, ImportError) as e:
        sys.exit(f"error: {e}")
    state = RolloutState(cfg, params, version, args.debug_exit_after, args.weight_group_timeout_s,
                         args.debug_group_fault, ops_cfg, args.vocab_limit,
                         0 if args.disable_radix_cache else args.prefix_cache_mb)
    try:
        state.draft = load_draft(args, cfg, version)
    except ValueError as e:
        sys.exit(f"error: {e}")
    from launch import data

    tok_path = args.tokenizer_path or (args.model_path if data.has_tokenizer(args.model_path) else "")
    try:
        state.codec = openai_api.load_codec(tok_path)
    except data.DataError as e:
        sys.exit(f"error: --tokenizer-path={tok_path}: {e}")
    server = RolloutHTTPServer((args.host, args.port), make_handler(state, args.read_timeout_s), args.listen_backlog)
    state.served_by = f"http://{args.host}:{server.server_address[1]}"
    print(f"rollout server listening on {state.served_by}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
