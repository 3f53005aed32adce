"""Log records: one :class:`~intent.logs.StepRecord` per rejection, execution, release, call
answered elsewhere, or top-up.

The guard builds every record here, so the log's invariants live in one place:
Σ ``charged`` == the ledger's spend, and the records with ``execution > 0`` are the runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from intent.ledger import BudgetLedger, LedgerEntry
from intent.logs import LogSink, StepRecord
from intent.oracle import Decision

__all__ = ["Recorder"]


def _args(args: Any) -> dict[str, Any] | str:
    if isinstance(args, Mapping):
        return dict(args)
    return args if isinstance(args, str) else {"value": repr(args)}


class Recorder:
    """Writes the guard's records to a sink (no-op without one)."""

    def __init__(self, sink: LogSink | None, oracle_name: str, enforce: bool) -> None:
        self.sink, self.oracle_name, self.enforce = sink, oracle_name, enforce

    def _write(self, ledger: BudgetLedger, **fields: Any) -> None:
        if self.sink is None:
            return
        snap = ledger.snapshot()
        self.sink.write(StepRecord(
            oracle=self.oracle_name, enforce=self.enforce, spent=snap["spent"], remaining=snap["remaining"],
            budget=snap["budget"], **fields,
        ))

    def refusal(
        self, ledger: BudgetLedger, *, episode_id: str, step: int, query: str, reasoning: str, call_id: str,
        tool: str, args: Any, price: float | None, kind: Literal["reject", "invalid"], reason: str, text: str,
        market_version: int, decision: Decision | None = None, decision_ms: float = 0.0,
    ) -> None:
        if self.sink is None:  # nothing is built for a guard with no log
            return
        self._write(
            ledger, task_id=episode_id, step=step, call_id=call_id, query=query, reasoning=reasoning, tool=tool,
            args=_args(args), price=price, decision=kind, reason=reason, feedback=text,
            trace=[s.to_dict() for s in decision.trace] if decision else [],
            status="rejected" if kind == "reject" else "invalid", market_version=market_version,
            decision_ms=decision_ms, oracle_usage=dict(decision.usage) if decision else {},
        )

    def execution(
        self, ledger: BudgetLedger, entry: LedgerEntry, *, episode_id: str, meta: Mapping[str, Any], query: str,
        reasoning: str, args: Any, observation: str, status: Literal["ok", "error"], tool_ms: float,
        artifact: dict[str, Any] | None, reason: str | None = None,
    ) -> None:
        if self.sink is None:  # nothing is built for a guard with no log
            return
        self._write(
            ledger, task_id=episode_id, step=int(meta.get("step", -1)), call_id=entry.tool_call_id, query=query,
            reasoning=reasoning, tool=entry.tool, args=_args(args), price=entry.amount - entry.overrun,
            decision="accept", reason=reason or str(meta.get("reason", "accepted")),
            feedback=str(meta.get("feedback", "")), trace=list(meta.get("trace", [])), observation=observation,
            status=status, charged=entry.amount, execution=entry.execution, overrun=entry.overrun,
            market_version=entry.market_version, decision_ms=float(meta.get("decision_ms", 0.0)) if
            entry.execution == 1 else 0.0, tool_ms=tool_ms,
            oracle_usage=dict(meta.get("usage", {})) if entry.execution == 1 else {}, artifact=artifact,
        )

    def release(
        self, ledger: BudgetLedger, entry: LedgerEntry, *, episode_id: str, meta: Mapping[str, Any], reason: str,
        text: str = "", query: str = "",
    ) -> None:
        """A reservation given back unused; ``query`` is the task of the run that made it (an abandoned run's, when
        the thread's next run releases it)."""
        if self.sink is None:  # nothing is built for a guard with no log
            return
        self._write(
            ledger, task_id=episode_id, step=int(meta.get("step", -1)), call_id=entry.tool_call_id, query=query,
            tool=entry.tool,
            price=entry.amount, decision="accept", reason=reason, feedback=text, status="released", charged=0.0,
            market_version=entry.market_version, decision_ms=float(meta.get("decision_ms", 0.0)),
            oracle_usage=dict(meta.get("usage", {})),
        )

    def answered(self, ledger: BudgetLedger, *, episode_id: str, step: int, query: str, reasoning: str,
                 call_id: str, tool: str, args: Any, reason: str, market_version: int) -> None:
        """A call another middleware answered before the guard's gate saw it: never decided,
        never reserved, never run; its one record says so."""
        if self.sink is None:  # nothing is built for a guard with no log
            return
        self._write(
            ledger, task_id=episode_id, step=step, call_id=call_id, query=query, reasoning=reasoning, tool=tool,
            args=_args(args), decision="answered", reason=reason, status="released", charged=0.0,
            market_version=market_version,
        )

    def top_up(self, ledger: BudgetLedger, *, episode_id: str, top_up_id: str, amount: float, reason: str,
               approved_by: str = "") -> None:
        if self.sink is None:  # nothing is built for a guard with no log
            return
        self._write(
            ledger, task_id=episode_id, step=-1, call_id=top_up_id, tool="", price=amount, decision="top_up",
            reason=reason or "top_up", feedback=reason, status="ok", charged=0.0, approved_by=approved_by,
        )

    def model_charge(self, ledger: BudgetLedger, entry: LedgerEntry, *, episode_id: str, step: int, query: str,
                     model: str, tokens: Mapping[str, int], reason: str) -> None:
        """One execution of a model (the agent's, or the oracle's with ``kind="oracle"``), charged."""
        if self.sink is None:  # nothing is built for a guard with no log
            return
        self._write(
            ledger, task_id=episode_id, step=step, call_id=entry.call_id, query=query, tool=model,
            price=entry.amount - entry.overrun, decision="accept", reason=reason, status="ok", charged=entry.amount,
            execution=1, overrun=entry.overrun, kind=entry.kind, tokens=dict(tokens),
        )

    def model_refusal(self, ledger: BudgetLedger, *, episode_id: str, step: int, query: str, model: str,
                      price: float | None, reason: str, text: str, status: Literal["rejected", "error"] = "rejected",
                      decision: Literal["reject", "accept"] = "reject") -> None:
        """A model call the budget did not cover (not made), or one that failed unbilled."""
        if self.sink is None:  # nothing is built for a guard with no log
            return
        self._write(
            ledger, task_id=episode_id, step=step, call_id=f"model:{episode_id}:{step}", query=query, tool=model,
            price=price, decision=decision, reason=reason, feedback=text, status=status, charged=0.0, kind="model",
        )

    def sub_budget(self, ledger: BudgetLedger, entry: LedgerEntry, *, episode_id: str, child_episode: str) -> None:
        """A sub-agent's carve closed: ``charged`` is what the sub-agent spent."""
        if self.sink is None:  # nothing is built for a guard with no log
            return
        self._write(
            ledger, task_id=episode_id, step=-1, call_id=entry.call_id, tool=entry.tool, price=entry.amount,
            decision="accept", reason="sub_agent", feedback=f"sub-agent episode {child_episode}", status="ok",
            charged=entry.amount if entry.status == "committed" else 0.0, execution=1, kind="sub_agent",
        )
