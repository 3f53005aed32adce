"""Test doubles for our tests: the library's own (intent.testing) plus a few priced tools."""

from __future__ import annotations

from langchain_core.tools import StructuredTool, tool

from intent.testing import RunCounter, ScriptedToolModel, ai, call, scripted  # noqa: F401 - re-exported


@tool
def get_quote(symbol: str) -> str:
    """Stock quote for a ticker symbol."""
    return f'{{"symbol": "{symbol}", "price": 101.5}}'


@tool
def search_news(topic: str) -> str:
    """Latest news headlines about a topic."""
    return f'{{"topic": "{topic}", "headlines": ["a", "b"]}}'


@tool
def flaky(x: int) -> str:
    """A tool that always raises."""
    raise RuntimeError("upstream 503")


def priced_tools(runs: RunCounter, names: tuple[str, ...] = ("search", "fetch")) -> list[StructuredTool]:
    """Tools (sync and async) that count each run in ``runs`` where it happens and echo ``name:q``."""
    def make(name: str) -> StructuredTool:
        def run(q: str = "") -> str:
            runs.hit(name)
            return f"{name}:{q}"

        async def arun(q: str = "") -> str:
            runs.hit(name)
            return f"{name}:{q}"

        return StructuredTool.from_function(run, coroutine=arun, name=name, description=f"the {name} tool")

    return [make(n) for n in names]
