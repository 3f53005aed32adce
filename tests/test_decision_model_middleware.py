"""The guard composed with LangChain's decision-model middleware (langchain 1.5, langchain-core 1.8):
AutoModeMiddleware and ModelRouterMiddleware with fake classifiers, the checks of test_probe_more_middleware.py.

Older releases, down to the declared floor (langchain 1.4.4), have no such middleware: the module is skipped there.
"""

from __future__ import annotations

from typing import Any

import langchain.agents.middleware as langchain_middleware
import pytest

if not hasattr(langchain_middleware, "ModelRouterMiddleware"):
    pytest.skip("langchain<1.5: no decision-model middleware (AutoModeMiddleware, ModelRouterMiddleware)",
                allow_module_level=True)

from langchain.agents import create_agent  # noqa: E402
from langchain.agents.middleware import AutoModeMiddleware, ModelChoice, ModelRouterMiddleware  # noqa: E402
from langchain_core.decisions import BaseDecisionModel  # noqa: E402
from langchain_core.decisions.types import ChoiceAnswer, ClassifierResponse, NoulAnswer  # noqa: E402
from langchain_core.messages import AIMessage  # noqa: E402
from langgraph.checkpoint.memory import InMemorySaver  # noqa: E402
from test_probe_more_middleware import (  # noqa: E402
    GATES,
    MODES,
    ORDERS,
    USER,
    check,
    config,
    guard_for,
    invoke,
    make_tool,
    stack,
    tc,
)

from intent.testing import RunCounter, scripted  # noqa: E402


# ============================================== decision-model middleware (fake classifiers)
class _Risky(BaseDecisionModel):
    model: str = "fake-risk"

    @property
    def _provider(self) -> str:
        return "fake"

    def _classify(self, state: Any, questions: Any) -> ClassifierResponse:
        p = 0.9 if state["tool_call"]["args"].get("x") == "risky" else 0.1
        return ClassifierResponse(model=self.model, answers={"is_risky": NoulAnswer(type="noul", noul=p)})


class _Route(BaseDecisionModel):
    model: str = "fake-route"

    @property
    def _provider(self) -> str:
        return "fake"

    def _classify(self, state: Any, questions: Any) -> ClassifierResponse:
        qid = next(iter(questions))
        return ClassifierResponse(model=self.model, answers={qid: ChoiceAnswer(
            type="choice", choice="big", probabilities={"big": 1.0}, confidence=1.0)})


@pytest.mark.parametrize("gate_at", GATES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_auto_mode_blocked_calls_are_released_never_charged(order, mode, gate_at):
    prices = {"a": 4.0, "b": 3.0}
    runs = RunCounter()
    guard, sink = guard_for(prices, 12.0, gate_at=gate_at)
    script = [AIMessage("", tool_calls=[tc("a", "m1", x="risky"), tc("a", "m2", x="ok"), tc("b", "m3", x="risky")]),
              AIMessage("", tool_calls=[tc("a", "m4", x="risky"), tc("b", "m5")]), AIMessage("done")]
    agent = create_agent(scripted(script), [make_tool("a", runs), make_tool("b", runs)],
                         middleware=stack(guard, [AutoModeMiddleware(tools=["a"], classifier=_Risky())], order),
                         checkpointer=InMemorySaver())
    out = invoke(agent, USER, mode, config(True))
    check(guard, out, runs, prices, sink)
    assert runs == {"a": 1, "b": 1}


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_a_routed_models_calls_are_gated_and_paid(order, mode, ckpt):
    prices = {"a": 4.0, "b": 3.0}
    runs = RunCounter()
    guard, sink = guard_for(prices, 12.0)
    small = scripted([AIMessage("", tool_calls=[tc("a", "r1")]), AIMessage("small done")])
    big = scripted([AIMessage("", tool_calls=[tc("b", "r2"), tc("a", "r3")]), AIMessage("", tool_calls=[tc("b", "r4")]),
                    AIMessage("big done")])
    router = ModelRouterMiddleware(choices={"small": ModelChoice(model=small, criteria="easy"),
                                            "big": ModelChoice(model=big, criteria="hard")},
                                   instructions="route", classifier=_Route())
    agent = create_agent(scripted([AIMessage("default")]), [make_tool("a", runs), make_tool("b", runs)],
                         middleware=stack(guard, [router], order), checkpointer=InMemorySaver() if ckpt else None)
    out = invoke(agent, USER, mode, config(ckpt))
    check(guard, out, runs, prices, sink)
    assert out["messages"][-1].content == "big done" and runs == {"a": 1, "b": 2}
