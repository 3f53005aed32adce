"""Conformance checks every oracle and every shared-budget store must pass (run them in your own tests).

``check_oracle(factory)`` takes a zero-argument factory returning a fresh oracle and checks:

1. ``decide`` and ``adecide`` return :class:`~intent.Decision` objects, and its hooks accept the documented
   arguments and return what the guard uses (``visible_tools``: ``None`` or a list of names, not a str;
   ``prompt_notes`` / ``result_note``: a str or ``None``);
2. under a :class:`~intent.BudgetGuard`, through the guard's real gate and tool step, with
   adversarial proposals (every turn proposes every tool in parallel, more than the budget):

   * the money of the tool runs **counted inside the tools themselves** (runs x price, never
     read back from the guard) never exceeds the budget;
   * the ledger charged exactly that money (nothing unpaid, nothing paid twice), also on the
     turns where another middleware answers a call without running it (a cache, a limit);
   * after the episode nothing is still reserved;
   * every proposed call got exactly one ToolMessage.

The facts are observed independently of the guard's bookkeeping, so a guard that charged
nothing, charged twice, let a call through unpaid or dropped an answer fails the check.

``check_budget_store(factory, *, clock="manual", threads=8, processes=0)`` checks a store of your own (Redis,
DynamoDB, a company ledger service) against :class:`intent.stores.BudgetStore`: ``factory(lease_seconds=...,
clock=...)`` makes one (the shipped classes are factories as they are). It checks every documented property, each
failure an ``AssertionError`` that starts with the property in brackets: ``create_budget`` idempotent and refused
with another amount; ``left == budget - spent - reserved`` with exact amounts; ``reserve`` holds what fits, raises
``BudgetExceededError`` and changes nothing when it does not, always fits a hold of 0, is idempotent by charge id;
``commit`` at, below and above the hold, idempotent, refused after a release; ``release`` once, never of a
committed charge; leases that expire (the suite moves the :class:`~intent.stores.conformance.ManualClock` it gives
the factory, or waits with ``clock="real"``), late commits charged and flagged, ``renew``; keys isolated;
``charges``; threads (and with ``processes`` > 0, worker processes) at the budget's edge that never overspend,
counted by the workers themselves; and, only when the store has them, ``currency``, ``rekey`` and ``prune``. The
full list: :mod:`intent.stores.conformance`.
"""

from __future__ import annotations

from intent.stores.conformance import ManualClock, check_budget_store
from intent.testing import CountingTool, check_oracle

__all__ = ["CountingTool", "ManualClock", "check_budget_store", "check_oracle"]
