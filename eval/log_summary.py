"""What a guard log says about each episode, also for a run that never finished.

``python -m eval.log_summary LOGS [--method intent]``

Per episode: the turns it reached, what it spent, the calls accepted and refused, the characters
of refusal notes the agent was shown per turn (merged duplicate calls are logged but never shown:
they are left out). Over every gate decision: its time, accepted / refused counts, and what the
planning oracles reported (policy tokens and rollout steps per decision, rollouts cut by the
reply cap). ``results.md`` needs a finished run; a run
stopped by hand (a real model at minutes per decision) still has its ``logs.jsonl``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterable
from typing import Any

from intent.logs import LogFormatError, StepRecord, read_log
from intent.oracle import DUPLICATE_CALL

__all__ = ["summarize"]


def summarize(records: Iterable[StepRecord], method: str | None = None) -> dict[str, Any]:
    """Per-episode figures and the decision times of every gate decision, from log records.

    ``method``: keep the episodes whose task id starts with ``"<method>:"`` (the benchmark's ids).
    """
    episodes: dict[str, dict[str, Any]] = {}
    seconds: list[float] = []
    gate = {"accepted": 0, "refused": 0, "rollouts_capped": 0}
    tokens: list[float] = []
    steps: list[float] = []
    for r in records:
        if method is not None and not r.task_id.startswith(f"{method}:"):
            continue
        ep = episodes.setdefault(r.task_id, {"turns": set(), "spent": 0.0, "accepted": 0, "refused": 0,
                                             "refusal_chars_per_turn": {}})
        ep["turns"].add(r.step)
        ep["spent"] = max(ep["spent"], r.spent)
        if r.is_gate_decision:
            seconds.append(r.decision_ms / 1000.0)
            gate["accepted" if r.decision == "accept" else "refused"] += 1
            usage = r.oracle_usage or {}
            gate["rollouts_capped"] += int(usage.get("rollout_capped", 0))
            if "policy_tokens" in usage:
                tokens.append(float(usage["policy_tokens"]))
            if "rollout_steps" in usage:
                steps.append(float(usage["rollout_steps"]))
        if r.decision == "accept" and r.execution == 1:
            ep["accepted"] += 1
        shown = r.decision == "reject" or (r.decision == "invalid" and r.reason != DUPLICATE_CALL)
        if shown:
            ep["refused"] += 1
            per_turn = ep["refusal_chars_per_turn"]
            per_turn[r.step] = per_turn.get(r.step, 0) + len(r.feedback or "")
    for ep in episodes.values():
        ep["turns"] = len(ep["turns"])
    return {
        "episodes": episodes,
        "decisions": len(seconds),
        "decision_s": _spread(seconds),
        "gate": gate,
        "policy_tokens": _spread(tokens),
        "rollout_steps": _spread(steps),
    }


def _spread(values: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", help="a guard log (intent.logs JSONL), e.g. OUT/synthetic/logs.jsonl")
    parser.add_argument("--method", help="only this method's episodes (task ids '<method>:...')")
    args = parser.parse_args(argv)
    try:
        out = summarize(read_log(args.logs), args.method)
    except LogFormatError as exc:  # the file the user named: one line, not a traceback
        raise SystemExit(f"error: {exc}") from None
    if not out["episodes"]:
        raise SystemExit(f"error: {args.logs} has no records" + (f" of method {args.method!r}" if args.method else ""))
    print("| episode | turns | spent | accepted | refused | refusal characters shown per turn |")
    print("|---|---:|---:|---:|---:|---|")
    for task, ep in out["episodes"].items():
        chars = ", ".join(f"{turn}: {n:,}" for turn, n in sorted(ep["refusal_chars_per_turn"].items()))
        print(f"| {task} | {ep['turns']} | {ep['spent']:g} | {ep['accepted']} | {ep['refused']} | {chars} |")
    if out["decision_s"]:
        d = out["decision_s"]
        g = out["gate"]
        print(f"\n{out['decisions']} gate decisions ({g['accepted']} accepted, {g['refused']} refused): "
              f"{d['median']:.1f} s median ({d['min']:.1f} s to {d['max']:.1f} s)")
        for key, what in (("policy_tokens", "policy tokens"), ("rollout_steps", "rollout steps")):
            if out[key]:
                v = out[key]
                print(f"{what} per decision: {v['median']:,.0f} median ({v['min']:,.0f} to {v['max']:,.0f})")
        if out["policy_tokens"] is not None:
            print(f"rollouts cut by the reply cap before a whole call: {g['rollouts_capped']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
