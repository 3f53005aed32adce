"""`intent seeds RUN [RUN ...]`: one method against two others over several bench runs (seeds), as one table.

Each run is an ``intent bench`` output directory (its ``--out``) of the same market, agent and task count with a
different ``--seed``. Per run it reads ``results.json`` only (nothing is recomputed): the PR of the three methods,
the method's paired PR difference against ``--base`` (percentage points, with the run's paired bootstrap 95%
interval) and its decision-regret difference against ``--regret-base`` (likewise). It writes
``OUT/seeds-METHOD.{md,json,png}`` and prints the Markdown: the table, how many runs reach ``--target`` points
over the base, and on how many the regret interval lies below 0. A run without a needed method or paired figure
is an error naming the run, the method and the flag that would add it (regret differences exist against tracker
and mco only: the bench computes no others); a run directory given twice, or two runs of one seed, are refused by
path. A method's PR of None (it ran no episode) shows as "–".
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from intent.errors import UsageError

__all__ = ["collect", "main", "render_markdown"]


def _load(run: Path) -> dict[str, Any]:
    path = run / "results.json"
    if not path.is_file():
        raise UsageError(f"{run} has no results.json; pass `intent bench` run directories (their --out)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); re-run that bench") from exc


def _paired(results: dict[str, Any], kind: str, base: str, method: str, run: Path) -> dict[str, Any]:
    table = results.get(kind, {}).get(base, {})
    if method not in table:
        if kind == "paired_regret":
            # The runner computes decision-regret differences against tracker and mco only (eval/runner.py
            # _regret_bases), whatever else --methods lists.
            present = [b for b, rows in results.get(kind, {}).items() if method in rows]
            raise UsageError(f"{run}: results.json has no decision-regret difference of {method!r} against "
                             f"--regret-base {base!r}: the bench computes them only against tracker and mco, when "
                             "they ran beside the method; this run has regret figures against: "
                             f"{', '.join(present) or 'none'}. Pass --regret-base one of those (or re-run the bench "
                             f"with tracker or mco in --methods)")
        raise UsageError(f"{run}: results.json has no paired PR difference of {method!r} against --base {base!r}; "
                         f"run the bench with both methods (and {base!r} in --paired-with)")
    return table[method]


def collect(runs: list[str | Path], method: str, base: str, regret_base: str) -> dict[str, Any]:
    """The per-run rows and their summary (see the module docstring)."""
    if not runs:
        raise UsageError("seeds needs at least one run directory")
    if len({method, base, regret_base}) < 3:
        raise UsageError(f"the method, --base and --regret-base must differ, got {method!r}, {base!r}, {regret_base!r}")
    rows, labels = [], set()
    given: dict[Path, Path] = {}
    seeds: dict[Any, Path] = {}
    for run in map(Path, runs):
        same = given.setdefault(run.resolve(), run)
        if same is not run:
            raise UsageError(f"run directory {same} is given twice ({same} and {run}); pass each run once")
        results = _load(run)
        cfg = results.get("config", {})
        other = seeds.setdefault(cfg.get("seed"), run)
        if other is not run:
            raise UsageError(f"{other} and {run} are both seed {cfg.get('seed')} (results.json config.seed): one "
                             "seed counted twice; pass one run per seed")
        methods = results.get("methods", {})
        for m in (method, base, regret_base):
            if m not in methods:
                raise UsageError(f"{run}: method {m!r} is not in this run (it has: {', '.join(methods) or 'none'})")
        pr = _paired(results, "paired", base, method, run)
        regret = _paired(results, "paired_regret", regret_base, method, run)
        labels.add((cfg.get("market"), cfg.get("agent"), cfg.get("tasks")))
        rows.append({
            "run": str(run), "seed": cfg.get("seed"),
            "pr": {m: methods[m]["PR"] for m in (base, regret_base, method)},
            "regret": {m: methods[m].get("decision_regret") for m in (base, regret_base, method)},
            "d_pr": pr["diff"], "d_pr_ci95": list(pr["ci95"]),
            "d_regret": regret["diff"], "d_regret_ci95": list(regret["ci95"]),
        })
    if len(labels) > 1:
        raise UsageError(f"the runs differ in market, agent or task count ({sorted(map(str, labels))}); "
                         "compare seeds of one setting")
    market, agent, tasks = labels.pop()
    return {"method": method, "base": base, "regret_base": regret_base, "market": market, "agent": agent,
            "tasks": tasks, "rows": rows}


def render_markdown(summary: dict[str, Any], target: float) -> str:
    m, base, rb = summary["method"], summary["base"], summary["regret_base"]
    rows = summary["rows"]
    lines = [f"# {m} against {base} (PR) and {rb} (decision regret), over {len(rows)} runs", "",
             f"Market {summary['market']}, agent {summary['agent']}, {summary['tasks']} tasks per run; each figure "
             "from the run's results.json (intervals: paired bootstrap 95% over tasks). "
             f"`intent seeds {' '.join(r['run'] for r in rows)} --method {m} --base {base} --regret-base {rb}`.", "",
             f"| seed | {base} PR | {rb} PR | {m} PR | {m} − {base}, PR | Regret: {base} / {rb} / {m} | "
             f"{m} − {rb}, Regret |", "|---:|---:|---:|---:|---:|---:|---:|"]

    def regret(v: Any) -> str:
        return "–" if v is None else f"{v:.2f}"

    def pr(v: Any) -> str:  # None: the method ran no episode in that run
        return "–" if v is None else f"{v:.1f}"

    for r in rows:
        lo, hi = r["d_pr_ci95"]
        rlo, rhi = r["d_regret_ci95"]
        lines.append(f"| {r['seed']} | {pr(r['pr'][base])} | {pr(r['pr'][rb])} | {pr(r['pr'][m])} | "
                     f"{r['d_pr']:+.1f} [{lo:+.1f}, {hi:+.1f}] | "
                     f"{regret(r['regret'][base])} / {regret(r['regret'][rb])} / {regret(r['regret'][m])} | "
                     f"{r['d_regret']:+.3f} [{rlo:+.3f}, {rhi:+.3f}] |")
    reached = sum(r["d_pr"] >= target - 1e-9 for r in rows)
    pr_excl = sum(r["d_pr_ci95"][0] > 0 for r in rows)
    below = sum(r["d_regret_ci95"][1] < 0 for r in rows)
    mean = sum(r["d_pr"] for r in rows) / len(rows)
    lines += ["", f"- {m} − {base}, PR: mean {mean:+.2f} points; at least {target:+g} on {reached} of {len(rows)} "
                  f"runs; interval above 0 on {pr_excl} of {len(rows)}.",
              f"- {m} − {rb}, decision regret: interval below 0 on {below} of {len(rows)} runs.", ""]
    return "\n".join(lines)


def _plot(summary: dict[str, Any], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    seeds = [str(r["seed"]) for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 0.45 * len(rows) + 1.6), sharey=True)
    for ax, key, unit, mark in ((left, "d_pr", "PR points", target), (right, "d_regret", "decision regret", None)):
        values = [r[key] for r in rows]
        lo = [v - r[key + "_ci95"][0] for v, r in zip(values, rows)]
        hi = [r[key + "_ci95"][1] - v for v, r in zip(values, rows)]
        ax.errorbar(values, range(len(rows)), xerr=[lo, hi], fmt="o", capsize=3)
        ax.axvline(0.0, color="grey", lw=0.8)
        if mark is not None and math.isfinite(mark):
            ax.axvline(mark, color="tab:red", lw=0.8, ls="--", label=f"target {mark:+g}")
            ax.legend(fontsize=7, loc="lower right")
        ax.set_xlabel(unit)
    left.set_yticks(range(len(rows)), [f"seed {s}" for s in seeds])
    left.set_title(f"{summary['method']} − {summary['base']}, PR", fontsize=9)
    right.set_title(f"{summary['method']} − {summary['regret_base']}, regret (lower is better)", fontsize=9)
    fig.suptitle(f"{summary['market']}, agent {summary['agent']}, {summary['tasks']} tasks per run", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", help="`intent bench` run directories of one setting, one per seed")
    parser.add_argument("--method", default="intent", help="the method compared (default intent)")
    parser.add_argument("--base", default="tracker", help="its PR is compared with this one's (default tracker)")
    parser.add_argument("--regret-base", default="mco",
                        help="its decision regret is compared with this one's (default mco)")
    parser.add_argument("--target", type=float, default=5.0,
                        help="PR points over --base counted as reached (default 5: issue #16's aim)")
    parser.add_argument("--out", default=None, help="directory for seeds-METHOD.{md,json,png} (default: the first run)")


def run(args: argparse.Namespace) -> int:
    if not math.isfinite(args.target):
        raise UsageError(f"--target must be a finite number of PR points, got {args.target}")
    summary = collect(args.runs, args.method, args.base, args.regret_base)
    text = render_markdown(summary, args.target)
    from training.common import check_out_directory

    out = check_out_directory(args.out or args.runs[0])
    out.mkdir(parents=True, exist_ok=True)
    from eval.compare import _file_safe

    stem = out / f"seeds-{_file_safe(args.method)}"
    stem.with_suffix(".md").write_text(text, encoding="utf-8")
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    _plot(summary, args.target, stem.with_suffix(".png"))
    print(text, end="")
    print(f"wrote {stem}.md, .json, .png")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="intent seeds", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
