"""The main job over real HTTP: same results as in-process, resumes in place after a crash, stops cleanly."""

import json
import os
import subprocess
import sys

import pytest

from launch.engines.remote import ServerProcess
from miles_fn.config import ModelConfig
from miles_fn.tasks.addition import AdditionTask
from state import hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Per call to the engine, 3 requests. /generate calls: evals at init and after SFT (2 each), step 1 (3),
# step 2 (3), final eval (2): call 6 is inside step 1's batch, call 9 inside step 2's.
ARGS = ["--num_steps=2", "--sft_warmup_steps=1", "--eval_every=0", "--eval_size=4", "--prompts_per_step=4",
        "--group_size=2", "--save_every=1", "--hidden_size=32", "--intermediate_size=48", "--noprogress",
        "--notensorboard", "--num_threads=1", "--rollout_batch_size=3", "--rollout_backoff_s=0.1"]


def run_main(out, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.main", *ARGS, f"--output_dir={out}", *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=400)


def summary(p: subprocess.CompletedProcess) -> dict[str, str]:
    assert p.returncode == 0, p.stderr[-3000:]
    return dict(kv.split("=", 1) for kv in p.stdout.strip().splitlines()[-1].split())


def metrics(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]


def start_server(tmp_path, *extra: str) -> tuple[ServerProcess, str]:
    """A launch.rollout_server on a tiny random checkpoint (the run pushes its own weights before use)."""
    from miles_fn import model, prng

    task = AdditionTask(digits=2)
    cfg = ModelConfig(vocab_size=task.tokenizer.vocab_size, hidden_size=32, intermediate_size=48,
                      max_position_embeddings=64)
    hf.save_hf(str(tmp_path / "init"), cfg, model.init_params(cfg, prng.key(99), 0.02))

    def command(port: int, first: bool) -> list[str]:
        return [sys.executable, "-m", "launch.rollout_server", "--model-path", str(tmp_path / "init"),
                "--port", str(port), "--num-threads", "1", "--watch-parent", *extra]

    server = ServerProcess(command, str(tmp_path / "server.log"), 120, cwd=ROOT)
    return server, server.start()


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    out = tmp_path_factory.mktemp("embedded")
    return summary(run_main(out)), metrics(out), (out / "metrics.jsonl").read_bytes()


def test_http_backend_against_a_server_the_test_started_matches_in_process(embedded, tmp_path):
    server, url = start_server(tmp_path)
    try:
        p = run_main(tmp_path / "run", "--rollout_backend=http", f"--rollout_url={url}")
    finally:
        server.stop()
    s, (ref_summary, ref_metrics) = summary(p), embedded[:2]
    assert s["state_hash"] == ref_summary["state_hash"]
    assert s["eval_success_final"] == ref_summary["eval_success_final"]
    assert metrics(tmp_path / "run") == ref_metrics
    assert [r["weight_version"] for r in ref_metrics] == [1, 2]  # step k samples come from weights after k-1 updates
    # The trainer's log-probs of the served tokens, before the step's update, match the server's.
    assert all(0 <= r["mismatch_mean"] < 1e-4 for r in metrics(tmp_path / "run"))


def test_true_on_policy_over_http_gives_the_trainers_log_probs_bit_for_bit(tmp_path):
    # The run starts its server with the trainer's invariant kernels: the mismatch is exactly zero.
    p = run_main(tmp_path / "owned", "--rollout_backend=http", "--true_on_policy")
    summary(p)
    rows = metrics(tmp_path / "owned")
    assert rows and all(r["mismatch_mean"] == 0.0 and r["mismatch_max"] == 0.0 for r in rows), rows
    # A server started without them is refused by name, before anything is trained.
    server, url = start_server(tmp_path)
    try:
        p = run_main(tmp_path / "plain", "--rollout_backend=http", f"--rollout_url={url}", "--true_on_policy")
    finally:
        server.stop()
    assert p.returncode != 0 and f"--rollout_url={url}" in p.stderr and "--enable-deterministic-inference" in p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "plain" / "metrics.jsonl").exists()


def test_server_killed_mid_batch_is_restarted_and_the_run_resumes_in_place(embedded, tmp_path):
    p = run_main(tmp_path, "--rollout_backend=http", "--debug_rollout_server_fault=crash_once:6")
    s = summary(p)
    assert "recovered at http://127.0.0.1:" in p.stderr
    assert s["state_hash"] == embedded[0]["state_hash"]
    assert metrics(tmp_path) == embedded[1]
    assert (tmp_path / "rollout_server.log").read_text().count("--- start") == 2


def test_server_that_cannot_come_back_stops_the_run_with_a_clear_error_and_trains_nothing_partial(embedded,
                                                                                                   tmp_path):
    p = run_main(tmp_path, "--rollout_backend=http", "--debug_rollout_server_fault=crash_permanent:9",
                 "--rollout_max_restarts=2")
    assert p.returncode != 0
    assert "did not come back after 2 attempts" in p.stderr and "rollout_server.log" in p.stderr
    assert "Traceback" not in p.stderr
    # Step 1 completed and was checkpointed (after the end-of-SFT one); step 2's batch was cut short,
    # so step 2 never trained.
    assert metrics(tmp_path) == embedded[1][:1]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_00000001", "step_00000002"]


def test_distributed_weight_sync_over_a_gloo_group_matches_in_process(embedded, tmp_path):
    """The trainer hosts a torch.distributed group on 127.0.0.1 and broadcasts every update into it."""
    p = run_main(tmp_path, "--rollout_backend=http", "--rollout_weight_sync=distributed")
    s, (ref_summary, _, ref_bytes) = summary(p), embedded
    assert s["state_hash"] == ref_summary["state_hash"]
    assert (tmp_path / "metrics.jsonl").read_bytes() == ref_bytes
    assert all(0 <= r["mismatch_mean"] < 1e-4 for r in metrics(tmp_path))


def test_weight_group_that_cannot_form_stops_the_run_naming_the_flags(tmp_path):
    p = run_main(tmp_path, "--rollout_backend=http", "--rollout_weight_sync=distributed", "--rollout_timeout_s=2",
                 "--rollout_max_restarts=1", "--debug_rollout_server_fault=group_unreachable")
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "--rollout_weight_sync=distributed" in p.stderr and "--rollout_weight_group_host=127.0.0.1" in p.stderr
    assert "did not come back after 1 attempts" in p.stderr and "rollout_server.log" in p.stderr


def test_sglang_backend_drives_an_sglang_compatible_server_through_disk_sync(tmp_path):
    """The SGLang backend's client (disk weight sync, 63-bit seeds) against launch.rollout_server."""
    server, url = start_server(tmp_path)
    try:
        p = run_main(tmp_path / "run", "--rollout_backend=sglang", f"--sglang_url={url}")
    finally:
        server.stop()
    summary(p)
    assert [r["weight_version"] for r in metrics(tmp_path / "run")] == [1, 2]
    assert sorted(os.listdir(tmp_path / "run" / "rollout_weights")) == ["v00000003"]  # older versions removed


def test_sglang_backend_with_distributed_sync_joins_the_servers_group(tmp_path):
    """The SGLang backend's group path (world 1 + tp_size, SGLang's request fields) against launch.rollout_server."""
    server, url = start_server(tmp_path)
    try:
        p = run_main(tmp_path / "run", "--rollout_backend=sglang", f"--sglang_url={url}",
                     "--rollout_weight_sync=distributed")
    finally:
        server.stop()
    summary(p)
    rows = metrics(tmp_path / "run")
    assert [r["weight_version"] for r in rows] == [1, 2]
    assert all(0 <= r["mismatch_mean"] < 1e-4 for r in rows)  # the served weights are the trainer's
    assert not (tmp_path / "run" / "rollout_weights").exists()  # nothing went through disk


def test_sglang_backend_without_sglang_or_url_says_what_to_install(tmp_path):
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    p = run_main(tmp_path, "--rollout_backend=sglang")
    assert p.returncode != 0 and "needs the package 'sglang'" in p.stderr and "Traceback" not in p.stderr
