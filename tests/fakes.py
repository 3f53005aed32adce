"""Test doubles for our tests: the library's own (intent.testing) plus a few priced tools."""

from __future__ import annotations

from langchain_core.tools import tool

from intent.testing import ScriptedToolModel, ai, call, scripted  # noqa: F401 - re-exported


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
