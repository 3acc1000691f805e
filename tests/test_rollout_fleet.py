"""A fleet of rollout servers behind the real sglang-router, driven by launch.main: the same bits as one engine.

References are independent of the fleet: the embedded engine with the same --rollout_batch_size=1 (one
request per call is what a fleet sends), and its state hash and metrics.jsonl bytes.
"""

import json
import subprocess
import sys

import pytest

from tests.test_rollout_main import ROOT, metrics, run_main, summary

pytest.importorskip("sglang_router")

ONE = ["--rollout_batch_size=1"]
FLEET = [*ONE, "--rollout_backend=http", "--rollout_num_engines=3", "--rollout_max_restarts=2"]


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    out = tmp_path_factory.mktemp("embedded")
    return summary(run_main(out, *ONE)), (out / "metrics.jsonl").read_bytes()


def served(out) -> list[str]:
    return [u for line in (out / "rollout_fleet.jsonl").read_text().splitlines() for u in json.loads(line)["served_by"]]


def test_three_engines_behind_the_router_give_the_bits_of_one_engine(embedded, tmp_path):
    p = run_main(tmp_path, *FLEET)
    assert summary(p)["state_hash"] == embedded[0]["state_hash"]
    assert (tmp_path / "metrics.jsonl").read_bytes() == embedded[1]
    # Round robin spread the samples over all three servers, as their replies name them.
    who = served(tmp_path)
    assert len(set(who)) == 3 and len(who) == 28, who  # evals 4 + 4 + 4, two steps of 8
    assert [r["weight_version"] for r in metrics(tmp_path)] == [1, 2]


@pytest.mark.parametrize("fault, said", [
    ("crash_once:4", "restarted as http://127.0.0.1:"),  # server 0 dies on its 4th call, comes back synced
    ("crash_permanent:4", "2 left"),  # server 0 cannot come back: removed, the two others finish
    ("router_crash:3", "the router died; restarted at"),  # the router dies as a batch is sent
])
def test_failover_ends_with_the_undisturbed_results(embedded, tmp_path, fault, said):
    p = run_main(tmp_path, *FLEET, f"--debug_rollout_server_fault={fault}")
    assert summary(p)["state_hash"] == embedded[0]["state_hash"], p.stderr[-2000:]
    assert said in p.stderr
    assert (tmp_path / "metrics.jsonl").read_bytes() == embedded[1]


def test_a_fleet_with_no_server_left_stops_naming_every_server(tmp_path):
    p = run_main(tmp_path, *FLEET, "--debug_rollout_server_fault=fleet_down:3")
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "every rollout server of the fleet" in p.stderr
    for i in range(3):
        assert f"rollout_server_{i}.log" in p.stderr
    assert not (tmp_path / "metrics.jsonl").read_text()


def test_fleet_flags_are_checked_by_name(tmp_path):
    p = subprocess.run([sys.executable, "-m", "launch.main", "--rollout_backend=http", "--rollout_num_engines=2",
                        f"--output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "--rollout_batch_size=1" in p.stderr and "--rollout_num_engines" in p.stderr


def adopted_fleet(tmp_path, n: int, extra_first: tuple[str, ...] = ()):
    """n rollout servers and the real router over them, started by the test (as another machine's would be)."""
    from tests.openai_fixtures import router
    from tests.test_rollout_main import start_server

    procs = []
    try:
        for i in range(n):
            d = tmp_path / f"server{i}"
            d.mkdir()
            procs.append(start_server(d, *(extra_first if i == 0 else ()))[0])
        urls = [f"http://127.0.0.1:{p.proc.args[p.proc.args.index('--port') + 1]}" for p in procs]
        rproc, r = router(urls, str(tmp_path / "router.log"))
        procs.append(rproc)
        return procs, urls, r.url
    except BaseException:
        for p in procs:
            p.stop()
        raise


def test_a_run_adopts_an_existing_router_and_its_servers(embedded, tmp_path):
    procs, urls, router_url = adopted_fleet(tmp_path, 2)
    try:
        p = run_main(tmp_path / "run", *ONE, "--rollout_backend=http", f"--rollout_router_url={router_url}")
        assert summary(p)["state_hash"] == embedded[0]["state_hash"]
        assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == embedded[1]
        assert all(proc.alive() for proc in procs)  # the run leaves what it did not start running
        # Both adopted servers served, and carry the weights after the last step (versions 1, 2 sampled; 3 pushed).
        from launch.engines.sglang_client import SGLangClient

        assert [SGLangClient(u).weight_version() for u in urls] == [3, 3]
        assert "samples served per server" in p.stderr and all(u in p.stderr for u in urls)
    finally:
        for proc in procs:
            proc.stop()


def test_an_adopted_server_that_dies_is_dropped_and_the_run_ends_undisturbed(embedded, tmp_path):
    procs, urls, router_url = adopted_fleet(tmp_path, 2, ("--debug-exit-after", "5"))
    try:
        p = run_main(tmp_path / "run", *ONE, "--rollout_backend=http", f"--rollout_router_url={router_url}")
        assert summary(p)["state_hash"] == embedded[0]["state_hash"], p.stderr[-2000:]
        assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == embedded[1]
        assert f"server {urls[0]} removed" in p.stderr and "1 left" in p.stderr
    finally:
        for proc in procs:
            proc.stop()


def test_a_router_url_where_nothing_answers_is_named(tmp_path):
    from launch.engines.remote import free_port

    url = f"http://127.0.0.1:{free_port()}"
    p = run_main(tmp_path, *ONE, "--rollout_backend=http", f"--rollout_router_url={url}")
    assert p.returncode != 0 and f"--rollout_router_url={url} does not answer" in p.stderr
    assert "Traceback" not in p.stderr


def test_sglang_backend_fleets_are_refused_by_name(tmp_path):
    p = subprocess.run([sys.executable, "-m", "launch.main", "--rollout_backend=sglang", "--rollout_num_engines=2",
                        *ONE, f"--output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "--rollout_num_engines" in p.stderr and "--rollout_backend=http" in p.stderr
