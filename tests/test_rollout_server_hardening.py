"""The rollout server under hostile or heavy clients (issue 16): bad fields are 400s naming the field, a full
listen queue drops nothing, a dropped connection from a live server is no restart, half a body frees its handler."""

import json
import math
import socket
import struct
import threading
import time

import pytest

from launch import rollout_server
from launch.engines.base import EngineError, Sample, make_requests
from launch.engines.embedded import EmbeddedEngine
from launch.engines.remote import RecoveryPolicy, RemoteEngine, check_samples, tensor_sync
from launch.engines.sglang_api import parse_generate_body
from launch.engines.sglang_client import ConnectionDropped, transport_error
from miles_fn import prng
from miles_fn.sampling import SamplingConfig
from tests.test_rollout_server import CFG, PROMPTS, SAMPLING, SERVER_OPS, params_for, post


def _serve(handler_cls, backlog: int = 1024, start: bool = True):
    state = rollout_server.RolloutState(CFG, params_for(0), 0, ops_cfg=SERVER_OPS)
    srv = rollout_server.RolloutHTTPServer(("127.0.0.1", 0), handler_cls(state), backlog)
    if start:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.fixture(scope="module")
def url():
    srv, u = _serve(lambda s: rollout_server.make_handler(s, read_timeout_s=1.0))
    yield u
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("field,value,needle", [
    ("input_ids", [[1, 2, 40]], "input_ids[0][2]: token id 40 is outside the model's vocabulary [0, 40)"),
    ("input_ids", [[1, -1]], "input_ids[0][1]: token id -1"),
    ("input_ids", [[1, True]], "input_ids[0][1]: an integer is required, got True"),
    ("input_ids", [1, 2.0], "input_ids[1]: an integer is required"),
    ("temperature", math.nan, "temperature: a finite number is required, got nan"),
    ("temperature", math.inf, "temperature: a finite number is required, got inf"),
    ("temperature", "1.0", "temperature: a number is required"),
    ("temperature", -0.5, "temperature: must be >= 0"),
    ("top_p", 0.0, "top_p: must be in (0, 1]"),
    ("top_k", 2.5, "top_k: an integer is required"),
    ("max_new_tokens", 2.5, "max_new_tokens: an integer is required, got 2.5"),
    ("max_new_tokens", True, "max_new_tokens: an integer is required, got True"),
    ("max_new_tokens", 0, "max_new_tokens: 0 is outside [1, inf)"),
    ("stop_token_ids", [99], "stop_token_ids[0]: token id 99 is outside"),
    ("sampling_seed", -1, "sampling_seed: -1 is outside [0, "),
    ("ignore_eos", "yes", "ignore_eos: true or false is required"),
])
def test_bad_fields_are_400s_naming_the_field(url, field, value, needle):
    body = {"input_ids": [[1, 2, 3]], "sampling_params": {"max_new_tokens": 2}}
    if field == "input_ids":
        body["input_ids"] = value
    else:
        body["sampling_params"][field] = value
    code, reply = post(url, "/generate", body)  # json.dumps writes NaN / Infinity, as a careless client would
    assert code == 400 and needle in reply["message"], reply
    code, reply = post(url, "/generate", {"input_ids": [[1, 2, 3]], "sampling_params": {"max_new_tokens": 2}})
    assert code == 200 and len(reply[0]["output_ids"]) == 2  # the server still serves


def test_strict_parse_keeps_good_bodies_and_names_weight_versions(url):
    prompts, seeds, sc = parse_generate_body({"input_ids": [5, 6], "sampling_params": {
        "temperature": 0, "top_k": -1, "max_new_tokens": 3, "sampling_seed": 2**64 - 1, "stop_token_ids": []}}, 40)
    assert (prompts, seeds, sc.temperature, sc.top_k, sc.max_new_tokens) == ([[5, 6]], [2**64 - 1], 0.0, 0, 3)
    for v in ("1.5", True, -2, None):
        code, reply = post(url, "/update_weights_from_disk", {"model_path": "/nowhere", "weight_version": v})
        assert code == 400, v


def test_sixty_four_queued_connections_are_all_served():
    """The kernel holds connections the server has not accepted yet (a busy accept loop); with http.server's
    backlog of 5, the connections past it are never established."""
    srv, _ = _serve(lambda s: rollout_server.make_handler(s, read_timeout_s=10.0), start=False)
    body = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}).encode()
    req = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
           + str(len(body)).encode() + b"\r\n\r\n" + body)
    socks = []
    try:
        for _ in range(64):  # before serve_forever: all of them wait in the listen queue
            s = socket.create_connection(srv.server_address, timeout=2.0)
            s.sendall(req)
            socks.append(s)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        for s in socks:
            s.settimeout(30)
            assert s.recv(64).startswith(b"HTTP/1.1 200"), "a queued connection was not served"
    finally:
        for s in socks:
            s.close()
        srv.shutdown()
        srv.server_close()


def _resetting_handler(n_resets: int):
    """make_handler's class, except that the first n_resets /generate connections are reset (RST, no reply),
    as a kernel with a full queue does to a live server."""
    left = [n_resets]

    def factory(state):
        base = rollout_server.make_handler(state, read_timeout_s=10.0)

        class Resetting(base):
            def do_POST(self) -> None:  # noqa: N802
                if self.path == "/generate" and left[0] > 0:
                    left[0] -= 1
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    self.connection.close()
                    return
                super().do_POST()

        return Resetting

    return factory, left


def test_a_reset_from_a_live_server_is_reissued_not_a_restart():
    factory, left = _resetting_handler(5)
    srv, u = _serve(factory)
    p1 = params_for(1)
    recovery = RecoveryPolicy(max_restarts=1, backoff_s=0.01, start_timeout_s=10)
    remote = RemoteEngine(CFG, p1, 1, url=u, sync=tensor_sync(CFG), batch_size=2, max_inflight=8, recovery=recovery)
    local = EmbeddedEngine(CFG, p1, 1, batch_size=2, ops_cfg=SERVER_OPS)
    reqs = make_requests(PROMPTS, prng.key(5))
    try:
        # 5 resets with max_restarts=1: counted as restarts, this batch would fail the run
        assert remote.generate(reqs, SAMPLING) == local.generate(reqs, SAMPLING)
        assert left[0] == 0 and remote.reissues >= 1 and remote.recoveries == 0
    finally:
        remote.close()
        srv.shutdown()
        srv.server_close()


def test_connection_errors_are_told_apart():
    import urllib.error

    assert isinstance(transport_error("x", urllib.error.URLError(ConnectionResetError(104, "reset"))),
                      ConnectionDropped)
    refused = transport_error("x", urllib.error.URLError(ConnectionRefusedError(111, "refused")))
    assert not isinstance(refused, ConnectionDropped) and "refused" in str(refused)


def _read_to_close(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(4096):
        out += chunk
    return out


def test_half_a_body_is_answered_408_and_frees_the_handler(url):
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    try:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{\"input_ids\": [1,")
        t0 = time.monotonic()
        reply = _read_to_close(s)  # returns only once the server closed the connection
        assert reply.startswith(b"HTTP/1.1 408") and b"read timeout" in reply, reply[:300]
        assert time.monotonic() - t0 < 8  # the 1 s timeout, not forever
    finally:
        s.close()
    for bad in ("-5", "x"):
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {bad}\r\n\r\n".encode())
        assert s.recv(4096).startswith(b"HTTP/1.1 400")
        s.close()


def test_samples_past_the_tokenizer_or_from_old_weights_are_refused_by_name():
    ok = [Sample([1, 9], [0.0, 0.0], "length", 3)]
    check_samples(ok, 3, 10, "rollout server http://s")
    check_samples(ok + [Sample([12], [0.0], "length", 3)], 3, 0, "rollout server http://s")  # no limit
    with pytest.raises(EngineError, match=r"http://s sampled token id 12, outside the tokenizer's 10 ids.*"
                                          r"--vocab-limit 10"):
        check_samples(ok + [Sample([12], [0.0], "length", 3)], 3, 10, "rollout server http://s")
    with pytest.raises(EngineError, match=r"http://s produced samples with weight version 3, expected 4"):
        check_samples(ok, 4, 10, "rollout server http://s")


def test_server_vocab_limit_cuts_the_padded_rows(url):
    srv, u = _serve(lambda s: rollout_server.make_handler(s, read_timeout_s=5.0))
    try:
        body = {"input_ids": [[1, 2, 3]] * 8, "sampling_params": [
            {"max_new_tokens": 6, "sampling_seed": i} for i in range(8)]}
        code, reply = post(u, "/generate", body)
        assert code == 200 and max(max(r["output_ids"]) for r in reply) >= 8  # the rows past 8 are sampled
    finally:
        srv.shutdown()
        srv.server_close()
    state = rollout_server.RolloutState(CFG, params_for(0), 0, ops_cfg=SERVER_OPS, vocab_limit=8)
    replies = state.generate(body)
    assert all(max(r["output_ids"]) < 8 for r in replies)
    assert SamplingConfig(vocab_limit=8).limits(CFG.vocab_size)
