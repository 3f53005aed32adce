"""One money budget over an agent's model tokens and its priced tools, offline.

A stub chat model that reports token usage (as a provider does), two tools that declare their
own prices in their metadata, a sub-agent that spends only what its parent has left, and one
human top-up through a LangGraph interrupt. Run it: ``python examples/unified_budget.py``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from langchain.agents import create_agent
from langchain_core.messages import HumanMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from intent import AcceptAll, Budget, BudgetGuard, FromParent, JsonlLogSink, Market, ModelPrice, budget_report
from intent.testing import ai, call, scripted

PRICES = {"stub-model": ModelPrice(input_per_mtok=3.0, output_per_mtok=15.0)}  # USD per million tokens


def priced_tool(name: str, price: float) -> StructuredTool:
    # The price comes with the tool (LangChain tool metadata), not from a hand-written table.
    return StructuredTool.from_function(lambda query: f"{name} results for {query!r}", name=name,
                                        description=f"{name} (costs {price} USD)",
                                        metadata={"price": price, "currency": "USD"})


search, fetch = priced_tool("search", 0.02), priced_tool("fetch_report", 0.08)


def research(topic: str) -> str:
    """A sub-agent: it runs under a child budget carved from what the parent has left."""
    child = BudgetGuard(AcceptAll(), Market.from_tools([search, fetch]), FromParent(limit=0.10),
                        model_prices=PRICES, max_output_tokens=256, log_sink=SINK)
    model = scripted([ai(call("search", query=topic), usage=(40, 20)),
                      ai(text=f"summary of {topic}", usage=(90, 60))], model_name="stub-model")
    agent = create_agent(model, [search, fetch], middleware=[child.middleware()])
    out = agent.invoke({"messages": [HumanMessage(topic)]}, {"configurable": {"thread_id": f"sub-{topic}"}})
    return str(out["messages"][-1].content)


delegate = StructuredTool.from_function(research, name="research", description="delegate to a sub-agent",
                                        metadata={"price": 0.0, "currency": "USD"})

LOG_DIR = Path(tempfile.mkdtemp(prefix="intent-unified-"))
SINK = JsonlLogSink(LOG_DIR / "log.jsonl")


def main() -> int:
    market = Market.from_tools([search, fetch, delegate], currency="USD")
    guard = BudgetGuard(AcceptAll(), market, Budget(total=0.20, currency="USD"), model_prices=PRICES,
                        max_output_tokens=256, on_over_budget="ask", log_sink=SINK)
    model = scripted([
        ai(call("search", query="battery prices"), usage=(60, 30)),
        ai(call("research", topic="supply chain"), usage=(140, 30)),
        ai(call("fetch_report", query="Q3"), usage=(220, 30)),
        ai(call("fetch_report", query="Q4"), usage=(300, 30)),  # does not fit: a human is asked
        ai(text="Battery prices fell 12% (Q3, Q4 reports).", usage=(420, 40)),
    ], model_name="stub-model")
    agent = create_agent(model, [search, fetch, delegate], middleware=[guard.middleware()],
                         checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "unified-demo"}}
    out = agent.invoke({"messages": [HumanMessage("How did battery prices move?")]}, config)
    while out.get("__interrupt__"):
        ask = out["__interrupt__"][0].value
        print(f"guard asks: {ask['tool']} costs {ask['price']:.4f}, {ask['remaining']:.4f} left "
              f"(shortfall {ask['shortfall']:.4f}) -> alice approves a top-up of 0.10")
        out = agent.invoke(Command(resume={"action": "top_up", "amount": 0.10, "approved_by": "alice"}), config)
    ledger = guard.ledger(out)
    print(f"answer: {out['messages'][-1].content}")
    print(f"budget {ledger.base_budget:.2f} + top-ups {sum(ledger.top_ups.values()):.2f}; "
          f"spent {ledger.spent:.6f} ({', '.join(f'{k} {v:.6f}' for k, v in sorted(ledger.spent_by_kind().items()))}); "
          f"reserved {ledger.reserved:.6f}")
    assert ledger.spent <= ledger.budget and ledger.reserved == 0
    report = budget_report(LOG_DIR / "log.jsonl")
    print(report.to_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
