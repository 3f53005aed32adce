"""intent: inference-time budget planning for LLM agents.

A :class:`BudgetGuard` sees every priced tool call before it runs; a pluggable
:class:`Oracle` accepts it or sends the agent feedback to re-plan, and the
:class:`BudgetLedger` guarantees that a hard money budget is never exceeded.

``import intent`` is lazy: names load on first use, so ``import intent.market`` does not
pull in LangGraph, and nothing here needs torch, transformers or vllm.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "LEDGER_KEY": "intent.state",
    "GuardState": "intent.state",
    "Budget": "intent.budget",
    "FromParent": "intent.nesting",
    "ModelPrice": "intent.pricing",
    "ModelPrices": "intent.pricing",
    "UnpricedModelError": "intent.pricing",
    "budget_report": "intent.report",
    "BudgetGuard": "intent.guard",
    "BudgetExceededError": "intent.ledger",
    "BudgetLedger": "intent.ledger",
    "LedgerEntry": "intent.ledger",
    "LedgerError": "intent.ledger",
    "MeteredModelRefused": "intent.metered_models",
    "ModelCallRefused": "intent.model_meter",
    "ContextOverflowError": "intent.errors",
    "GuardConfigError": "intent.errors",
    "IntentError": "intent.errors",
    "InvalidBillError": "intent.errors",
    "UnpricedToolWarning": "intent.errors",
    "UsageError": "intent.errors",
    "SCHEMA_VERSION": "intent.logs",
    "JsonlLogSink": "intent.logs",
    "MemoryLogSink": "intent.logs",
    "StepRecord": "intent.logs",
    "read_log": "intent.logs",
    "InvalidPriceError": "intent.market",
    "Market": "intent.market",
    "MarketError": "intent.market",
    "PricedTool": "intent.market",
    "UnpricedToolError": "intent.market",
    "AcceptAll": "intent.oracle",
    "Decision": "intent.oracle",
    "DecisionContext": "intent.oracle",
    "EpisodeInfo": "intent.oracle",
    "InvalidDecisionError": "intent.oracle",
    "Oracle": "intent.oracle",
    "Outcome": "intent.oracle",
    "PlannedStep": "intent.oracle",
    "Proposal": "intent.oracle",
    "guard_react_agent": "intent.react",
    "BudgetState": "intent.middleware",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'intent' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    # `X as X`: an explicit re-export for type checkers and linters (the names load lazily above).
    from intent.budget import Budget as Budget
    from intent.errors import (
        ContextOverflowError as ContextOverflowError,
        GuardConfigError as GuardConfigError,
        IntentError as IntentError,
        InvalidBillError as InvalidBillError,
        UnpricedToolWarning as UnpricedToolWarning,
        UsageError as UsageError,
    )
    from intent.nesting import FromParent as FromParent
    from intent.pricing import (
        ModelPrice as ModelPrice,
        ModelPrices as ModelPrices,
        UnpricedModelError as UnpricedModelError,
    )
    from intent.report import budget_report as budget_report
    from intent.react import guard_react_agent as guard_react_agent
    from intent.middleware import BudgetState as BudgetState
    from intent.guard import BudgetGuard as BudgetGuard
    from intent.ledger import (
        BudgetExceededError as BudgetExceededError,
        BudgetLedger as BudgetLedger,
        LedgerEntry as LedgerEntry,
        LedgerError as LedgerError,
    )
    from intent.logs import (
        SCHEMA_VERSION as SCHEMA_VERSION,
        JsonlLogSink as JsonlLogSink,
        MemoryLogSink as MemoryLogSink,
        StepRecord as StepRecord,
        read_log as read_log,
    )
    from intent.metered_models import MeteredModelRefused as MeteredModelRefused
    from intent.model_meter import ModelCallRefused as ModelCallRefused
    from intent.market import (
        InvalidPriceError as InvalidPriceError,
        Market as Market,
        MarketError as MarketError,
        PricedTool as PricedTool,
        UnpricedToolError as UnpricedToolError,
    )
    from intent.oracle import (
        AcceptAll as AcceptAll,
        Decision as Decision,
        DecisionContext as DecisionContext,
        EpisodeInfo as EpisodeInfo,
        InvalidDecisionError as InvalidDecisionError,
        Oracle as Oracle,
        Outcome as Outcome,
        PlannedStep as PlannedStep,
        Proposal as Proposal,
    )
    from intent.state import LEDGER_KEY as LEDGER_KEY, GuardState as GuardState
