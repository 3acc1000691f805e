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
