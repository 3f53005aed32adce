"""A budgeted deepagents agent: the recipe of README "Composing with other middleware", checked.

    pip install deepagents        # not a dependency of intent
    python examples/deepagents_budget.py

Scripted chat models (no provider, no network) play a main agent that uses deepagents' file tools,
its own priced tool ``a`` and the ``task`` tool, and a general-purpose sub-agent that calls ``a``.
The money is counted outside the guards: tool runs by a middleware inside each guard, model
executions inside the scripted models (each reports fixed usage). For each run the script prints
what the guard's ledger spent against that count, and checks: spent == counted <= budget, nothing
reserved at the end, every call answered once (main agent and sub-agent). Sync and async, with a
generous budget and a tight one (where the guards refuse calls).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import warnings
from collections import Counter
from typing import Any

try:
    from deepagents import create_deep_agent
except ImportError:  # an optional example: say how to get it, do not fail obscurely
    sys.exit("this example needs deepagents: pip install deepagents")

from langchain.agents.middleware import AgentMiddleware
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver

from intent import AcceptAll, BudgetGuard, FromParent, Market, ModelPrice, PricedTool
from intent.testing import ai, assert_each_call_answered_once, call, scripted

TOOL_PRICES = {"a": 2.0, "ls": 0.1, "read_file": 0.2, "write_file": 0.3, "edit_file": 0.3, "delete": 0.3,
               "glob": 0.1, "grep": 0.1, "execute": 1.0, "task": 0.5}
MODEL_PRICES = {"main-model": ModelPrice(input_per_mtok=10.0, output_per_mtok=20.0),
                "sub-model": ModelPrice(input_per_mtok=10.0, output_per_mtok=10.0)}
MAIN_USAGE, SUB_USAGE = (1000, 200), (500, 100)
MAIN_COST, SUB_COST = (1000 * 10 + 200 * 20) / 1e6, (500 * 10 + 100 * 10) / 1e6


class CountRuns(AgentMiddleware):
    """Listed after a guard, so it sees only the calls the guard lets run; keeps the final history."""

    def __init__(self, who: str, runs: Counter, finals: list) -> None:
        super().__init__()
        self.who, self.runs, self.finals, self._lock = who, runs, finals, threading.Lock()

    @property
    def name(self) -> str:
        return f"CountRuns_{self.who}"

    def wrap_tool_call(self, request: Any, handler: Any) -> Any:
        with self._lock:
            self.runs[request.tool_call["name"]] += 1
        return handler(request)

    async def awrap_tool_call(self, request: Any, handler: Any) -> Any:
        with self._lock:
            self.runs[request.tool_call["name"]] += 1
        return await handler(request)

    def after_agent(self, state: Any, runtime: Any) -> None:
        self.finals.append(list(state["messages"]))

    async def aafter_agent(self, state: Any, runtime: Any) -> None:
        self.finals.append(list(state["messages"]))


def tool_a() -> StructuredTool:
    return StructuredTool.from_function(lambda x=0: f"a={x}", name="a", description="A priced tool.")


def run(use_async: bool, budget: float, limit: float) -> bool:
    runs: Counter = Counter()
    finals: list = []
    market = Market([PricedTool(n, p) for n, p in TOOL_PRICES.items()])
    guard = BudgetGuard(AcceptAll(), market, budget, model_prices=MODEL_PRICES)
    child = BudgetGuard(AcceptAll(), market, FromParent(limit=limit), model_prices=MODEL_PRICES)
    main_model = scripted([
        ai(call("ls", path="/"), call("write_file", file_path="/a.txt", content="hello"), call("a", x=1),
           usage=MAIN_USAGE, model_name="main-model"),
        ai(call("read_file", file_path="/a.txt"), call("grep", pattern="hello"), usage=MAIN_USAGE,
           model_name="main-model"),
        ai(call("task", description="do the sub work", subagent_type="general-purpose"), usage=MAIN_USAGE,
           model_name="main-model"),
        ai(call("a", x=2), usage=MAIN_USAGE, model_name="main-model"),
        ai(text="done", usage=MAIN_USAGE, model_name="main-model"),
    ], model_name="main-model")
    sub_model = scripted([
        ai(call("a", x=10), call("write_file", file_path="/sub.txt", content="x"), usage=SUB_USAGE,
           model_name="sub-model"),
        ai(call("a", x=11), usage=SUB_USAGE, model_name="sub-model"),
        ai(text="sub-agent done", usage=SUB_USAGE, model_name="sub-model"),
    ], model_name="sub-model")
    agent = create_deep_agent(
        model=guard.metered_model(main_model),  # deepagents' summariser calls it outside the guard's step
        tools=[tool_a()], middleware=[guard.middleware(), CountRuns("main", runs, finals)],
        subagents=[{"name": "general-purpose", "description": "does sub work", "system_prompt": "work",
                    "model": child.metered_model(sub_model), "tools": [tool_a()],
                    "middleware": [child.middleware(), CountRuns("sub", runs, finals)]}],
        checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": f"deep-{use_async}-{budget}"}}
    inp = {"messages": [("user", "go")]}
    out = asyncio.run(agent.ainvoke(inp, config)) if use_async else agent.invoke(inp, config)
    ledger = guard.ledger(out)
    counted = (sum(TOOL_PRICES[n] * k for n, k in runs.items()) + len(main_model.executions) * MAIN_COST
               + len(sub_model.executions) * SUB_COST)
    for history in [*finals, out["messages"]]:
        assert_each_call_answered_once(history)
    ok = abs(ledger.spent - counted) < 1e-9 and ledger.spent <= budget + 1e-9 and ledger.reserved == 0
    print(f"{'async' if use_async else 'sync ':5} budget {budget:5.1f} sub-agent limit {limit:4.1f}: "
          f"spent {ledger.spent:.4f}, counted {counted:.4f}, reserved {ledger.reserved:.1f}, "
          f"tool runs {dict(sorted(runs.items()))} -> {'ok' if ok else 'BROKEN'}")
    return ok


def main() -> int:
    warnings.simplefilter("ignore")  # deepagents' own deprecation notices
    results = [run(use_async, budget, limit) for use_async in (False, True) for budget, limit in ((50.0, 10.0),
                                                                                                   (6.0, 2.5))]
    print("every run: spent == counted <= budget, nothing reserved, each call answered once" if all(results)
          else "SOME RUNS BROKE AN INVARIANT")
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
