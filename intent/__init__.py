"""intent: inference-time budget planning for LLM agents.

A :class:`BudgetGuard` sees every priced tool call before it runs; a pluggable
:class:`Oracle` accepts it or sends the agent feedback to re-plan, and the
:class:`BudgetLedger` guarantees that a hard money budget is never exceeded.

``import intent`` stays light: no torch, transformers or vllm.
"""

from intent.guard import LEDGER_KEY, BudgetGuard, GuardState
from intent.ledger import BudgetExceededError, BudgetLedger, LedgerEntry, LedgerError
from intent.logs import SCHEMA_VERSION, JsonlLogSink, MemoryLogSink, StepRecord, read_log
from intent.market import InvalidPriceError, Market, MarketError, PricedTool, UnpricedToolError
from intent.oracle import (
    AcceptAll,
    Decision,
    DecisionContext,
    EpisodeInfo,
    InvalidDecisionError,
    Oracle,
    Outcome,
    PlannedStep,
    Proposal,
)

__version__ = "0.1.0"


def guard_react_agent(*args, **kwargs):  # noqa: ANN002, ANN003 - see intent.graph.guard_react_agent
    """A compiled LangGraph ReAct agent with the guard between the agent and its tools."""
    from intent.graph import guard_react_agent as _build

    return _build(*args, **kwargs)


__all__ = [
    "LEDGER_KEY",
    "SCHEMA_VERSION",
    "AcceptAll",
    "BudgetExceededError",
    "BudgetGuard",
    "BudgetLedger",
    "Decision",
    "DecisionContext",
    "EpisodeInfo",
    "GuardState",
    "InvalidDecisionError",
    "InvalidPriceError",
    "JsonlLogSink",
    "LedgerEntry",
    "LedgerError",
    "Market",
    "MarketError",
    "MemoryLogSink",
    "Oracle",
    "Outcome",
    "PlannedStep",
    "PricedTool",
    "Proposal",
    "StepRecord",
    "UnpricedToolError",
    "guard_react_agent",
    "read_log",
]
