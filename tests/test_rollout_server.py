"""The rollout server and the SGLang client over real HTTP on 127.0.0.1, against in-process references."""

import asyncio
import json
import os
import sys
import urllib.error
import urllib.request

import pytest
import torch

from launch.engines.base import EngineError, Request, make_requests, request_seed, seed_keys
from launch.engines.embedded import EmbeddedEngine
from launch.engines.remote import RecoveryPolicy, RemoteEngine, ServerProcess, tensor_sync
from launch.engines.sglang_api import TENSOR_FORMAT, encode_tensors, parse_generate_reply
from launch.rollout_server import server_ops
from miles_fn import model, prng
from miles_fn.config import ModelConfig
from miles_fn.generate import generate
from miles_fn.sampling import SamplingConfig
from state import hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_position_embeddings=64)
SAMPLING = SamplingConfig(temperature=1.0, top_k=0, top_p=0.95, max_new_tokens=6, stop_token_ids=(2,))
PROMPTS = [[1, 5 + i % 7, 9, 3 + i % 5][: 2 + i % 3] for i in range(10)]
# The kernels a server started without flags runs (the C decode step where it applies): the in-process
# references below use them too, since these tests are about the wire and recovery, not the kernels.
SERVER_OPS = server_ops(False, 0, 0)
FAST = RecoveryPolicy(max_restarts=2, backoff_s=0.01, start_timeout_s=60)


def params_for(seed: int):
    return model.init_params(CFG, prng.key(seed), 0.3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "model")
    hf.save_hf(path, CFG, params_for(0))
    return path


def server_process(ckpt: str, log: str, extra: tuple[str, ...] = ()) -> ServerProcess:
    def command(port: int, first: bool) -> list[str]:
        return [sys.executable, "-m", "launch.rollout_server", "--model-path", ckpt, "--port", str(port),
                "--num-threads", str(torch.get_num_threads()), "--watch-parent", *(extra if first else ())]

    return ServerProcess(command, log, start_timeout_s=60, cwd=ROOT)


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    """One server shared by the tests that leave it running (each sets the weights it needs)."""
    proc = server_process(ckpt, str(tmp_path_factory.mktemp("log") / "server.log"))
    url = proc.start()
    yield proc, url
    proc.stop()


def post(url: str, path: str, body) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_request_seed_carries_the_fold_in_key_exactly():
    k = prng.key(12345)
    for rid in (0, 1, 7, 2**31):
        assert torch.equal(prng.key(request_seed(k, rid)), prng.fold_in(k, rid))


def test_make_requests_seeds_are_each_requests_own_fold_in_and_seed_keys_inverts_them():
    # make_requests folds every rid in one vectorised call; each seed must still be the scalar fold_in's.
    k, rids = prng.key(777), [5, 0, 2**32 - 1, 3, 2**31 + 9]
    reqs = make_requests([[1]] * len(rids), k, rids)
    for r in reqs:
        k0, k1 = prng.fold_in(k, r.rid).tolist()
        assert r.seed == (k0 << 32) | k1
    assert torch.equal(seed_keys([r.seed for r in reqs]), torch.stack([prng.fold_in(k, rid) for rid in rids]))
    assert seed_keys([]).shape == (0, 2)
    with pytest.raises(ValueError, match="sampling seed"):
        seed_keys([2**64])
    with pytest.raises(ValueError, match="2 request ids for 1 prompts"):
        make_requests([[1]], k, [0, 1])


def test_embedded_chunks_are_generate_on_each_chunk_and_whole_batch_is_unchanged():
    p, key = params_for(1), prng.key(3)
    reqs = make_requests(PROMPTS, key)
    whole = EmbeddedEngine(CFG, p, 4).generate(reqs, SAMPLING)
    ref = generate(p, CFG, PROMPTS, key, SAMPLING)  # the pre-interface call of the loop
    assert [s.tokens for s in whole] == ref.tokens and [s.logprobs for s in whole] == ref.logprobs
    assert {s.weight_version for s in whole} == {4}
    chunked = EmbeddedEngine(CFG, p, 4, batch_size=3).generate(reqs, SAMPLING)
    for start in range(0, 10, 3):
        ids = list(range(start, min(start + 3, 10)))
        g = generate(p, CFG, PROMPTS[start : start + 3], key, SAMPLING, ids)
        assert [s.tokens for s in chunked[start : start + 3]] == g.tokens
        assert [s.logprobs for s in chunked[start : start + 3]] == g.logprobs


def test_generate_speaks_sglang_native_shapes(server, ckpt):
    _, url = server
    assert post(url, "/update_weights_from_disk", {"model_path": ckpt, "weight_version": "0"})[0] == 200
    key = prng.key(9)
    seeds = [request_seed(key, i) for i in range(3)]
    body = {"input_ids": PROMPTS[:3], "return_logprob": True,
            "sampling_params": [{"temperature": 1.0, "top_p": 0.95, "top_k": -1, "max_new_tokens": 6,
                                 "stop_token_ids": [2], "sampling_seed": s} for s in seeds]}
    code, reply = post(url, "/generate", body)
    assert code == 200 and isinstance(reply, list) and len(reply) == 3
    _, p0 = hf.load_hf(ckpt)
    ref = generate(p0, CFG, PROMPTS[:3], key, SAMPLING, ops_cfg=SERVER_OPS)
    for i, item in enumerate(reply):
        meta = item["meta_info"]
        assert item["output_ids"] == ref.tokens[i]
        assert [t for _, t, _ in meta["output_token_logprobs"]] == ref.tokens[i]
        assert [lp for lp, _, _ in meta["output_token_logprobs"]] == ref.logprobs[i]
        assert meta["finish_reason"]["type"] == ref.finish_reasons[i]
        if ref.finish_reasons[i] == "length":
            assert meta["finish_reason"]["length"] == 6
        else:
            assert meta["finish_reason"]["matched"] == 2
        assert meta["weight_version"] == "0" and meta["prompt_tokens"] == len(PROMPTS[i])


def test_http_engine_equals_embedded_and_follows_weight_updates(server):
    proc, url = server
    p1, p2 = params_for(1), params_for(2)
    remote = RemoteEngine(CFG, p1, 1, url=url, sync=tensor_sync(CFG), batch_size=3, max_inflight=4, recovery=FAST)
    local = EmbeddedEngine(CFG, p1, 1, batch_size=3, ops_cfg=SERVER_OPS)
    reqs = make_requests(PROMPTS, prng.key(5))
    assert remote.generate(reqs, SAMPLING) == local.generate(reqs, SAMPLING)

    async def from_a_coroutine():  # as an async custom generate function would call it
        return remote.generate(reqs, SAMPLING)

    assert asyncio.run(from_a_coroutine()) == local.generate(reqs, SAMPLING)

    remote.update_weights(7, p2)
    local.update_weights(7, p2)
    got = remote.generate(reqs, SAMPLING)
    assert got == local.generate(reqs, SAMPLING)
    assert {s.weight_version for s in got} == {7}
    assert remote.client.weight_version() == 7
    # The trainer's view: teacher-forced log-probs of the same tokens under the new weights.
    for r, s in zip(reqs, got, strict=True):
        toks = torch.tensor([r.input_ids + s.tokens])
        n = toks.shape[1]
        lp = model.sequence_logprobs(p2, CFG, toks, torch.arange(n)[None], torch.ones(1, n, dtype=torch.int64),
                                     SAMPLING.logprob_temperature)[0, len(r.input_ids) - 1 :]
        torch.testing.assert_close(lp, torch.tensor(s.logprobs), rtol=0, atol=2e-5)
    remote.close()


def test_killed_owned_server_is_restarted_given_weights_and_requests_reissued(ckpt, tmp_path):
    p1 = params_for(1)
    proc = server_process(ckpt, str(tmp_path / "server.log"))
    remote = RemoteEngine(CFG, params_for(0), 0, process=proc, sync=tensor_sync(CFG), batch_size=2,
                          max_inflight=3, recovery=FAST)
    try:
        remote.update_weights(3, p1)
        proc.proc.kill()
        proc.proc.wait()
        reqs = make_requests(PROMPTS, prng.key(6))
        got = remote.generate(reqs, SAMPLING)
        assert remote.recoveries == 1 and proc.starts == 2
        assert got == EmbeddedEngine(CFG, p1, 3, batch_size=2, ops_cfg=SERVER_OPS).generate(reqs, SAMPLING)
    finally:
        remote.close()
    assert proc.proc is None


def test_server_crashing_mid_batch_gives_complete_batch(ckpt, tmp_path):
    """The server dies on its 3rd call with others in flight; only unanswered chunks are re-issued."""
    proc = server_process(ckpt, str(tmp_path / "server.log"), ("--debug-exit-after", "3"))
    _, p0 = hf.load_hf(ckpt)
    remote = RemoteEngine(CFG, p0, 0, process=proc, sync=tensor_sync(CFG), batch_size=2, max_inflight=2,
                          recovery=FAST)
    try:
        reqs = make_requests(PROMPTS, prng.key(8))
        local = EmbeddedEngine(CFG, p0, 0, batch_size=2, ops_cfg=SERVER_OPS)
        assert remote.generate(reqs, SAMPLING) == local.generate(reqs, SAMPLING)
        assert remote.recoveries == 1
    finally:
        remote.close()


def test_unowned_server_that_dies_gives_a_clear_error_after_bounded_retries(ckpt, tmp_path):
    proc = server_process(ckpt, str(tmp_path / "server.log"))
    url = proc.start()
    remote = RemoteEngine(CFG, params_for(1), 1, url=url, sync=tensor_sync(CFG), recovery=FAST)
    proc.stop()
    with pytest.raises(EngineError, match=f"{url} did not come back after 2 attempts"):
        remote.generate(make_requests(PROMPTS[:2], prng.key(1)), SAMPLING)
    remote.close()


def test_nothing_listening_is_named():
    from launch.engines.remote import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineError, match=f"rollout server {url} does not answer"):
        RemoteEngine(CFG, params_for(1), 1, url=url, sync=tensor_sync(CFG), recovery=FAST)


def test_server_that_cannot_start_names_its_log(tmp_path):
    proc = server_process(str(tmp_path / "no_such_model"), str(tmp_path / "server.log"))
    with pytest.raises(EngineError, match="exited with code 1 while starting"):
        RemoteEngine(CFG, params_for(1), 1, process=proc, sync=tensor_sync(CFG), recovery=FAST)
    assert "no_such_model" in (tmp_path / "server.log").read_text()


def test_bad_requests_are_refused_naming_the_field_and_pickle_is_never_read(server):
    _, url = server
    named = hf.named_tensors(CFG, params_for(1))
    cases = [
        ("/update_weights_from_tensor", {"serialized_named_tensors": [encode_tensors(named)], "load_format": None,
                                         "weight_version": "1"}, "load_format"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["gARdlC4="], "load_format": TENSOR_FORMAT,
                                         "weight_version": "1"}, "not base64 safetensors"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": [encode_tensors({"bogus.weight": torch.ones(2)})],
                                         "load_format": TENSOR_FORMAT, "weight_version": "1"}, "bogus.weight"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": [encode_tensors(named)],
                                         "load_format": TENSOR_FORMAT, "weight_version": "x"}, "weight_version"),
        ("/generate", {"sampling_params": {}}, "input_ids"),
        ("/generate", {"input_ids": [[1], [1]], "sampling_params": [{"temperature": 1.0}, {"temperature": 0.5}]},
         "share every parameter"),
        ("/generate", {"input_ids": [[1] * 60], "sampling_params": {"max_new_tokens": 10}},
         "max_position_embeddings"),
        ("/update_weights_from_disk", {"model_path": "/no/such/dir", "weight_version": "1"}, "/no/such/dir"),
    ]
    before = post(url, "/get_model_info", {})[1]["weight_version"]
    for path, body, needle in cases:
        code, reply = post(url, path, body)
        assert code == 400 and needle in reply["message"], (path, reply)
    code, reply = post(url, "/get_model_info", {})
    assert code == 200 and reply["weight_version"] == before  # nothing above changed the weights


def test_update_from_disk_pause_and_flush(server, tmp_path):
    _, url = server
    p2 = params_for(2)
    hf.save_hf(str(tmp_path / "v2"), CFG, p2)
    assert post(url, "/update_weights_from_disk", {"model_path": str(tmp_path / "v2"), "weight_version": "2"})[0] == 200
    assert post(url, "/flush_cache", {})[0] == 200
    assert post(url, "/pause_generation", {"mode": "in_place"})[0] == 200
    assert post(url, "/continue_generation", {})[0] == 200
    req = [Request(0, PROMPTS[0], 77)]
    code, reply = post(url, "/generate", {"input_ids": [PROMPTS[0]], "sampling_params": [
        {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 6, "stop_token_ids": [2], "sampling_seed": 77}]})
    assert code == 200
    assert parse_generate_reply(reply, 1, url) == EmbeddedEngine(CFG, p2, 2, ops_cfg=SERVER_OPS).generate(req, SAMPLING)


def test_malformed_replies_are_engine_errors():
    with pytest.raises(EngineError, match="2 outputs for 3 requests"):
        parse_generate_reply([{}, {}], 3, "u")
    with pytest.raises(EngineError, match="output 0 is malformed"):
        parse_generate_reply([{"meta_info": {}}], 1, "u")
    bad = {"output_ids": [4], "meta_info": {"output_token_logprobs": [[-0.1, 5, None]],
                                            "finish_reason": {"type": "length"}, "weight_version": "1"}}
    with pytest.raises(EngineError, match="output_ids disagree"):
        parse_generate_reply([bad], 1, "u")
    aborted = {"meta_info": {"output_token_logprobs": [], "finish_reason": {"type": "abort"}, "weight_version": "1"}}
    with pytest.raises(EngineError, match="abort"):
        parse_generate_reply([aborted], 1, "u")
