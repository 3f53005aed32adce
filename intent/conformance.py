"""Conformance checks every oracle must pass (run them in your oracle's tests).

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
"""

from __future__ import annotations

from intent.testing import CountingTool, check_oracle

__all__ = ["CountingTool", "check_oracle"]
