"""The one exception tree of ``intent``.

Catch :class:`IntentError` to catch everything the library raises on purpose::

    IntentError
    ├── MarketError (ValueError)          a market or a price is wrong
    │   ├── InvalidPriceError             negative, NaN or infinite price / budget
    │   └── UnpricedToolError (KeyError)  a tool with no price and no default
    ├── LedgerError (RuntimeError)        a money operation the ledger cannot do
    │   └── BudgetExceededError           a reservation that does not fit
    ├── InvalidDecisionError (TypeError)  an oracle returned something that is not a Decision
    └── GuardConfigError (ValueError, TypeError)  a BudgetGuard built with a bad argument

A tool's own exception is never wrapped: the guard charges the run and re-raises it
unchanged (``tool_errors="raise"``), so retries and ``handle_tool_errors`` see what they
would see without the guard.
"""

from __future__ import annotations

__all__ = ["GuardConfigError", "IntentError"]


class IntentError(Exception):
    """Base class of every error ``intent`` raises on purpose."""


class GuardConfigError(IntentError, ValueError, TypeError):
    """A :class:`~intent.BudgetGuard` argument is invalid; the message names it and the fix."""
