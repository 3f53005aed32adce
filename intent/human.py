"""Asking a human for money: the over-budget interrupt and its resume value.

With ``on_over_budget="ask"`` a call that does not fit (a tool call the guard or the oracle
refused for budget, or a model call whose worst case does not fit) pauses the run with a
LangGraph ``interrupt`` instead of being refused. The payload carries the call, its price,
spent, remaining, the shortfall, and the oracle's reason and plan estimate. The node re-runs
on resume and ``interrupt`` returns the human's answer; a top-up is a ledger event with a
deterministic id (so the re-run applies it once) and who approved it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from intent.errors import GuardConfigError
from intent.lineage import _CHECKPOINTER
from intent.market import InvalidPriceError, check_amount
from intent.oracle import OVER_BUDGET, Decision, DecisionContext

if TYPE_CHECKING:
    from intent.episodes import Episode
    from intent.guard import BudgetGuard

__all__ = ["HumanTopUps", "read_resume"]


class HumanTopUps:
    """The top-ups a human approves during one run of a node (the gate, or a model step).

    A node that is interrupted re-runs from its start on resume, and LangGraph hands each
    ``interrupt`` call its answer **by order**. So the re-run must reach the same interrupts in
    the same order: money approved earlier in an interrupted run must not make a call fit that
    asked before. :meth:`rollback` takes this run's new top-ups back out of the working ledger
    when the node is interrupted (they are re-applied, by the same ids, when the run replays the
    answers); :meth:`log` writes each new one once, when the node completes.
    """

    def __init__(self, guard: BudgetGuard, episode: Episode) -> None:
        self.guard, self.episode = guard, episode
        self.new: dict[str, tuple[float, str, str]] = {}  # id -> (amount, approved_by, reason)

    def ask(
        self, ctx: DecisionContext | None, decision: Decision | None, top_up_id: str, shortfall: float, *,
        kind: Literal["tool", "model"], model: str = "", price: float = 0.0, text: str = "",
    ) -> tuple[str, float]:
        """Pause the run with an interrupt; apply the human's answer. Returns (action, amount topped up).

        An answer that is not one of these pauses the run again, with the same payload and an ``error``
        saying what was wrong and how to answer. The resume value is ``{"action": "top_up", "amount": 5.0, "approved_by": "alice"}``,
        ``{"action": "approve_once", "approved_by": "alice"}`` (a top-up of exactly the
        shortfall, so this call fits) or ``{"action": "deny"}``.
        """
        from langgraph.types import interrupt

        _needs_a_checkpointer()
        ledger = self.episode.ledger
        plan = [s.to_dict() for s in decision.trace] if decision is not None else []
        payload = {
            "type": "intent.over_budget", "kind": kind,
            "tool": ctx.tool if ctx is not None else model, "args": dict(ctx.args) if ctx is not None else {},
            "price": ctx.price if ctx is not None else price, "spent": ledger.spent, "remaining": ledger.remaining,
            "budget": ledger.budget, "shortfall": shortfall,
            "reason": decision.reason if decision is not None else OVER_BUDGET,
            "feedback": decision.feedback if decision is not None else text,
            "plan_estimate": sum(float(s.get("expected_cost") or s.get("price") or 0.0) for s in plan),
            "plan": plan, "options": ["top_up", "approve_once", "deny"],
        }
        while True:
            answer = interrupt(payload)
            try:
                action, amount, approved_by = read_resume(answer, shortfall)
                if amount > 0 and math.isinf(ledger.budget + amount):  # the ledger would refuse it after the loop
                    raise InvalidPriceError(f"resume value 'amount' {amount:g} on a budget of {ledger.budget:g} "
                                            "makes it infinite; top up by a smaller amount")
                break
            except (GuardConfigError, InvalidPriceError) as exc:  # read_resume's two
                # Asked again, not raised: LangGraph keeps a resume value as its interrupt's answer for good,
                # so a raise here would replay the same bad answer on every later resume and brick the thread.
                # The next interrupt (the next index in this node) takes the corrected answer.
                payload = {**payload, "error": str(exc)}
        if amount > 0:
            with self.episode.lock:
                if top_up_id not in ledger.top_ups:
                    ledger.top_up(top_up_id, amount, approved_by=approved_by)
                    self.new[top_up_id] = (amount, approved_by, f"{action} for {payload['tool']}")
        return action, amount

    def rollback(self) -> None:
        with self.episode.lock:
            for top_up_id in self.new:
                self.episode.ledger.revoke_top_up(top_up_id)
        self.new.clear()

    def log(self) -> None:
        for top_up_id, (amount, approved_by, reason) in self.new.items():
            self.guard.records.top_up(self.episode.ledger, episode_id=self.episode.episode_id, top_up_id=top_up_id,
                                      amount=amount, reason=reason, approved_by=approved_by)
        self.new.clear()


def _needs_a_checkpointer() -> None:
    """Refuse to ask when the graph has no checkpointer: its interrupt could never be answered."""
    from langgraph.config import get_config

    try:
        configurable = get_config().get("configurable") or {}
    except RuntimeError:  # not inside a graph: interrupt() raises LangGraph's own error
        return
    if configurable.get(_CHECKPOINTER) is None:
        raise GuardConfigError(
            "on_over_budget='ask' pauses the run until a human answers, which needs a checkpointer: compile the "
            "agent with one (create_agent(..., checkpointer=InMemorySaver()), or graph.compile(checkpointer=...)), "
            "or use on_over_budget='refuse'")


def read_resume(answer: Any, shortfall: float) -> tuple[str, float, str]:
    """The human's resume value as (action, amount to top up, approved_by); a bad one is an error."""
    if not isinstance(answer, Mapping) or answer.get("action") not in ("top_up", "approve_once", "deny"):
        raise GuardConfigError(
            f"resume value {answer!r} is not an answer to intent.over_budget; resume with "
            "Command(resume={'action': 'top_up', 'amount': 5.0, 'approved_by': 'alice'}), "
            "{'action': 'approve_once', 'approved_by': ...} or {'action': 'deny'}")
    action = str(answer["action"])
    approved_by = str(answer.get("approved_by") or "")
    if action == "top_up":
        if "amount" not in answer:
            raise GuardConfigError("resume value with action 'top_up' needs 'amount' (> 0), e.g. {'amount': 5.0}")
        return action, check_amount(answer["amount"], "resume value 'amount'", allow_zero=False), approved_by
    if action == "approve_once":
        return action, shortfall, approved_by
    return action, 0.0, approved_by
