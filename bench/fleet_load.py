"""A bounded load test of a rollout fleet: K clients for T seconds through the real sglang-router.

    python -m bench.fleet_load [--engines 3] [--clients 8] [--seconds 20] [--max_new_tokens 16] [--quick]

N launch.rollout_server processes on loopback behind `sglang_router.launch_router` (round robin). Each
client sends /generate calls of one request, each with its own rid and sampling_seed, back to back, for
T seconds; a call that fails (connection cut, 5xx) is re-issued by the client with the same rid and seed.
Three scenarios: undisturbed; one engine SIGKILLed at T/2; the same with the router's own retries off
(--disable-retries), so that the clients re-issue what the dead engine dropped. Checked, and reported:
  - every rid sent is answered exactly once, by a reply whose meta_info.id is that rid (none lost, none
    answered twice, none answered for another request);
  - a reply belongs to its seed: every re-issued request, and a sample of the others, is sent again straight
    to a live server and must give the same tokens;
  - every engine (the survivors, after a kill) answers /health and /health_generate afterwards, and the
    router lists them as healthy.
Throughput (requests/s, tokens/s) and latency (p50/p99 from first issue to answer, re-issues included)
go to a markdown table and bench/results/fleet_load.json.
"""

from __future__ import annotations

import collections
import os
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.common import machine_info, parse_args, print_table, write_json
from launch.engines.fleet import Router, router_command
from launch.engines.remote import ServerProcess
from launch.engines.sglang_client import ServerDown, SGLangClient
from miles_fn import model, prng
from miles_fn.config import ModelConfig
from state import hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS = 2
# (name, when server 0 is killed as a fraction of T, extra router flags): the router retries a call a dead
# worker dropped on another by itself; with --disable-retries the clients see the failures and re-issue.
SCENARIOS = (("undisturbed", None, ()), ("one_engine_killed", 0.5, ()),
             ("killed_no_router_retries", 0.5, ("--disable-retries",)))


def body(rid: str, seed: int, prompt: list[int], max_new: int) -> dict[str, Any]:
    """One request, shaped as sglang-router forwards it (one sampling_params object, rid a string)."""
    return {"input_ids": prompt, "rid": rid, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new, "sampling_seed": seed, "temperature": 1.0,
                                "stop_token_ids": [EOS]}}


def percentile(xs: list[float], q: float) -> float:
    """The q-quantile by the nearest rank of the sorted values (no interpolation)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(q * len(s) + 0.5) - 1))] if s else float("nan")


def answer_of(reply: Any) -> tuple[str, list[int], str]:
    item = reply[0] if isinstance(reply, list) else reply
    meta = item["meta_info"]
    return str(meta.get("id", "")), [int(p[1]) for p in meta["output_token_logprobs"]], str(meta.get("served_by", ""))


def scenario(name: str, router_url: str, servers: list[ServerProcess], urls: list[str], clients: int,
             seconds: float, max_new: int, kill_at: float | None, vocab: int) -> dict[str, Any]:
    """K clients for T seconds; with kill_at, server 0 is SIGKILLed that many seconds in."""
    deadline = time.monotonic() + seconds
    sent: list[tuple[str, int, list[int]]] = []  # (rid, seed, prompt), appended before the first issue
    answers: dict[str, list[tuple[list[int], str]]] = collections.defaultdict(list)
    wrong_id: list[tuple[str, str]] = []
    latencies: list[float] = []
    reissued: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    killed = ""

    def client(i: int) -> None:
        c = SGLangClient(router_url, timeout_s=60.0, max_inflight=1)
        rnd = random.Random(i)
        j = 0
        while time.monotonic() < deadline:
            rid, seed = f"{name}-c{i}-r{j}", (i << 40) | j
            prompt = [1, *[rnd.randrange(3, vocab) for _ in range(rnd.randrange(2, 8))]]
            j += 1
            with lock:
                sent.append((rid, seed, prompt))
            t0 = time.monotonic()
            for attempt in range(20):
                try:
                    got, tokens, who = answer_of(c.call("POST", "/generate", body(rid, seed, prompt, max_new)))
                    break
                except ServerDown:
                    with lock:
                        reissued[rid] += 1
                    time.sleep(min(0.05 * 2**attempt, 1.0))
            else:
                continue  # never answered: counted as lost below
            with lock:
                latencies.append(time.monotonic() - t0)
                answers[rid].append((tokens, who))
                if got != rid:
                    wrong_id.append((rid, got))
        c.close()

    def kill() -> None:
        nonlocal killed
        proc = servers[0].proc
        assert proc is not None
        proc.kill()
        proc.wait()
        killed = urls[0]

    timer = threading.Timer(kill_at, kill) if kill_at is not None else None
    t_start = time.monotonic()
    if timer:
        timer.start()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(client, range(clients)))
    wall = time.monotonic() - t_start
    if timer:
        timer.join()
    rids = [r for r, _, _ in sent]
    lost = [r for r in rids if not answers.get(r)]
    twice = [r for r, a in answers.items() if len(a) > 1]
    # A reply belongs to its seed: the re-issued requests and a sample of the rest, again, straight to a live server.
    live = [u for u, s in zip(urls, servers, strict=True) if s.alive()]
    check = [x for x in sent if x[0] in reissued and answers.get(x[0])]
    rest = [x for x in sent if x[0] not in reissued and answers.get(x[0])]
    check += random.Random(0).sample(rest, min(len(rest), 24))
    direct = SGLangClient(live[0], timeout_s=60.0, max_inflight=1)
    mismatched = [rid for rid, seed, prompt in check
                  if answer_of(direct.call("POST", "/generate", body(rid, seed, prompt, max_new)))[1]
                  != answers[rid][0][0]]
    direct.close()
    healthy = {u: SGLangClient(u, 10.0, 1).health() and SGLangClient(u, 30.0, 1).health_generate() for u in live}
    router = Router(router_url, 10.0)
    listed = {str(w["url"]).rstrip("/"): bool(w.get("is_healthy", True)) for w in router.workers()}
    router.client.close()
    served = collections.Counter(who for a in answers.values() for _, who in a)
    tokens = sum(len(t) for a in answers.values() for t, _ in a)
    return {
        "scenario": name, "clients": clients, "seconds": round(wall, 2), "killed": killed,
        "requests": len(rids), "answered": len(answers), "lost": len(lost), "answered_twice": len(twice),
        "wrong_id": len(wrong_id), "reissued_requests": len(reissued), "reissues": sum(reissued.values()),
        "checked_against_a_direct_call": len(check), "mismatched": len(mismatched),
        "requests_per_s": round(len(answers) / wall, 2), "tokens_per_s": round(tokens / wall, 1),
        "p50_ms": round(1000 * percentile(latencies, 0.50), 1), "p99_ms": round(1000 * percentile(latencies, 0.99), 1),
        "served_by": dict(sorted(served.items())), "survivors_healthy": all(healthy.values()) and bool(healthy),
        "router_lists_healthy": {u: listed.get(u) for u in urls},
    }


def start(n: int, workdir: str, cfg: ModelConfig, threads: int, router_extra: tuple[str, ...] = ()
          ) -> tuple[list[ServerProcess], list[str], ServerProcess, str]:
    ckpt = os.path.join(workdir, "ckpt")
    hf.save_hf(ckpt, cfg, model.init_params(cfg, prng.key(0), 0.3))

    def command(port: int, first: bool) -> list[str]:
        return [sys.executable, "-m", "launch.rollout_server", "--model-path", ckpt, "--port", str(port),
                "--num-threads", str(threads), "--watch-parent"]

    servers = [ServerProcess(command, os.path.join(workdir, f"server_{i}.log"), 120, cwd=ROOT) for i in range(n)]
    with ThreadPoolExecutor(max_workers=n) as pool:
        urls = list(pool.map(lambda s: s.start(), servers))
    rproc = ServerProcess(lambda port, first: [*router_command(port, urls, "round_robin"), *router_extra],
                          os.path.join(workdir, "router.log"), 60, cwd=ROOT)
    router_url = rproc.start()
    Router(router_url, 10.0).wait_for(urls, 60)
    return servers, urls, rproc, router_url


def main(argv: list[str] | None = None) -> dict[str, Any]:
    def add(p: Any) -> None:
        p.add_argument("--engines", type=int, default=3)
        p.add_argument("--clients", type=int, default=8)
        p.add_argument("--seconds", type=float, default=20.0, help="per scenario")
        p.add_argument("--max_new_tokens", type=int, default=16)
        p.add_argument("--hidden_size", type=int, default=64)

    args = parse_args("fleet_load", __doc__.splitlines()[0], argv, add)
    if args.engines < 2:
        sys.exit(f"--engines={args.engines}: the kill scenario needs at least 2")
    if args.quick:
        args.seconds, args.clients = min(args.seconds, 3.0), min(args.clients, 4)
    cfg = ModelConfig(vocab_size=48, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
                      num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=64)
    results = []
    with tempfile.TemporaryDirectory(prefix="fleet-load-") as d:
        for name, kill_at, extra in SCENARIOS:
            servers, urls, rproc, router_url = start(args.engines, os.path.join(d, name), cfg, args.threads, extra)
            try:
                results.append(scenario(name, router_url, servers, urls, args.clients, args.seconds,
                                        args.max_new_tokens, kill_at and kill_at * args.seconds,
                                        cfg.vocab_size))
            finally:
                for p in (*servers, rproc):
                    p.stop()
    header = ["scenario", "engines", "clients", "s", "requests", "lost", "twice", "re-issued", "checked/mismatched",
              "req/s", "tok/s", "p50 ms", "p99 ms", "healthy after"]
    rows = [[r["scenario"], f"{args.engines} -> {args.engines - 1}" if r["killed"] else args.engines, r["clients"],
             r["seconds"], r["requests"], r["lost"], r["answered_twice"], r["reissued_requests"],
             f"{r['checked_against_a_direct_call']}/{r['mismatched']}", r["requests_per_s"], r["tokens_per_s"],
             r["p50_ms"], r["p99_ms"], r["survivors_healthy"]] for r in results]
    table = print_table(f"rollout fleet under load: {args.engines} launch.rollout_server behind sglang-router "
                        f"(round robin), {args.max_new_tokens} new tokens a request", header, rows)
    out = {"machine": machine_info(args.threads), "config": {k: v for k, v in vars(args).items() if k != "out"},
           "results": results, "table": table}
    write_json(args.out, out)
    return out


if __name__ == "__main__":
    main()
