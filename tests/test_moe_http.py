"""R3 over HTTP: the rollout server returns a MoE model's routed experts as SGLang does, and the http backend
feeds them to --routing_replay.

References: the routes the in-process generate records for the same requests (the wire is checked by
decoding the raw JSON with numpy, as Miles decodes SGLang's reply, not with the code under test), and an
embedded-engine run of the same job, which the http run must equal bit for bit.
"""

import base64
import json
import os
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
import torch

from launch.engines.base import EngineError, make_requests, request_seed
from launch.engines.embedded import EmbeddedEngine
from launch.engines.remote import RemoteEngine, ServerProcess, tensor_sync
from launch.engines.sglang_api import parse_generate_reply
from launch.rollout_server import RolloutState, server_ops
from miles_fn import model, prng
from miles_fn.config import ModelConfig
from miles_fn.generate import generate
from miles_fn.sampling import SamplingConfig
from state import hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=16, model_type="qwen3_moe", attention_bias=False, max_position_embeddings=64,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=(1,))
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=6, stop_token_ids=(2,))
PROMPTS = [[1, 5, 9], [7, 3], [4, 8, 6, 11], [12]]
SERVER_OPS = server_ops(False, 0, 0)  # what a server started without kernel flags runs


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "moe")
    params = model.init_params(CFG, prng.key(3), 0.3)
    hf.save_hf(path, CFG, params)

    def command(port: int, first: bool) -> list[str]:
        return [sys.executable, "-m", "launch.rollout_server", "--model-path", path, "--port", str(port),
                "--num-threads", "1", "--watch-parent"]

    proc = ServerProcess(command, str(tmp_path_factory.mktemp("log") / "server.log"), 60, cwd=ROOT)
    url = proc.start()
    yield url, params
    proc.stop()


def _post(url: str, body: dict) -> list:
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_server_returns_sglang_routed_experts_equal_to_the_engines_record(server):
    url, params = server
    key = prng.key(11)
    sp = {"temperature": 1.0, "max_new_tokens": 6, "stop_token_ids": [2]}
    body = {"input_ids": PROMPTS, "sampling_params": [{**sp, "sampling_seed": request_seed(key, i)}
                                                      for i in range(len(PROMPTS))]}
    plain = _post(url, body)
    assert all("routed_experts" not in item["meta_info"] for item in plain)  # only when asked, as in SGLang
    reply = _post(url, {**body, "return_routed_experts": True})
    ref = generate(params, CFG, PROMPTS, key, SAMPLING, ops_cfg=SERVER_OPS)
    for i, item in enumerate(reply):
        assert item["output_ids"] == ref.tokens[i]
        n = len(PROMPTS[i]) + len(ref.tokens[i]) - 1
        wire = np.frombuffer(base64.b64decode(item["meta_info"]["routed_experts"]), dtype="<i4").reshape(n, 3, 2)
        assert (wire[:, 1] == -1).all()  # the dense layer (mlp_only_layers) ran no expert
        assert np.array_equal(wire[:, [0, 2]], ref.routed_experts[i].numpy())
        assert wire[:, [0, 2]].min() >= 0 and wire.max() < 8


def test_http_engine_gives_the_embedded_engines_routes_after_a_weight_update(server):
    """The update carries every expert (they are not in the checkpoint's names as such: one tensor per expert)."""
    url, _ = server
    params = model.init_params(CFG, prng.key(4), 0.3)  # not the server's checkpoint: pushed by the sync
    remote = RemoteEngine(CFG, params, 0, url=url, sync=tensor_sync(CFG), batch_size=2)
    try:
        reqs = make_requests(PROMPTS, prng.key(5))
        got = remote.generate(reqs, SAMPLING)
    finally:
        remote.close()
    ref = EmbeddedEngine(CFG, params, 0, batch_size=2, ops_cfg=SERVER_OPS).generate(reqs, SAMPLING)
    assert [s.tokens for s in got] == [s.tokens for s in ref]
    assert [s.logprobs for s in got] == [s.logprobs for s in ref]
    assert sum(len(s.tokens) for s in got) > 8
    for s, r in zip(got, ref, strict=True):
        assert s.routed_experts.dtype == torch.int32 and torch.equal(s.routed_experts, r.routed_experts)


def test_routes_on_a_dense_model_and_a_malformed_payload_are_refused():
    dense = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                        num_kv_heads=2, max_position_embeddings=64)
    state = RolloutState(dense, model.init_params(dense, prng.key(0), 0.3), 0)
    with pytest.raises(ValueError, match="return_routed_experts: this model has no MoE layers"):
        state.generate({"input_ids": [[1, 2]], "return_routed_experts": True})
    with pytest.raises(ValueError, match="return_routed_experts: true or false"):
        state.generate({"input_ids": [[1, 2]], "return_routed_experts": 1})
    item = {"output_ids": [5, 2], "meta_info": {"finish_reason": {"type": "stop"}, "prompt_tokens": 3,
                                                "output_token_logprobs": [[-1.0, 5, None], [-0.5, 2, None]],
                                                "weight_version": "0"}}
    short = base64.b64encode(np.zeros((3, 3, 2), dtype="<i4").tobytes()).decode()  # 4 tokens were run, not 3
    with pytest.raises(EngineError, match="routed_experts: 72 bytes, expected 4 tokens"):
        parse_generate_reply([{**item, "meta_info": {**item["meta_info"], "routed_experts": short}}], 1, "srv", CFG)
    bad = base64.b64encode(np.full((4, 3, 2), 8, dtype="<i4").tobytes()).decode()
    with pytest.raises(EngineError, match=r"outside \[0, 8\)"):
        parse_generate_reply([{**item, "meta_info": {**item["meta_info"], "routed_experts": bad}}], 1, "srv", CFG)


ARGS = ["--model_type=qwen3_moe", "--routing_replay", "--noshared_prefix", "--num_steps=2", "--sft_warmup_steps=1",
        "--eval_every=0", "--eval_size=4", "--prompts_per_step=4", "--group_size=2", "--save_every=0",
        "--hidden_size=32", "--intermediate_size=48", "--moe_intermediate_size=16", "--num_experts=4",
        "--noprogress", "--notensorboard", "--num_threads=1", "--rollout_batch_size=4"]


def _run(out, *extra: str) -> tuple[dict, list[dict]]:
    p = subprocess.run([sys.executable, "-m", "launch.main", *ARGS, f"--output_dir={out}", *extra], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return (dict(kv.split("=", 1) for kv in p.stdout.strip().splitlines()[-1].split()),
            [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows])


def test_routing_replay_over_http_equals_the_embedded_run(tmp_path):
    """--routing_replay refuses a buffer without routes, so the http run's finishing at all shows they came
    back over the wire; equal metrics and state hash show they are the embedded engine's."""
    ref_summary, ref_rows = _run(tmp_path / "embedded")
    got_summary, got_rows = _run(tmp_path / "http", "--rollout_backend=http")
    assert got_rows == ref_rows and len(got_rows) == 2
    assert all("route_mismatch" in r for r in got_rows)
    assert got_summary["state_hash"] == ref_summary["state_hash"]
