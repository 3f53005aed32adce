"""``python -m baselines.btp.bench_knapsack``: plan_quotas on 20 tools, caps <= 5, B = 50, two-decimal prices."""

from __future__ import annotations

import random
import statistics
import time

from baselines.btp.knapsack import plan_quotas


def main(instances: int = 200, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    times = []
    for _ in range(instances):
        names = [f"tool_{i}" for i in range(20)]
        prices = {t: rng.randint(500, 5000) / 100 for t in names}
        values = {t: round(rng.random(), 3) for t in names}
        caps = {t: rng.randint(0, 5) for t in names}
        started = time.perf_counter()
        plan_quotas(prices, values, caps, 50.0)
        times.append((time.perf_counter() - started) * 1000)
    times.sort()
    out = {"instances": instances, "mean_ms": statistics.fmean(times), "p95_ms": times[int(0.95 * len(times)) - 1],
           "max_ms": times[-1]}
    print("plan_quotas: 20 tools, caps <= 5, B = 50, two-decimal prices (exact, scale 100)")
    for k, v in out.items():
        print(f"  {k:10s} {v:.3f}" if isinstance(v, float) else f"  {k:10s} {v}")
    return out


if __name__ == "__main__":
    main()
