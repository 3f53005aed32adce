"""eval.log_summary: per-episode figures of a run that may not have finished."""

from intent.logs import StepRecord
from eval.log_summary import summarize


def _rec(task: str, step: int, decision: str, reason: str = "r", feedback: str = "", ms: float = 0.0,
         spent: float = 0.0, execution: int = 0, usage: dict | None = None) -> StepRecord:
    return StepRecord(task_id=task, step=step, call_id=f"{task}-{step}-{reason}", query="q", reasoning="", tool="t",
                      args={}, price=1.0, decision=decision, reason=reason, feedback=feedback, decision_ms=ms,
                      spent=spent, remaining=10.0, budget=10.0, execution=execution, oracle_usage=usage or {},
                      status="ok" if decision == "accept" else ("rejected" if decision == "reject" else "invalid"))


def test_summary_counts_only_the_refusals_the_agent_was_shown():
    records = [
        _rec("intent:a", 0, "reject", feedback="x" * 100, ms=2000.0),
        _rec("intent:a", 0, "invalid", reason="duplicate_call", feedback="y" * 50),  # merged: never shown
        _rec("intent:a", 0, "invalid", reason="unknown_tool", feedback="z" * 30),
        _rec("intent:a", 1, "accept", reason="accepted", ms=4000.0, spent=3.0, execution=1),
        _rec("tracker:a", 0, "reject", feedback="w" * 10, ms=1.0),
    ]
    out = summarize(records, "intent")
    ep = out["episodes"]["intent:a"]
    assert ep == {"turns": 2, "spent": 3.0, "accepted": 1, "refused": 2, "refusal_chars_per_turn": {0: 130}}
    assert out["decisions"] == 2 and out["decision_s"] == {"median": 3.0, "min": 2.0, "max": 4.0}


def test_summary_reports_what_the_planning_oracle_spent_per_decision():
    records = [
        _rec("intent:a", 0, "reject", ms=1000.0, usage={"policy_tokens": 100.0, "rollout_steps": 3.0, "rollout_capped": 1.0}),
        _rec("intent:a", 0, "reject", reason="s", ms=1000.0, usage={"policy_tokens": 300.0, "rollout_steps": 9.0}),
        _rec("intent:a", 1, "accept", reason="cache_hit", ms=1.0, usage={"cache_hit": 1.0}, execution=1),
    ]
    out = summarize(records, "intent")
    assert out["gate"] == {"accepted": 1, "refused": 2, "rollouts_capped": 1}
    assert out["policy_tokens"] == {"median": 200.0, "min": 100.0, "max": 300.0}
    assert out["rollout_steps"] == {"median": 6.0, "min": 3.0, "max": 9.0}


def test_only_gate_decisions_count_as_decisions():
    """A retry's second run, the oracle's and the agent's model charges are records, not gate
    decisions; a call accepted and then answered by someone else (released unused) is one."""
    records = [
        _rec("intent:a", 0, "accept", reason="accepted", ms=3000.0, execution=1),
        _rec("intent:a", 0, "accept", reason="accepted", execution=2),  # the same call, retried
        _rec("intent:a", 1, "accept", reason="accepted", ms=5000.0).model_copy(update={"status": "released"}),
        _rec("intent:a", 1, "accept", reason="oracle", execution=1).model_copy(update={"kind": "oracle"}),
        _rec("intent:a", 2, "accept", reason="model", execution=1).model_copy(update={"kind": "model"}),
        _rec("intent:a", 2, "reject", reason="plan_over_budget", ms=1000.0),
    ]
    out = summarize(records, "intent")
    assert out["decisions"] == 3 and out["gate"]["accepted"] == 2 and out["gate"]["refused"] == 1
    assert out["decision_s"] == {"median": 3.0, "min": 1.0, "max": 5.0}
