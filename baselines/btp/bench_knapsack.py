"""Time :func:`plan_quotas` on BTP-sized problems: ``python -m baselines.btp.bench_knapsack [instances] [seed]``.

The main case has 20 tools, caps uniform in 0..5, values uniform in [0, 1], two-decimal prices
uniform in [1.00, 50.00] and B = 50, over 200 random instances. Scaling is exact at 100, which
gives 5000 cost units before the gcd reduction. For comparison, the same shapes are also timed
with real-valued prices, which use the paper's conservative scaling at the default precision.
Timing is informative only: the tests check behaviour, not wall time.
"""

from __future__ import annotations

import random
import sys
import time

import numpy as np

from baselines.btp.knapsack import plan_quotas_detailed


def _instances(n: int, seed: int, two_decimals: bool):
    rng = random.Random(seed)
    names = [f"tool_{i:02d}" for i in range(20)]
    for _ in range(n):
        if two_decimals:
            prices = {t: rng.randint(100, 5000) / 100 for t in names}
        else:
            prices = {t: rng.uniform(1.0, 50.0) for t in names}
        values = {t: rng.random() for t in names}
        caps = {t: rng.randint(0, 5) for t in names}
        yield prices, values, caps


def bench(instances: int = 200, seed: int = 0, *, two_decimals: bool = True) -> dict[str, float]:
    times, scales, exact = [], set(), True
    for prices, values, caps in _instances(instances, seed, two_decimals):
        started = time.perf_counter()
        plan = plan_quotas_detailed(prices, values, caps, 50.0)
        times.append((time.perf_counter() - started) * 1000.0)
        assert plan.total_cost <= 50.0 + 1e-9
        scales.add(plan.scale)
        exact = exact and plan.exact
    arr = np.array(times)
    return {"instances": instances, "mean_ms": float(arr.mean()), "p95_ms": float(np.percentile(arr, 95)),
            "max_ms": float(arr.max()), "scale": max(scales), "exact": exact}


def main(argv: list[str] | None = None) -> dict[str, float]:
    argv = sys.argv[1:] if argv is None else argv
    instances = int(argv[0]) if argv else 200
    seed = int(argv[1]) if len(argv) > 1 else 0
    plan_quotas_detailed({"a": 1.0}, {"a": 0.5}, {"a": 1}, 1.0)  # warm-up (imports, numpy)
    out = {}
    for label, two_dp in (("two-decimal prices", True), ("real-valued prices", False)):
        r = bench(instances, seed, two_decimals=two_dp)
        print(f"plan_quotas: 20 tools, caps <= 5, B = 50, {label}, {r['instances']} instances "
              f"(scale {r['scale']}, exact={r['exact']}): mean {r['mean_ms']:.3f} ms, p95 {r['p95_ms']:.3f} ms, "
              f"max {r['max_ms']:.3f} ms")
        if two_dp:
            out = r
    return out


if __name__ == "__main__":
    main()
