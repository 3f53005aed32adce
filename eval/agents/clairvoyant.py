"""A clairvoyant reference agent for the synthetic market (labelled; never compared as a method).

It reads the episode's ground truth (every call's realised outcome, through
:func:`eval.synthetic.clairvoyant_plan`) and makes exactly the cheapest solving calls with the
canonical arguments, one per turn, then answers. On every episode the plan calls solvable it
solves the task within budget, so its OR is 100 by the definition OR uses: it checks that
definition end to end, through ``create_agent`` and the guard.
"""

from __future__ import annotations

from typing import Any

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from pydantic import ConfigDict

from intent.errors import UsageError

__all__ = ["CLAIRVOYANT_AGENT_LABEL", "ClairvoyantAgent", "clairvoyant_agent_factory"]

CLAIRVOYANT_AGENT_LABEL = "clairvoyant reference agent (reads the synthetic ground truth; a check, not a method)"


class ClairvoyantAgent(BaseChatModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    calls: tuple[str, ...]
    args: dict[str, dict[str, Any]]
    task_id: str = ""

    @property
    def _llm_type(self) -> str:
        return "intent-clairvoyant-agent"

    def bind_tools(self, tools: Any, **kwargs: Any) -> ClairvoyantAgent:
        return self

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        step = sum(isinstance(m, AIMessage) for m in messages)
        if step < len(self.calls):
            tool = self.calls[step]
            reply = AIMessage("", tool_calls=[{"name": tool, "args": self.args[tool],
                                               "id": f"{self.task_id}-c{step}", "type": "tool_call"}])
        else:
            reply = AIMessage("Here is everything you asked for.")
        return ChatResult(generations=[ChatGeneration(message=reply)])


def clairvoyant_agent_factory() -> Any:
    """``agent_factory`` for :func:`eval.runner.run_benchmark` (synthetic market only)."""
    from eval.optimal import StateValues
    from eval.synthetic import clairvoyant_plan

    def build(env: Any, seed: int) -> ClairvoyantAgent:
        truth = env.ground_truth
        if truth is None:
            raise UsageError("the clairvoyant agent needs the synthetic market's ground truth (--market synthetic)")
        plan = clairvoyant_plan(truth.task, seed)
        values = StateValues(truth.task)
        return ClairvoyantAgent(calls=plan.calls, args={t: values.canonical_args(t) for t in plan.calls},
                                task_id=env.task_id)

    return build
