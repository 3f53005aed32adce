"""``intent demo``: a scripted agent with priced tools under the guard.

Everything here is simulated (a scripted chat model and canned tool outputs) so that it
runs anywhere without API keys; it shows each decision and the ledger after the run.
"""

from __future__ import annotations

from typing import Any

from langchain_core.messages import AIMessage
from langchain_core.tools import StructuredTool

from intent.guard import BudgetGuard
from intent.logs import MemoryLogSink
from intent.market import Market, PricedTool
from intent.oracle import Decision, DecisionContext, Oracle
from intent.testing import scripted

__all__ = ["run_demo"]


class CheapestFirst(Oracle):
    """A toy oracle for the demo: reject a call when a listed alternative covering the same
    need is cheaper. (The real planning oracles are INTENT and MCO.)"""

    name = "cheapest_first"

    def __init__(self, alternatives: dict[str, list[str]]) -> None:
        self.alternatives = alternatives

    def decide(self, ctx: DecisionContext) -> Decision:
        cheaper = [a for a in self.alternatives.get(ctx.tool, []) if a in ctx.market and ctx.market.price(a) < ctx.price]
        if cheaper:
            return Decision.rejected(
                f"{ctx.tool} costs {ctx.price:g}; {cheaper[0]} covers the same need for {ctx.market.price(cheaper[0]):g}. "
                "Use it instead.",
                reason="cheaper_alternative",
            )
        return Decision.accepted()


def _tool(name: str, output: str, fails: bool = False) -> StructuredTool:
    def run(query: str) -> str:
        if fails:
            raise RuntimeError("503 Service Unavailable")
        return output.format(query=query)

    return StructuredTool.from_function(run, name=name, description=f"(simulated) {name}")


def _call(name: str, cid: str, query: str) -> dict[str, Any]:
    return {"name": name, "args": {"query": query}, "id": cid, "type": "tool_call"}


def run_demo(budget: float = 50.0, *, console: Any = None) -> dict[str, Any]:
    from langchain.agents import create_agent
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=130)
    market = Market([
        PricedTool("weather_premium", 30, "reliable weather forecast"),
        PricedTool("weather_basic", 8, "cheap weather forecast"),
        PricedTool("stock_quote", 12, "stock quote"),
        PricedTool("news_search", 15, "news headlines"),
        PricedTool("flaky_geo", 5, "geocoder that is often down"),
    ])
    tools = [
        _tool("weather_premium", '{{"city": "{query}", "forecast": "rain", "source": "premium"}}'),
        _tool("weather_basic", '{{"city": "{query}", "forecast": "rain"}}'),
        _tool("stock_quote", '{{"symbol": "{query}", "price": 101.5}}'),
        _tool("news_search", '{{"topic": "{query}", "headlines": ["ACME beats estimates"]}}'),
        _tool("flaky_geo", "", fails=True),
    ]
    script = [
        AIMessage("I will get the weather and the quote in parallel.", tool_calls=[
            _call("weather_premium", "c1", "Oslo"), _call("stock_quote", "c2", "ACME")]),
        AIMessage("The premium source was refused; use the basic one and locate the city.", tool_calls=[
            _call("weather_basic", "c3", "Oslo"), _call("flaky_geo", "c4", "Oslo")]),
        AIMessage("Now the news, twice to be sure.", tool_calls=[
            _call("news_search", "c5", "ACME"), _call("news_search", "c6", "ACME stock")]),
        AIMessage("Oslo: rain. ACME trades at 101.5 after beating estimates."),
    ]
    sink = MemoryLogSink()
    # tool_errors="message": the flaky geocoder's failure is shown to the agent (and charged)
    # instead of ending the run, as ToolNode's error handling would in an application.
    guard = BudgetGuard(CheapestFirst({"weather_premium": ["weather_basic"]}), market, budget, log_sink=sink,
                        tool_errors="message")
    agent = create_agent(scripted(script), tools, middleware=[guard.middleware()])
    console.print(f"[bold]intent demo[/bold] — scripted agent and canned tool outputs (simulated); budget {budget:g}")
    out = agent.invoke({"messages": [("user", "Weather in Oslo and how is ACME doing?")]},
                       {"configurable": {"thread_id": "demo"}})

    table = Table(title="Guard decisions (in order)")
    for col in ("step", "call", "tool", "price", "decision", "reason", "charged", "spent", "remaining"):
        table.add_column(col)
    for r in sorted(sink.records, key=lambda r: (r.step, r.call_id)):
        table.add_row(str(r.step), r.call_id, r.tool, f"{r.price:g}" if r.price is not None else "-", r.decision,
                      r.reason, f"{r.charged:g}", f"{r.spent:g}", f"{r.remaining:g}")
    console.print(table)
    for r in sink.records:
        if r.decision != "accept":
            console.print(f"  feedback to agent on {r.call_id}: {r.feedback}")
    ledger = guard.ledger(out)
    console.print(f"Ledger: {ledger}  (remaining {ledger.remaining:g})")
    console.print(f"Final answer: {out['messages'][-1].content}")
    return {"spent": ledger.spent, "remaining": ledger.remaining, "records": sink.records}
