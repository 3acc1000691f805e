"""bench/fleet_load.py in its seconds-long --quick mode: nothing lost or answered twice, undisturbed and with an
engine killed mid-run (timings are printed, never asserted)."""

import json

import pytest

from bench import fleet_load

pytest.importorskip("sglang_router")


def test_percentile_is_the_nearest_rank():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]  # sorted: 1 2 3 4 5
    assert fleet_load.percentile(xs, 0.5) == 3.0 and fleet_load.percentile(xs, 0.99) == 5.0
    assert fleet_load.percentile(xs, 0.0) == 1.0 and fleet_load.percentile([7.0], 0.99) == 7.0


def test_fleet_load_quick_loses_nothing_with_an_engine_killed(tmp_path):
    out = fleet_load.main(["--quick", "--engines=2", "--clients=3", "--seconds=2", f"--out={tmp_path / 'f.json'}"])
    saved = json.loads((tmp_path / "f.json").read_text())
    assert [r["scenario"] for r in saved["results"]] == ["undisturbed", "one_engine_killed",
                                                         "killed_no_router_retries"]
    for r in saved["results"]:
        assert r["requests"] > 10 and r["answered"] == r["requests"], r
        assert r["lost"] == r["answered_twice"] == r["wrong_id"] == r["mismatched"] == 0, r
        assert r["checked_against_a_direct_call"] > 0 and r["survivors_healthy"], r
        assert sum(r["served_by"].values()) == r["requests"]
    calm, hit, bare = saved["results"]
    assert not calm["killed"] and len(calm["served_by"]) == 2
    for r in (hit, bare):
        assert r["killed"] and r["served_by"].get(r["killed"], 0) < max(r["served_by"].values())
    # Without the router's retries the calls the dead engine dropped fail at the client, which re-issues them,
    # and each re-issued one was checked against a direct call (its tokens are its seed's).
    assert bare["reissued_requests"] >= 1 and bare["checked_against_a_direct_call"] >= bare["reissued_requests"]
    assert "| one_engine_killed |" in out["table"]
