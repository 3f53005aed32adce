"""A real-LLM agent whose context is full ends its episode without an answer, not with a crash.

bench-llm with Qwen2.5-Coder-0.5B (8,192 tokens): a tracker episode died on the server's HTTP 400
"maximum context length" after 459 s, within budget, and was listed as crashed (so infeasible).
"""

from __future__ import annotations

from langchain.agents import create_agent
from langchain_core.messages import AIMessage

from eval.agents.context_full import StopWhenContextFull, ended_on_full_context
from eval.results import ResultStore
from eval.runner import BenchConfig, run_benchmark
from intent import AcceptAll, BudgetGuard, Market, PricedTool
from intent.logs import read_log
from intent.testing import ScriptedToolModel, ai, call


class ServerSaysTooLong(Exception):
    """What an OpenAI-compatible client raises for vLLM's answer to a prompt that does not fit."""

    status_code = 400

    def __init__(self) -> None:
        super().__init__("Error code: 400 - This model's maximum context length is 8192 tokens. However, you "
                         "requested 8300 tokens.")


class FullAfter(ScriptedToolModel):
    """Answers with its script, then raises ``error`` once the script is used up."""

    error: type[Exception] = ServerSaysTooLong

    def _generate(self, *args, **kwargs):
        try:
            return super()._generate(*args, **kwargs)
        except StopIteration:
            raise self.error() from None


def test_the_middleware_turns_a_full_context_into_an_empty_final_message():
    from langchain_core.tools import StructuredTool

    tool = StructuredTool.from_function(lambda x: "ok", name="a", description="a")
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 5.0)]), 20.0)
    model = FullAfter(messages=iter([ai(call("a", x=1))]))
    agent = create_agent(model, [tool], middleware=[StopWhenContextFull(), guard.middleware()])
    out = agent.invoke({"messages": [("user", "go")]}, {"configurable": {"thread_id": "t"}})
    assert ended_on_full_context(out["messages"]) and out["messages"][-1].content == ""
    ledger = guard.ledger(out)
    assert ledger.spent == 5.0 and ledger.reserved == 0.0


def test_any_other_model_error_still_raises():
    import pytest

    class Boom(ValueError):
        status_code = 400  # a 400 that is not about the context

    model = FullAfter(messages=iter([]), error=Boom)
    agent = create_agent(model, [], middleware=[StopWhenContextFull()])
    with pytest.raises(Boom):
        agent.invoke({"messages": [("user", "go")]})


def test_the_runner_lists_a_full_context_as_a_failed_episode_not_a_crash(tmp_path):
    def factory(env, seed):
        tool = env.tools[0]
        name = tool["name"] if isinstance(tool, dict) else tool.name
        return FullAfter(messages=iter([AIMessage("", tool_calls=[{"name": name, "args": {}, "id": "c1",
                                                                   "type": "tool_call"}])]))

    s = run_benchmark(BenchConfig(tasks=2, methods=["tracker"], out=str(tmp_path), workers=1), agent_factory=factory,
                      progress=False)
    row = s["methods"]["tracker"]
    assert row["context_full"] == 2 and row["episode_errors"] == 0 and row["FR"] == 100.0 and row["PR"] == 0.0
    episodes = ResultStore(tmp_path / "episodes.jsonl").load(repair=False)
    assert all(e.error == "" and e.extra["context_full"] for e in episodes)


class Looping(ScriptedToolModel):
    """Calls a tool that does not exist, turn after turn (a 0.5B model did, 35 turns in a row)."""

    def _generate(self, *args, **kwargs):
        from langchain_core.outputs import ChatGeneration, ChatResult

        msg = AIMessage("", tool_calls=[{"name": "budget status", "args": {"spent": 8}, "id": "c", "type": "tool_call"}])
        return ChatResult(generations=[ChatGeneration(message=msg)])


def test_a_looping_agent_ends_at_its_turn_limit_without_an_answer_not_a_crash(tmp_path):
    s = run_benchmark(BenchConfig(tasks=1, methods=["tracker"], out=str(tmp_path), workers=1,
                                  options={"max_turns": 4}),
                      agent_factory=lambda env, seed: Looping(messages=iter([])), progress=False)
    row = s["methods"]["tracker"]
    assert row["turn_limit"] == 1 and row["episode_errors"] == 0 and row["FR"] == 100.0
    (episode,) = ResultStore(tmp_path / "episodes.jsonl").load(repair=False)
    assert episode.error == "" and episode.answered is False and episode.proposed_calls == 4


def test_max_turns_must_be_a_positive_integer(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="--max-turns must be an integer >= 1"):
        run_benchmark(BenchConfig(tasks=1, methods=["raw"], out=str(tmp_path), options={"max_turns": 0}),
                      progress=False)


def test_the_oracle_log_collection_honours_the_turn_limit_too(tmp_path):
    """The Prompt agent's collection run (hours with a real model) gets the run's options: a looping
    model ends there at --max-turns as it does in the benchmark's own episodes."""
    run_benchmark(BenchConfig(tasks=1, methods=["intent"], out=str(tmp_path), workers=1,
                              options={"max_turns": 3, "oracle_train_tasks": 1}),
                  agent_factory=lambda env, seed: Looping(messages=iter([])), progress=False)
    (log,) = (tmp_path / "oracle_data").glob("**/logs.jsonl")
    collected = list(read_log(log))
    assert collected and len({r.step for r in collected}) == 3  # one call per turn, three turns


def test_an_overflow_on_the_first_call_is_a_configuration_error_not_a_full_context():
    """vLLM answers a reply cap at or above the model's context with the same "maximum context
    length" error as a full history: on the episode's first call it must not pass as context_full."""
    import pytest

    from eval.agents.context_full import PromptDoesNotFitError

    model = FullAfter(messages=iter([]))
    agent = create_agent(model, [], middleware=[StopWhenContextFull()])
    with pytest.raises(PromptDoesNotFitError, match="first model call.*--max-tokens"):
        agent.invoke({"messages": [("user", "go")]})
