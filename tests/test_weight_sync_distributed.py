"""Weights over a real torch.distributed (gloo) group on 127.0.0.1: the trainer broadcasts, the rollout
server receives; the reference is the in-process engine with the same weights."""

import pytest
import torch

from launch.engines.base import EngineError, make_requests
from launch.engines.embedded import EmbeddedEngine
from launch.engines.remote import RemoteEngine
from launch.engines.weight_group import DistributedSync, dtype_name, parse_dtype
from miles_fn import model, prng
from tests.test_rollout_server import CFG, FAST, PROMPTS, SAMPLING, SERVER_OPS, ckpt, params_for, post, server_process  # noqa: F401


def test_distributed_sync_gives_the_server_the_trainers_weights(ckpt, tmp_path):  # noqa: F811
    proc = server_process(ckpt, str(tmp_path / "server.log"))
    url = proc.start()
    p1, p2 = params_for(1), params_for(2)
    sync = DistributedSync(CFG, timeout_s=30)
    remote = RemoteEngine(CFG, p1, 1, url=url, sync=sync, batch_size=3, recovery=FAST)
    try:
        assert post(url, "/get_model_info", {})[1]["weight_version"] == "1"
        reqs = make_requests(PROMPTS, prng.key(5))
        local = EmbeddedEngine(CFG, p1, 1, batch_size=3, ops_cfg=SERVER_OPS)
        assert remote.generate(reqs, SAMPLING) == local.generate(reqs, SAMPLING)

        remote.update_weights(2, p2)  # the same group carries the next version
        assert sync.groups_formed == 1
        assert post(url, "/get_model_info", {})[1]["weight_version"] == "2"
        got = remote.generate(reqs, SAMPLING)
        assert got == EmbeddedEngine(CFG, p2, 2, batch_size=3, ops_cfg=SERVER_OPS).generate(reqs, SAMPLING)
        # The trainer's view: teacher-forced log-probs of the served tokens under its own weights.
        for r, s in zip(reqs, got, strict=True):
            toks = torch.tensor([r.input_ids + s.tokens])
            n = toks.shape[1]
            lp = model.sequence_logprobs(p2, CFG, toks, torch.arange(n)[None], torch.ones(1, n, dtype=torch.int64),
                                         SAMPLING.logprob_temperature)[0, len(r.input_ids) - 1 :]
            torch.testing.assert_close(lp, torch.tensor(s.logprobs), rtol=0, atol=2e-5)
        name = sync.group_name
    finally:
        remote.close()
        proc.stop()
    assert sync.pg is None and name  # close left the group on both sides


def test_group_is_refused_for_unknown_groups_and_nccl_on_cpu(ckpt, tmp_path):  # noqa: F811
    proc = server_process(ckpt, str(tmp_path / "server.log"))
    url = proc.start()
    try:
        code, reply = post(url, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
            "group_name": "g", "backend": "nccl"})
        assert code == 400 and "nccl needs CUDA" in reply["message"]
        code, reply = post(url, "/update_weights_from_distributed", {
            "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[CFG.hidden_size]],
            "group_name": "nope", "weight_version": "3"})
        assert code == 400 and "no weight-update group 'nope'" in reply["message"]
        assert post(url, "/get_model_info", {})[1]["weight_version"] == "0"
    finally:
        proc.stop()


def test_server_dying_mid_broadcast_is_restarted_and_the_group_formed_again(ckpt, tmp_path):  # noqa: F811
    proc = server_process(ckpt, str(tmp_path / "server.log"), ("--debug-group-fault", "crash_in_update:1"))
    sync = DistributedSync(CFG, timeout_s=30)
    remote = RemoteEngine(CFG, params_for(0), 0, process=proc, sync=sync, batch_size=2, recovery=FAST)
    p1 = params_for(1)
    try:
        remote.update_weights(3, p1)  # the first server dies one tensor into the broadcast
        assert remote.recoveries == 1 and proc.starts == 2 and sync.groups_formed == 2
        assert remote.client.weight_version() == 3
        reqs = make_requests(PROMPTS, prng.key(6))
        local = EmbeddedEngine(CFG, p1, 3, batch_size=2, ops_cfg=SERVER_OPS)
        assert remote.generate(reqs, SAMPLING) == local.generate(reqs, SAMPLING)
    finally:
        remote.close()


def test_group_that_cannot_form_names_the_flag_and_server(ckpt, tmp_path):  # noqa: F811
    proc = server_process(ckpt, str(tmp_path / "server.log"), ("--debug-group-fault", "unreachable",
                                                                "--weight-group-timeout-s", "2"))
    url = proc.start()
    try:
        with pytest.raises(EngineError) as e:
            RemoteEngine(CFG, params_for(1), 1, url=url, sync=DistributedSync(CFG, timeout_s=2), recovery=FAST)
    finally:
        proc.stop()
    msg = str(e.value)
    assert f"rollout server {url}" in msg and "--rollout_weight_sync=distributed" in msg
    assert "did not form within --rollout_timeout_s=2" in msg and "--rollout_weight_group_host=127.0.0.1" in msg
    assert "server: " in msg and "trainer: " in msg  # both sides' reasons


def test_a_host_the_trainer_cannot_listen_on_is_named():
    sync = DistributedSync(CFG, host="192.0.2.1", timeout_s=2)  # TEST-NET-1: never an address of this machine

    class Client:
        url = "http://127.0.0.1:1"

    with pytest.raises(EngineError, match="--rollout_weight_group_host=192.0.2.1"):
        sync(Client(), 1, params_for(1))


def test_dtype_names_are_sglangs():
    assert dtype_name(torch.bfloat16) == "bfloat16" and dtype_name(torch.float32) == "float32"
    assert parse_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="'Size'"):
        parse_dtype("Size")
