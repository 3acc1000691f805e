"""Speculative decoding in the rollout server (--rollout_backend=http): plain decoding's samples, per-request
acceptance in meta_info, a versioned draft sync that never touches the target, and the loop's metrics and state
exactly those of the embedded engine, across a server crash."""

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

import ops
from launch import rollout_server
from launch.engines import sglang_api
from launch.engines.base import EngineError, Sample, SpecDraft, SpecInfo, make_requests
from launch.engines.remote import check_spec
from miles_fn import model, prng
from miles_fn.config import ModelConfig
from miles_fn.sampling import SamplingConfig
from state import hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = ModelConfig(vocab_size=24, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2)
DCFG = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
PROMPTS = [[1 + (i * 7) % 20, 2 + (i * 3) % 19, 3 + i % 17][: 1 + i % 3] for i in range(6)]


def _body(sampling: SamplingConfig, seed: int = 0) -> dict:
    return sglang_api.generate_body(make_requests(PROMPTS, prng.key(seed)), sampling)


def _server(draft: SpecDraft | None, ops_cfg: ops.OpsConfig = ops.REFERENCE, params=None):
    state = rollout_server.RolloutState(CFG, params or model.init_params(CFG, prng.key(0), 0.3), 4, ops_cfg=ops_cfg)
    state.draft = draft
    return state


def _pairs(reply):
    return [[(p[1], p[0]) for p in item["meta_info"]["output_token_logprobs"]] for item in reply]


@pytest.mark.parametrize("ops_cfg,disable", [(ops.INVARIANT, 0), (ops.REFERENCE, 0), (ops.INVARIANT, 2)],
                         ids=["invariant", "reference", "disable_by_batch_size"])
def test_a_speculating_server_returns_plain_decodings_samples(ops_cfg, disable):
    """With --speculative-disable-by-batch-size 2 the rounds with 3 or 4 live rows are plain steps, counted in
    meta_info.spec_plain_ct; the samples are plain decoding's all the same."""
    sampling = SamplingConfig(temperature=0.8, max_new_tokens=9, stop_token_ids=(5,))
    draft = SpecDraft(DCFG, model.init_params(DCFG, prng.key(1), 0.3), 4, 3, disable)
    plain = _server(None, ops_cfg).generate(_body(sampling))
    spec = _server(draft, ops_cfg).generate(_body(sampling))
    if ops_cfg.invariant:
        assert _pairs(spec) == _pairs(plain)  # tokens and log-probs, bit for bit
    else:
        for s, p in zip(_pairs(spec), _pairs(plain), strict=True):
            assert [t for t, _ in s] == [t for t, _ in p]
            assert max(abs(a - b) for (_, a), (_, b) in zip(s, p, strict=True)) < 1e-5
    for item in spec:
        meta = item["meta_info"]
        hist = meta["spec_accept_histogram"]
        assert len(hist) == 4 and meta["spec_verify_ct"] == sum(hist) and meta["draft_weight_version"] == "4"
        n, p = meta["completion_tokens"], meta["spec_plain_ct"]
        assert sum(hist) + p <= n - 1 <= 4 * sum(hist) + p  # a verify emits 1..k+1 tokens, a plain step 1
    assert all("spec_accept_histogram" not in item["meta_info"] for item in plain)
    plain_steps = sum(item["meta_info"]["spec_plain_ct"] for item in spec)
    assert (plain_steps > 0) is (disable > 0)  # 6 requests in chunks of 4: the first rounds have 4 live rows


def test_a_draft_equal_to_the_target_is_always_accepted_greedy():
    """Hand-computed: greedy sampling and a draft with the target's weights accept all k drafts every verify, so
    N new tokens take ceil((N - 1) / (k + 1)) verifies after the prefill's first token."""
    target = model.init_params(CFG, prng.key(0), 0.3)
    for k, n_new in ((3, 9), (2, 8), (4, 5)):
        state = _server(SpecDraft(CFG, target, 0, k), params=target)
        for item in state.generate(_body(SamplingConfig(temperature=0.0, max_new_tokens=n_new))):
            verifies = -(-(n_new - 1) // (k + 1))
            assert item["meta_info"]["completion_tokens"] == n_new
            assert item["meta_info"]["spec_accept_histogram"] == [0] * k + [verifies], (k, n_new)


def test_draft_updates_are_versioned_and_never_touch_the_target():
    draft0, draft1 = (model.init_params(DCFG, prng.key(s), 0.3) for s in (1, 2))
    state = _server(SpecDraft(DCFG, draft0, 4, 2))
    sampling = SamplingConfig(temperature=0.8, max_new_tokens=7)
    before = state.generate(_body(sampling))
    target = state.params
    body = sglang_api.tensor_update_body(hf.named_tensors(DCFG, draft1), 9, draft_only=True)
    assert state.update_from_tensors(body)["success"]
    assert state.params is target and state.version == 4
    assert state.model_info()["draft_weight_version"] == "9" and state.model_info()["speculative_num_steps"] == 2
    assert torch.equal(state.draft.params["embed"], draft1["embed"])
    after = state.generate(_body(sampling))
    assert [i["output_ids"] for i in after] == [i["output_ids"] for i in before]  # a draft never changes samples
    assert {i["meta_info"]["draft_weight_version"] for i in after} == {"9"}
    assert {i["meta_info"]["weight_version"] for i in after} == {"4"}
    with pytest.raises(ValueError, match="mutually exclusive"):
        state.update_from_tensors({**body, "disable_draft_model": True})
    with pytest.raises(ValueError, match="names the model does not have"):  # the target's tensors are not the draft's
        state.update_from_tensors(sglang_api.tensor_update_body(hf.named_tensors(CFG, target), 10, draft_only=True))
    with pytest.raises(ValueError, match="draft_only: true or false"):
        state.update_from_tensors({**body, "draft_only": "yes"})
    with pytest.raises(ValueError, match="this server has no draft"):
        _server(None).update_from_tensors(body)
    with pytest.raises(ValueError, match="return_routed_experts"):
        state.generate({**_body(sampling), "return_routed_experts": True})


def test_server_flags_are_checked_by_name(tmp_path):
    hf.save_hf(str(tmp_path / "d"), DCFG, model.init_params(DCFG, prng.key(1)))
    wide = dataclasses.replace(DCFG, vocab_size=30)
    hf.save_hf(str(tmp_path / "w"), wide, model.init_params(wide, prng.key(1)))

    def load(**kw):
        args = argparse.Namespace(**{"speculative_algorithm": "", "speculative_draft_model_path": "",
                                     "speculative_num_steps": 3, "speculative_disable_by_batch_size": 0, **kw})
        return rollout_server.load_draft(args, CFG, 7)

    assert load() is None
    d = load(speculative_algorithm="STANDALONE", speculative_draft_model_path=str(tmp_path / "d"))
    assert d.version == 7 and d.num_steps == 3 and d.cfg.hidden_size == 32
    for kw, msg in (({"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(tmp_path / "d")},
                     "--speculative-algorithm=EAGLE3"),
                    ({"speculative_algorithm": "STANDALONE"}, "needs --speculative-draft-model-path"),
                    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(tmp_path / "d"),
                      "speculative_disable_by_batch_size": -1}, "--speculative-disable-by-batch-size must be >= 0"),
                    ({"speculative_draft_model_path": str(tmp_path / "d")}, "needs --speculative-algorithm"),
                    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(tmp_path / "none")},
                     "--speculative-draft-model-path="),
                    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(tmp_path / "w")},
                     "vocab_size 30 differs")):
        with pytest.raises(ValueError, match=msg):
            load(**kw)


def test_the_client_refuses_a_stale_draft_or_a_malformed_count():
    draft = SpecDraft(DCFG, None, 5, 2)
    ok = Sample([1, 2, 3], [0.0] * 3, "length", 1, spec=SpecInfo((0, 1, 0), 5))
    check_spec([ok], draft, "server X")
    for bad, msg in ((ok._replace(spec=None), "without speculation counts"),
                     (ok._replace(spec=SpecInfo((0, 1, 0), 4)), "draft version 4 .* expected version 5"),
                     (ok._replace(spec=SpecInfo((1, 1), 5)), "k = 1, expected .* k = 2")):
        with pytest.raises(EngineError, match=msg):
            check_spec([bad], draft, "server X")
    reply = sglang_api.generate_reply([ok], [2])
    assert sglang_api.parse_generate_reply(reply, 1, "X")[0].spec == ok.spec
    for field, value, msg in (("spec_accept_histogram", [0, 9, 0], "9 verifies .* cannot emit 2 tokens"),
                              ("spec_plain_ct", 3, "3 plain steps cannot emit 2 tokens"),
                              ("spec_plain_ct", -1, "spec_plain_ct: -1 is outside"),
                              ("spec_accept_histogram", [1], "a list of k\\+1 >= 2"),
                              ("spec_accept_histogram", [0, "1", 0], "an integer is required"),
                              ("draft_weight_version", None, "draft_weight_version")):
        broken = json.loads(json.dumps(reply))
        broken[0]["meta_info"][field] = value
        with pytest.raises(EngineError, match=msg):
            sglang_api.parse_generate_reply(broken, 1, "X")


def test_a_given_server_must_speculate_as_the_run_does():
    """--rollout_url: /get_model_info must report STANDALONE, the run's k and its plain-step threshold; each
    mismatch is refused with the flag that fixes it. The info dict is what RolloutServer.model_info returns."""
    from launch.engines import check_server_draft

    draft = SpecDraft(DCFG, None, 0, 3, 2)
    good = {"speculative_algorithm": "STANDALONE", "speculative_num_steps": 3, "speculative_disable_by_batch_size": 2}
    check_server_draft(good, draft, "http://x")
    check_server_draft({}, None, "http://x")  # no draft: anything goes
    for field, value, msg in (("speculative_algorithm", None, "--speculative-num-steps 3"),
                              ("speculative_num_steps", 2, "speculative_num_steps=2"),
                              ("speculative_disable_by_batch_size", 0, "--speculative-disable-by-batch-size 2")):
        with pytest.raises(EngineError, match=msg):
            check_server_draft({**good, field: value}, draft, "http://x")


def _main(out, *args):
    flags = ["--sft_warmup_steps=2", "--eval_every=2", "--eval_size=8", "--prompts_per_step=4", "--group_size=2",
             "--hidden_size=32", "--intermediate_size=48", "--kl_coef=0.5", "--num_threads=1", "--noprogress",
             "--notensorboard", "--speculative_algorithm=STANDALONE", "--speculative_num_steps=2",
             "--draft_hidden_size=32", "--draft_train_steps=2", "--num_steps=3", "--rollout_batch_size=4",
             "--true_on_policy", f"--output_dir={out}", *args]
    p = subprocess.run([sys.executable, "-m", "launch.main", *flags], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.split("state_hash=")[1].split()[0], p.stderr


def test_the_loop_on_a_speculating_server_equals_the_embedded_engine_across_a_crash(tmp_path):
    """The run's metrics.jsonl (acceptance included) and final state equal the embedded engine's byte for byte,
    although the server died in step 2's rollout: the restarted server got the current draft, not its start one
    (a stale draft would fail the draft-version check)."""
    embedded, _ = _main(tmp_path / "e")
    http, err = _main(tmp_path / "h", "--rollout_backend=http", "--debug_rollout_server_fault=crash_once:7")
    assert "recovered" in err, err[-2000:]
    assert http == embedded
    rows = (tmp_path / "h" / "metrics.jsonl").read_bytes()
    assert rows == (tmp_path / "e" / "metrics.jsonl").read_bytes()
    first = json.loads(rows.splitlines()[0])
    assert first["spec_accept_length"] >= 1.0 and "spec_accept_pos_2" in first and first["mismatch_max"] == 0.0
    log = (tmp_path / "h" / "rollout_server.log").read_text()
    assert "--speculative-algorithm STANDALONE" in log and "--speculative-num-steps 2" in log


def test_a_speculating_fleet_behind_the_router_equals_the_embedded_engine_across_a_crash(tmp_path):
    """Two servers behind sglang-router, one request a call: each server gets every draft update directly, and
    the one restarted after its crash in step 2's evaluation gets the current draft (else the version check fails)."""
    one = "--rollout_batch_size=1"
    embedded, _ = _main(tmp_path / "e", one)
    fleet, err = _main(tmp_path / "f", one, "--rollout_backend=http", "--rollout_num_engines=2",
                       "--debug_rollout_server_fault=crash_once:18")
    assert "restarted" in err, err[-2000:]
    assert fleet == embedded
    assert (tmp_path / "f" / "metrics.jsonl").read_bytes() == (tmp_path / "e" / "metrics.jsonl").read_bytes()
