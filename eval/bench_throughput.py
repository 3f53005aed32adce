"""Episodes per second of the simulated agent on the synthetic market, by ``--workers``.

``python -m eval.bench_throughput [--tasks 200] [--workers 1,2,4] [--methods raw,prompt,tracker]``

Every episode runs the full guarded loop (``create_agent`` + ``BudgetGuard`` middleware);
all worker counts run in this one process on the same tasks, one after another.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from eval.runner import BenchConfig, run_benchmark
from intent.cli import positive_int


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=positive_int, default=200)
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--methods", default="raw,prompt,tracker")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        counts = [int(w) for w in args.workers.split(",")]
    except ValueError:
        parser.error(f"--workers {args.workers!r}: give worker counts separated by commas, e.g. 1,2,4")
    if not counts or min(counts) < 1:
        parser.error(f"--workers {args.workers!r}: every worker count must be >= 1")
    from eval.methods import available_methods

    unknown = [m for m in methods if m not in available_methods()]
    if unknown or not methods:
        parser.error(f"--methods: unknown {unknown or args.methods!r}; choose from {', '.join(available_methods())}")
    rows = []
    for workers in counts:
        with tempfile.TemporaryDirectory() as out:
            started = time.perf_counter()
            run_benchmark(BenchConfig(tasks=args.tasks, methods=methods, workers=workers, out=out,
                                      reference=methods[-1]), progress=False)
            elapsed = time.perf_counter() - started
        episodes = args.tasks * len(methods)
        rows.append({"workers": workers, "episodes": episodes, "seconds": round(elapsed, 2),
                     "episodes_per_s": round(episodes / elapsed, 1),
                     "episodes_per_min": round(60 * episodes / elapsed)})
    print("Simulated agent on the synthetic market (simulated), full guarded loop, this machine:")
    print("| workers | episodes | seconds | episodes/s | episodes/min |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workers']} | {r['episodes']} | {r['seconds']} | {r['episodes_per_s']} | {r['episodes_per_min']} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
