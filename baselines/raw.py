"""Raw: no cost information and no gate. Benchmark only (run it with ``enforce=False``)."""

from __future__ import annotations

from intent.oracle import Decision, DecisionContext, Oracle


class RawOracle(Oracle):
    """Accepts everything and tells the agent nothing about prices.

    Under ``BudgetGuard(..., enforce=False)`` the agent may overspend; the ledger records it.
    """

    name = "raw"
    enforce = False

    def decide(self, ctx: DecisionContext) -> Decision:
        return Decision.accepted()
