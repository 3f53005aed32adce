"""Test doubles shared by the tests: a scripted tool-calling chat model and priced tools."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langchain_core.tools import tool


class ScriptedToolModel(GenericFakeChatModel):
    """GenericFakeChatModel plays a fixed list of AIMessages; it lacks bind_tools, so add it.

    ``bound`` records the tool names of every bind_tools call (what the model was shown).
    """

    bound: list = []

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> "ScriptedToolModel":
        self.bound.append(sorted(t["name"] if isinstance(t, dict) else t.name for t in tools))
        return self


def scripted(messages: Iterable[AIMessage]) -> ScriptedToolModel:
    return ScriptedToolModel(messages=iter(list(messages)), bound=[])


_ids = itertools.count()


def call(name: str, **args: Any) -> dict[str, Any]:
    return {"name": name, "args": args, "id": f"call_{next(_ids)}", "type": "tool_call"}


def ai(*calls: dict[str, Any], text: str = "") -> AIMessage:
    return AIMessage(content=text, tool_calls=list(calls))


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
