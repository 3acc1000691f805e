"""`make bench`: every benchmark in one run, then one Markdown summary (bench/results/summary.md).

    python -m bench.run_all [--quick] [--threads N] [--out_dir DIR] [--rl_seconds S]

About 8 minutes on the 2-core development machine. Each benchmark's JSON goes to
out_dir/<name>.json; summary.md holds the tables, the date and the machine, ready for the
README's Performance section.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from bench import common, rl_step, rollout, train_throughput


def main(argv: Sequence[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out_dir", default=common.RESULTS_DIR)
    p.add_argument("--rl_seconds", type=float, default=90.0)
    p.add_argument("--trl_python", default="")
    args = p.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    common_args = [f"--threads={args.threads}"] + (["--quick"] if args.quick else [])
    t0 = time.perf_counter()
    tables = []
    for name, mod, extra in (
        ("rollout", rollout, []),
        ("rl_step", rl_step, [f"--seconds={args.rl_seconds}"] + ([f"--trl_python={args.trl_python}"]
                                                                  if args.trl_python else [])),
        ("train_throughput", train_throughput, []),
    ):
        out = mod.main([*common_args, *extra, f"--out={os.path.join(args.out_dir, name + '.json')}"])
        tables.append(out["table"])
    m = common.machine_info(args.threads)
    summary = (f"Measured {m['date']} on {m['cpu']} ({m['cores']} cores, {m['threads']} torch thread(s) per "
               f"contender), torch {m['torch']}, Python {m['python']}; `make bench` took "
               f"{time.perf_counter() - t0:.0f} s.\n\n" + "\n".join(tables))
    path = os.path.join(args.out_dir, "summary.md")
    with open(path, "w") as f:
        f.write(summary)
    print(f"wrote {path}")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
