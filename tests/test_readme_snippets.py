"""The README's Python snippets, read from the README itself and run with the fakes of intent.testing standing in
for the names a snippet leaves to the reader (`model`, `tools`, `oracle`, `saver`): a renamed argument or a moved
import in the code, or a snippet edited out of step with it, fails here."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver

from intent import AcceptAll, JsonlLogSink
from intent.testing import ai, assert_each_call_answered_once, call, scripted

README = Path(__file__).resolve().parents[1] / "README.md"


def snippet(first_line: str) -> str:
    """The README's ```python block whose first line is ``first_line`` (exactly one must be)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    found = [b for b in blocks if b.splitlines()[0].strip() == first_line]
    assert len(found) == 1, f"{len(found)} README snippets start with {first_line!r}"
    return found[0]


def priced_tool(name: str, price: float | None = None) -> StructuredTool:
    metadata = None if price is None else {"price": price, "currency": "USD"}
    return StructuredTool.from_function(lambda q="": f"{name}: {q}", name=name, description=name, metadata=metadata)


def test_the_first_use_snippet_runs_and_its_ledger_reads_as_the_comment_says():
    ns: dict[str, Any] = {
        "tools": [priced_tool("get_quote"), priced_tool("search_news")],
        "model": scripted([ai(call("get_quote", q="A"), call("search_news", q="A")), ai(call("get_quote", q="B")),
                           AIMessage("done")]),
    }
    exec(snippet("from langchain.agents import create_agent"), ns)
    ledger = ns["guard"].ledger(ns["out"])
    assert re.fullmatch(r"BudgetLedger\(budget=50, spent=29, reserved=0\)", repr(ledger))  # 12 + 5 + 12
    assert_each_call_answered_once(ns["out"]["messages"])


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_the_hand_built_graph_snippet_as_the_readme_has_it(use_async):
    from intent import BudgetGuard, Market, PricedTool

    ns: dict[str, Any] = {
        "tools": [priced_tool("get_quote"), priced_tool("search_news")],
        "model": scripted([ai(call("get_quote", q="A"), call("get_quote", q="B"), call("search_news", q="C")),
                           AIMessage("done")]),
        "guard": BudgetGuard(AcceptAll(), Market([PricedTool("get_quote", 12.0), PricedTool("search_news", 5.0)]),
                             25.0),
    }
    exec(snippet("from langgraph.graph import END, START, StateGraph"), ns)
    graph = ns["g"].compile(checkpointer=InMemorySaver())
    inp, config = {"messages": [("user", "go")]}, {"configurable": {"thread_id": "t"}}
    out = asyncio.run(graph.ainvoke(inp, config)) if use_async else graph.invoke(inp, config)
    ledger = ns["guard"].ledger(out)
    assert (ledger.spent, ledger.reserved) == (24.0, 0.0)  # A and B run (in order); C (5 more) does not fit 25
    assert_each_call_answered_once(out["messages"])
    assert len(ns["guard"].episodes) == 0  # guard.finish ran: the episode's working state is dropped


def test_the_one_budget_snippet_charges_tokens_and_tools_into_one_ledger():
    from langchain.agents import create_agent

    tools = [priced_tool("web_search", 0.02), priced_tool("fetch_page", 0.01)]
    ns: dict[str, Any] = {
        "tools": tools, "oracle": AcceptAll(), "saver": InMemorySaver(), "state": {}, "create_agent": create_agent,
        "model": scripted([ai(call("web_search", q="x"), usage=(1000, 100)), ai(text="done", usage=(2000, 100))],
                          model_name="gpt-4o-mini"),
    }
    exec(snippet("from intent import Budget, BudgetGuard, FromParent, Market, ModelPrice, ModelPrices"), ns)
    out = ns["agent"].invoke({"messages": [("user", "q")]}, {"configurable": {"thread_id": "t"}})
    by_kind = ns["guard"].ledger(out).spent_by_kind()
    assert by_kind == pytest.approx({"model": (3000 * 0.15 + 200 * 0.60) / 1e6, "tool": 0.02})


def test_the_shared_budget_snippet_runs(tmp_path, monkeypatch):
    from intent import BudgetGuard, Market, PricedTool

    monkeypatch.chdir(tmp_path)
    ns: dict[str, Any] = {"oracle": AcceptAll(), "market": Market([PricedTool("a", 1.0)]), "BudgetGuard": BudgetGuard}
    exec(snippet("from intent.stores import SqliteBudgetStore, PostgresBudgetStore, period_key"), ns)
    assert (ns["store"].spent(ns["key"]), ns["store"].reserved(ns["key"])) == (0.0, 0.0)
    assert ns["guard"].budget == 5.0 and (tmp_path / "budgets.db").exists()


def test_the_writing_your_own_store_snippet_runs_the_conformance_suite():
    import textwrap

    from intent.stores import MemoryBudgetStore

    made = []

    def stand_in(url, **kwargs):  # (a Redis store's constructor: here the memory store, with what it was given)
        made.append(kwargs)
        return MemoryBudgetStore(**kwargs)

    ns: dict[str, Any] = {"RedisBudgetStore": stand_in, "REDIS_URL": "redis://localhost/0"}
    exec(textwrap.dedent(snippet("from intent.conformance import check_budget_store")), ns)
    ns["test_my_store_keeps_the_money_guarantees"]()
    assert made and all(set(kw) == {"lease_seconds", "clock"} for kw in made)


def test_the_baselines_snippet_builds_a_tracker_and_btp_from_the_guards_log(tmp_path, monkeypatch):
    from langchain.agents import create_agent

    from intent import BudgetGuard, Market, PricedTool

    monkeypatch.chdir(tmp_path)
    market = Market([PricedTool("get_quote", 12.0)])
    logged = BudgetGuard(AcceptAll(), market, 20.0, log_sink=JsonlLogSink("run.jsonl"))
    create_agent(scripted([ai(call("get_quote", q="A")), AIMessage("done")]), [priced_tool("get_quote")],
                 middleware=[logged.middleware()]).invoke({"messages": [("user", "q")]})
    ns: dict[str, Any] = {"BudgetGuard": BudgetGuard, "market": market}
    exec(snippet("from baselines.prompt import PromptOracle"), ns)
    assert type(ns["guard"].oracle).__name__ == "BTPOracle" and ns["guard"].enforce


def test_the_planning_oracles_snippet_builds_intent_from_its_parts(monkeypatch):
    # The snippet loads a trained predictor from runs/predictor; a stand-in takes its place (the class is looked up
    # by the snippet's own import), so the imports, the constructors' arguments and the guard are the README's.
    import worldmodel.predictors
    from intent import BudgetGuard, Market, PricedTool
    from intent.oracles import IntentOracle
    from worldmodel.openai_compat import OpenAICompatibleWorldModel

    class TrainedPredictor:
        def __init__(self, model_dir):
            self.model_dir = model_dir

        def predict(self, reasoning, tool, args):
            return 0.5

        def predict_batch(self, items):
            return [0.5 for _ in items]

    monkeypatch.setattr(worldmodel.predictors, "EncoderIntentionPredictor", TrainedPredictor)
    ns: dict[str, Any] = {
        "BudgetGuard": BudgetGuard, "market": Market([PricedTool("get_quote", 12.0)]), "SYSTEM": "You are an agent.",
        "tools": [priced_tool("get_quote")], "model": scripted([AIMessage("done")]),
    }
    exec(snippet("from intent.oracles import IntentOracle, MCOOracle"), ns)
    oracle = ns["guard"].oracle
    assert isinstance(oracle, IntentOracle) and ns["guard"].budget == 50.0
    assert isinstance(ns["generator"], OpenAICompatibleWorldModel) and ns["generator"].temperature == 0.3
    assert ns["predictor"].model_dir == "runs/predictor"


def test_the_deepagents_snippet_builds_a_guarded_agent_and_sub_agent():
    # deepagents is not a dependency (examples/deepagents_budget.py runs the recipe with it): a stand-in for
    # create_deep_agent takes what the snippet gives it, so the guard, the child guard and the market are built as
    # the README has them.
    from intent import BudgetGuard, FromParent, Market, ModelPrice, PricedTool

    given: dict[str, Any] = {}

    def create_deep_agent(**kwargs):
        given.update(kwargs)
        return "agent"

    model = scripted([AIMessage("done")], model_name="gpt-4o-mini")
    ns: dict[str, Any] = {
        "BudgetGuard": BudgetGuard, "FromParent": FromParent, "Market": Market, "PricedTool": PricedTool,
        "create_deep_agent": create_deep_agent, "oracle": AcceptAll(), "model": model, "saver": InMemorySaver(),
        "web_search": priced_tool("web_search"), "fetch_page": priced_tool("fetch_page"),
        "prices": {"gpt-4o-mini": ModelPrice(input_per_mtok=0.15, output_per_mtok=0.60)},
    }
    exec(snippet("tools = [web_search, fetch_page]                 # your LangChain tools; the market prices them "
                 "by name"), ns)
    guard, child = ns["guard"], ns["child"]
    assert isinstance(child.budget_spec, FromParent) and ns["market"].price("task") == 0.0
    assert given["middleware"][0].guard is guard
    (sub,) = given["subagents"]
    assert sub["name"] == "general-purpose" and sub["middleware"][0].guard is child
