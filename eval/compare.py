"""Two methods of one benchmark run, task by task: where one passes and the other does not, and why.

``intent compare RUN_DIR A B [--show N]`` (or ``python -m eval.compare``) reads a finished or partial
``intent bench`` run directory (its ``episodes.jsonl`` and guard log ``logs.jsonl``), pairs the
episodes of methods A and B on the same tasks, and reports, for the tasks each one wins:

* how the loser's episode ended (crashed, over budget, no answer, answered and judged wrong, judged
  partly right);
* per episode, for winner and loser: calls run, calls that failed, what was spent, calls refused;
* the loser's refusals by reason; a ``plan_over_budget`` refusal (MCO, INTENT) is split by whether
  the predicted plan fit the budget at face value (``best_case_over`` = 0: refused for the risk-adjusted
  cost alone) or not;
* on the synthetic markets, the tiers of the calls each ran (cheap / mid / premium / composite /
  distractor, read from the regenerated task: hidden from the agents, shown here only), the loser's
  split into the calls before and after its first refusal;
* the first ``--show`` tasks of each side, call by call.

It writes ``compare-A-B.md``, ``compare-A-B.json`` and ``compare-A-B.png`` into the run directory
(a character of a method name unsafe in a file name, e.g. ``:`` or ``/``, written ``_``, and then
``~`` and a digest of the name) and prints the
Markdown. Everything comes from the run's own files (and, for the tiers, the seeded task generator the
run used), so the figures are as reproducible as the run; it never writes to them (a torn last line of
``episodes.jsonl`` is skipped with a warning). An episode a resumed run re-ran counts as its last attempt; one
whose newest attempt has no result yet (a run still going, or one that died) as its last finished attempt, with a
warning. The calls shown are those of the attempt whose result is shown, selected by the attempt number the
runner saves in the result and marks the log records with (eval/episode_log.py; an attempt that logged no tool
call shows none); a run written before attempts were numbered falls back to telling them apart by their steps.
"""

from __future__ import annotations

import argparse
import json
import re
import warnings
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eval.episode_log import attempt_of, episode_id, kept_attempts
from eval.results import EpisodeResult, ResultStore
from intent.errors import UsageError
from intent.logs import StepRecord, label_of, read_log
from intent.oracle import DUPLICATE_CALL, PLAN_OVER_BUDGET

__all__ = ["Episode", "compare_methods", "main", "render_markdown"]

TIERS = ("cheap", "mid", "premium", "composite", "distractor")


@dataclass
class Call:
    """One logged proposal of an episode, reduced to what the comparison reads."""

    step: int
    tool: str
    outcome: str  # "ok", "failed", "refused", "invalid"
    reason: str = ""
    fits_at_face_value: bool | None = None  # plan_over_budget refusals only
    tier: str | None = None

    def render(self) -> str:
        if self.outcome == "refused":
            why = self.reason
            if self.reason == PLAN_OVER_BUDGET and self.fits_at_face_value is not None:
                why += ", risk only" if self.fits_at_face_value else ", over at face value"
            return f"{self.tool} refused ({why})"
        return f"{self.tool} {self.outcome}"


@dataclass
class Episode:
    task_id: str
    group: str
    score: float
    passed: float
    answered: bool
    feasible: bool
    crashed: bool
    cost: float
    budget: float
    seed: int = 0
    calls: list[Call] = field(default_factory=list)
    # The attempt numbers of the results saved for it, in file order (one per attempt that finished: a resumed run
    # re-runs a crash); the last is the result shown. None: saved before attempts were marked (eval/episode_log.py).
    attempts: list[int | None] = field(default_factory=lambda: [None])

    @property
    def ran(self) -> list[Call]:
        return [c for c in self.calls if c.outcome in ("ok", "failed")]

    @property
    def refused(self) -> list[Call]:
        return [c for c in self.calls if c.outcome == "refused"]

    def ending(self) -> str:
        if self.crashed:
            return "crashed"
        if not self.feasible:
            return "over budget"
        if not self.answered:
            return "no answer"
        if self.passed <= 0:
            return "answered, judged wrong"
        if self.passed < 1:
            return "answered, judged partly right"
        return "passed"


ENDINGS = ("passed", "answered, judged partly right", "answered, judged wrong", "no answer", "over budget",
           "crashed")


def _results(run: Path) -> list[EpisodeResult]:
    # Read only: the run may still be appending, and a resumed run cuts a torn last line itself.
    return ResultStore(run / "episodes.jsonl").load(repair=False)


def _episodes(results: list[EpisodeResult], method: str) -> dict[str, Episode]:
    out: dict[str, Episode] = {}
    for r in results:  # in file order: an episode a resumed run re-ran keeps its latest result
        if r.method == method:
            earlier = out.get(r.task_id)
            out[r.task_id] = Episode(r.task_id, r.group, r.score, r.passed, r.answered, r.feasible, r.crashed,
                                     r.cost, r.budget, r.seed,
                                     attempts=[*(earlier.attempts if earlier else []), attempt_of(r)])
    return out


def _attach_calls(run: Path, episodes: dict[str, dict[str, Episode]],
                  tiers: dict[str, dict[str, str]] | None) -> None:
    """Add each episode's logged calls of the attempt whose result it shows, in log order (summed over attempts,
    a retried crash looked busier), selected by the attempt number the result and the records carry (an older
    log's, without numbers, by eval.episode_log's heuristic)."""
    log = run / "logs.jsonl"
    if not log.exists():
        raise UsageError(f"{run} has no logs.jsonl; compare reads the guard log `intent bench` writes beside "
                         "episodes.jsonl")
    by_id = {episode_id(m, ep.task_id, ep.seed): ep for m, eps in episodes.items() for ep in eps.values()}
    running = 0
    for eid, kept in kept_attempts(read_log(log), {eid: ep.attempts for eid, ep in by_id.items()}).items():
        ep = by_id[eid]
        # A newer attempt logged with no result saved: it has not finished (the run is still going, or died in
        # it). The result shown is the last finished attempt's, and so are the calls.
        running += kept.unfinished_newer
        calls = (_call(rec, (tiers or {}).get(ep.task_id)) for rec in kept.records)
        ep.calls.extend(c for c in calls if c is not None)
    if running:
        warnings.warn(f"{run}: {running} episode(s) have a newest attempt with no result yet (a run still going, or "
                      "one that died in it); they are shown with their last finished attempt's result and calls",
                      stacklevel=3)


def _call(rec: StepRecord, tiers: dict[str, str] | None) -> Call | None:
    tier = tiers.get(rec.tool) if tiers is not None else None
    if rec.decision == "reject":
        fits = None
        if rec.reason == PLAN_OVER_BUDGET and "best_case_over" in (rec.oracle_usage or {}):
            fits = not rec.oracle_usage["best_case_over"]
        return Call(rec.step, rec.tool, "refused", rec.reason, fits, tier)
    if rec.decision == "invalid":
        # A merged duplicate is answered with its twin's result, never shown as a refusal.
        return None if rec.reason == DUPLICATE_CALL else Call(rec.step, rec.tool, "invalid", rec.reason, None, tier)
    if rec.decision == "accept" and rec.execution >= 1 and rec.status in ("ok", "error"):
        z = label_of(rec)
        failed = rec.status == "error" or z == 0
        return Call(rec.step, rec.tool, "failed" if failed else "ok", "", None, tier)
    return None


def _task_tiers(run: Path) -> dict[str, dict[str, str]] | None:
    """tool -> tier per task, regenerated from the run's seeded config (synthetic markets only)."""
    cfg_path = run / "run_config.json"
    if not cfg_path.exists():
        return None
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    market = cfg.get("market")
    if market not in ("synthetic", "synthetic-v2"):
        return None
    from eval.markets import SyntheticBenchMarket, SyntheticV2BenchMarket

    cls = SyntheticV2BenchMarket if market == "synthetic-v2" else SyntheticBenchMarket
    bench = cls(int(cfg["tasks"]), int(cfg["seed"]), event_rate=float(cfg.get("event_rate") or 0.0),
                budget=cfg.get("budget"), budget_scale=float(cfg.get("budget_scale") or 1.0),
                relevant_price_scale=float(cfg.get("relevant_price_scale") or 1.0))
    return {bench.task_id(t): {tool.name: tool.tier for tool in t.tools} for t in bench.tasks()}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _side(winner: list[Episode], loser: list[Episode], tiers: bool) -> dict[str, Any]:
    reasons: Counter[str] = Counter()
    for ep in loser:
        for c in ep.refused:
            key = c.reason
            if c.reason == PLAN_OVER_BUDGET and c.fits_at_face_value is not None:
                key += " (plan fits at face value: risk only)" if c.fits_at_face_value else " (over at face value)"
            reasons[key] += 1

    def per_episode(eps: list[Episode]) -> dict[str, float | None]:
        return {
            "calls_run": _mean([len(e.ran) for e in eps]),
            "calls_failed": _mean([sum(c.outcome == "failed" for c in e.ran) for e in eps]),
            "refusals": _mean([len(e.refused) for e in eps]),
            "spent": _mean([e.cost for e in eps]),
            "with_a_refusal": _mean([float(bool(e.refused)) for e in eps]),
        }

    out: dict[str, Any] = {
        "tasks": len(winner),
        "loser_endings": {k: sum(e.ending() == k for e in loser) for k in ENDINGS},
        "winner": per_episode(winner),
        "loser": per_episode(loser),
        "loser_refusals_by_reason": dict(reasons.most_common()),
    }
    if tiers:
        def tier_counts(calls: list[Call]) -> dict[str, int]:
            return {t: sum(c.tier == t for c in calls) for t in TIERS}

        before: list[Call] = []
        after: list[Call] = []
        for ep in loser:
            first = next((i for i, c in enumerate(ep.calls) if c.outcome == "refused"), len(ep.calls))
            before += [c for c in ep.calls[:first] if c.outcome in ("ok", "failed")]
            after += [c for c in ep.calls[first:] if c.outcome in ("ok", "failed")]
        out["winner_calls_by_tier"] = tier_counts([c for e in winner for c in e.ran])
        out["loser_calls_by_tier"] = tier_counts([c for e in loser for c in e.ran])
        out["loser_calls_by_tier_before_first_refusal"] = tier_counts(before)
        out["loser_calls_by_tier_after_first_refusal"] = tier_counts(after)
    return out


def compare_methods(run_dir: str | Path, a: str, b: str) -> dict[str, Any]:
    """The comparison as a JSON-ready dict (see the module docstring); ``examples`` holds every task each wins."""
    run = Path(run_dir)
    if not (run / "episodes.jsonl").exists():
        raise UsageError(f"{run} has no episodes.jsonl; pass an `intent bench` run directory (its --out)")
    if a == b:
        raise UsageError(f"compare needs two different methods, got {a!r} twice")
    tiers = _task_tiers(run)
    results = _results(run)
    episodes = {m: _episodes(results, m) for m in (a, b)}
    for m in (a, b):
        if not episodes[m]:
            found = sorted({r.method for r in results})
            raise UsageError(f"method {m!r} has no episodes in {run}; the run has: {', '.join(found) or 'none'}")
    _attach_calls(run, episodes, tiers)
    common = sorted(set(episodes[a]) & set(episodes[b]))
    pairs = [(episodes[a][t], episodes[b][t]) for t in common]
    a_wins = [(x, y) for x, y in pairs if x.score > y.score]
    b_wins = [(x, y) for x, y in pairs if y.score > x.score]
    cfg_path = run / "run_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
    return {
        "run": str(run), "a": a, "b": b,
        "market": cfg.get("market"), "agent": cfg.get("agent"), "seed": cfg.get("seed"), "code": cfg.get("code"),
        "tasks": len(common),
        "pr": {a: 100 * sum(x.score for x, _ in pairs) / len(pairs) if pairs else None,
               b: 100 * sum(y.score for _, y in pairs) / len(pairs) if pairs else None},
        "a_wins": len(a_wins), "b_wins": len(b_wins), "ties": len(pairs) - len(a_wins) - len(b_wins),
        "where_a_wins": _side([x for x, _ in a_wins], [y for _, y in a_wins], tiers is not None),
        "where_b_wins": _side([y for _, y in b_wins], [x for x, _ in b_wins], tiers is not None),
        "examples": {
            "a_wins": [_example(x, y) for x, y in a_wins],
            "b_wins": [_example(y, x) for x, y in b_wins],
        },
    }


def _example(winner: Episode, loser: Episode) -> dict[str, Any]:
    def trace(ep: Episode) -> str:
        turns: dict[int, list[str]] = {}
        for c in ep.calls:
            turns.setdefault(c.step, []).append(c.render() + (f" [{c.tier}]" if c.tier else ""))
        return " / ".join(f"t{s}: " + ", ".join(v) for s, v in sorted(turns.items())) or "(no calls)"

    return {"task": winner.task_id, "group": winner.group, "winner_ending": winner.ending(),
            "loser_ending": loser.ending(), "winner_spent": winner.cost, "loser_spent": loser.cost,
            "budget": winner.budget, "winner_calls": trace(winner), "loser_calls": trace(loser)}


def _f(v: Any, digits: int = 2) -> str:
    return "" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def render_markdown(summary: dict[str, Any], show: int = 5) -> str:
    a, b = summary["a"], summary["b"]
    code = ", ".join(summary.get("code") or []) or "not recorded"
    lines = [
        f"# {a} vs {b}, task by task",
        "",
        f"Run `{summary['run']}`: market {summary['market']}, agent {summary['agent']}, seed {summary['seed']}, "
        f"code {code}. `intent compare {summary['run']} {a} {b}`.",
        "",
        f"{summary['tasks']} tasks both ran: PR {a} {_f(summary['pr'][a], 1)}, {b} {_f(summary['pr'][b], 1)}. "
        f"{a} scores higher on {summary['a_wins']}, {b} on {summary['b_wins']}, equal on {summary['ties']}.",
    ]
    for key, winner, loser in (("where_a_wins", a, b), ("where_b_wins", b, a)):
        side = summary[key]
        lines += ["", f"## The {side['tasks']} tasks {winner} wins", ""]
        if not side["tasks"]:
            continue
        lines += [f"How {loser}'s episode ended: " + ", ".join(
            f"{k} {v}" for k, v in side["loser_endings"].items() if v) + ".", "",
            f"| per episode | {winner} | {loser} |", "|---|---:|---:|"]
        names = {"calls_run": "calls run", "calls_failed": "of which failed", "refusals": "calls refused",
                 "spent": "spent", "with_a_refusal": "share of episodes with a refusal"}
        for k, name in names.items():
            lines.append(f"| {name} | {_f(side['winner'][k])} | {_f(side['loser'][k])} |")
        if side["loser_refusals_by_reason"]:
            lines += ["", f"{loser}'s refusals by reason: " + ", ".join(
                f"{k} {v}" for k, v in side["loser_refusals_by_reason"].items()) + "."]
        if "winner_calls_by_tier" in side:
            lines += ["", "| calls run, by tier (hidden from the agent) | " + " | ".join(TIERS) + " |",
                      "|---|" + "---:|" * len(TIERS)]
            for k, name in (("winner_calls_by_tier", winner), ("loser_calls_by_tier", loser),
                            ("loser_calls_by_tier_before_first_refusal", f"{loser}, before its first refusal"),
                            ("loser_calls_by_tier_after_first_refusal", f"{loser}, after its first refusal")):
                lines.append(f"| {name} | " + " | ".join(str(side[k][t]) for t in TIERS) + " |")
    for key, winner, loser in (("a_wins", a, b), ("b_wins", b, a)):
        examples = summary["examples"][key][:show]
        if not examples:
            continue
        lines += ["", f"## The first {len(examples)} tasks {winner} wins, call by call", ""]
        for ex in examples:
            lines += [f"- `{ex['task']}` ({ex['group']}, budget {ex['budget']:g})",
                      f"  - {winner}: {ex['winner_ending']}, spent {ex['winner_spent']:g}: {ex['winner_calls']}",
                      f"  - {loser}: {ex['loser_ending']}, spent {ex['loser_spent']:g}: {ex['loser_calls']}"]
    return "\n".join(lines) + "\n"


def _plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, b = summary["a"], summary["b"]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    rows = [(f"{a} wins ({b}'s ending)", summary["where_a_wins"]), (f"{b} wins ({a}'s ending)", summary["where_b_wins"])]
    left = [0, 0]
    for ending in ENDINGS[1:]:
        counts = [side["loser_endings"][ending] for _, side in rows]
        ax.barh([r[0] for r in rows], counts, left=left, label=ending)
        left = [x + c for x, c in zip(left, counts)]
    ax.set_xlabel("tasks")
    ax.set_title(f"{a} vs {b}: how the loser's episode ended ({summary['market']}, seed {summary['seed']})")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_UNSAFE_IN_FILE_NAMES = re.compile(r"[^A-Za-z0-9._-]")


def _file_safe(method: str) -> str:
    # A method named after its model (openai:gpt-x, intent/minilm) would name a missing directory or a
    # character some file systems refuse; only the file name changes, the tables keep the real name. A name
    # that changed gets a short digest of itself, so that two names written alike (a:b, a/b) never share files.
    safe = _UNSAFE_IN_FILE_NAMES.sub("_", method)
    return safe if safe == method else f"{safe}~{zlib.crc32(method.encode()):08x}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="intent compare", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="an `intent bench` run directory (its --out)")
    parser.add_argument("a", help="a method of that run, e.g. tracker")
    parser.add_argument("b", help="another method of that run, e.g. intent")
    parser.add_argument("--show", type=int, default=5, help="tasks listed call by call per side (default 5)")


def run(args: argparse.Namespace) -> int:
    if args.show < 0:
        raise UsageError(f"--show must be >= 0, got {args.show}")
    summary = compare_methods(args.run, args.a, args.b)
    text = render_markdown(summary, show=args.show)
    stem = str(Path(args.run) / f"compare-{_file_safe(args.a)}-{_file_safe(args.b)}")
    Path(stem + ".md").write_text(text, encoding="utf-8")
    Path(stem + ".json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    _plot(summary, Path(stem + ".png"))
    print(text, end="")
    print(f"wrote {stem}.md, .json, .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
