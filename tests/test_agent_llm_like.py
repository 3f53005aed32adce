"""The pre-registered LLM-like simulated agent (issue 16, section 2)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from eval.agents.llm_like import LLMAgentConfig, LLMLikeAgent, llm_agent_factory
from eval.markets import SyntheticV2BenchMarket


@pytest.fixture(scope="module")
def market() -> SyntheticV2BenchMarket:
    return SyntheticV2BenchMarket(40, 0)


def _first_call(agent: LLMLikeAgent, messages: list) -> tuple[str, dict] | None:
    reply = agent.bind_tools(list(agent.view.covers)).invoke(messages)
    return (reply.tool_calls[0]["name"], reply.tool_calls[0]["args"]) if reply.tool_calls else None


def test_view_never_carries_hidden_probabilities(market: SyntheticV2BenchMarket) -> None:
    # Two tasks that differ only in their hidden success probabilities give the agent equal views
    # and so equal replies: it cannot read them.
    for task in market.tasks()[:15]:
        other = replace(task, tools=tuple(replace(t, base_success=round(1.0 - t.base_success, 4))
                                          for t in task.tools))
        v1, v2 = market.episode(task, 0).view, market.episode(other, 0).view
        assert v1 == v2
        assert "base_success" not in repr(v1) and not any(str(t.base_success) in repr(v1) for t in task.tools
                                                         if len(str(t.base_success)) > 4)
        a1 = LLMLikeAgent(view=v1, seed=3)
        a2 = LLMLikeAgent(view=v2, seed=3)
        msgs = [SystemMessage("You are a tool-using assistant."), HumanMessage(task.query)]
        assert _first_call(a1, msgs) == _first_call(a2, msgs)


def test_rollout_copy_uses_its_own_random_stream(market: SyntheticV2BenchMarket) -> None:
    from eval.method_spec import MethodContext
    from eval.oracle_methods import _policy

    differs = 0
    for task in market.tasks():
        env = market.episode(task, 0)
        agent = llm_agent_factory()(env, 0)
        policy = _policy(MethodContext(env=env, seed=0, model=agent))
        assert policy.model is not agent and policy.model.rand_stream != agent.rand_stream
        msgs = [HumanMessage(task.query)]
        same = LLMLikeAgent(view=env.view, seed=0)
        assert _first_call(same, msgs) == _first_call(agent, msgs)  # one stream, one choice
        differs += _first_call(policy.model, msgs) != _first_call(agent, msgs)
    # Over 40 tasks the rollout copy's draws are not the agent's (beliefs and choices differ).
    assert differs >= 5


def _history(task_query: str, tool: str, args: dict, feedback: str) -> list:
    return [
        SystemMessage("You are a tool-using assistant."),
        HumanMessage(task_query),
        AIMessage("", tool_calls=[{"name": tool, "args": args, "id": "c0", "type": "tool_call"}]),
        ToolMessage(feedback, tool_call_id="c0", status="error"),
    ]


def test_a_rejection_is_information_not_a_permanent_ban(market: SyntheticV2BenchMarket) -> None:
    # A one-need task with a single provider: after a refusal the agent may retry it later
    # (the penalty decays), and it never treats the refusal as a ban for the whole episode.
    task = next(t for t in market.tasks() if len(t.needs) == 1)
    env = market.episode(task, 0)
    need = env.view.needs[0]
    only = need.providers[0]
    view = replace(env.view, covers={only: frozenset({need.id})}, tiers={only: env.view.tiers[only]},
                   needs=(replace(need, providers=(only,)),))
    retried = 0
    for seed in range(20):
        agent = LLMLikeAgent(view=view, seed=seed, llm=LLMAgentConfig(quit_rate=0.0))
        msgs = _history(task.query, only, dict(need.args), "Budget guard: the call was rejected. Revise your plan.")
        # two more turns later, the penalty has halved twice
        msgs += [AIMessage("thinking"), HumanMessage("go on")]
        call = _first_call(agent, msgs)
        retried += call is not None and call[0] == only
    assert retried >= 15


def test_feedback_updates_beliefs(market: SyntheticV2BenchMarket) -> None:
    task = next(t for t in market.tasks() if len(t.needs) >= 2)
    env = market.episode(task, 0)
    need = env.view.needs[0]
    prov = list(need.providers)
    prices = "\n".join(f"- {t.name}: {t.price}" for t in task.tools)
    system = SystemMessage(f"You are a tool-using assistant.\n\nYou have a hard budget of 50 for tool calls in this "
                           f"task; every call is charged its price.\nTool prices (cost per call):\n{prices}\n"
                           "[Budget status] spent 0 of 50; 50 left.")
    # "only X left": never proposes a call it now knows it cannot afford
    cheapest = min(task.tool(t).price for t in prov)
    for seed in range(15):
        agent = LLMLikeAgent(view=env.view, seed=seed, llm=LLMAgentConfig(quit_rate=0.0))
        msgs = [system] + _history(task.query, prov[0], dict(need.args),
                                   f"Budget guard: the call to {prov[0]} was not executed and cost nothing. It costs "
                                   f"99 but only {cheapest} of the budget 50 is left.")[1:]
        reply = agent.bind_tools(list(env.view.covers)).invoke(msgs)
        for c in reply.tool_calls:
            assert task.tool(c["name"]).price <= cheapest
    # "Suggested call: tool {args}": followed most of the time
    target = prov[-1]
    followed = 0
    for seed in range(20):
        agent = LLMLikeAgent(view=env.view, seed=seed)
        fb = f"Rejected: not the best next call. Suggested call: {target} {json.dumps(dict(need.args))}"
        followed += _first_call(agent, _history(task.query, prov[0], dict(need.args), fb)) == (target, dict(need.args))
    assert followed >= 14


def test_bad_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="temperature"):
        LLMAgentConfig(temperature=0)
    with pytest.raises(ValueError, match="track_budget"):
        LLMAgentConfig(track_budget=1.5)
    with pytest.raises(TypeError, match="no_such_knob"):
        llm_agent_factory({"no_such_knob": 1})


@pytest.mark.slow
def test_same_seed_same_results_with_two_workers(tmp_path) -> None:
    from eval.results import ResultStore
    from eval.runner import BenchConfig, run_benchmark

    def run(out: str) -> list[tuple]:
        # intent included: its rollouts run the agent's rollout copy, in parallel with other episodes
        cfg = BenchConfig(market="synthetic-v2", agent="sim-llm", methods=("raw", "tracker", "intent", "optimal"),
                          tasks=16, workers=2, seed=1, out=out, options={"oracle_train_tasks": 20})
        run_benchmark(cfg, progress=False)
        rows = ResultStore(tmp_path / out / "episodes.jsonl").load(repair=False)
        return sorted((r.method, r.task_id, r.passed, r.cost, r.n_calls, r.n_rejected) for r in rows)

    first, second = run(str(tmp_path / "a")), run(str(tmp_path / "b"))
    assert first == second and len(first) == 64


def test_a_predicted_trace_moves_beliefs_without_banning(market: SyntheticV2BenchMarket) -> None:
    # INTENT's trace says a provider succeeds with p = 0.00: the agent picks it less often than
    # after a plain refusal, yet it is still among its choices in some episodes (a belief, not a ban).
    task = next(t for t in market.tasks() if len(t.needs) == 1)
    env = market.episode(task, 0)
    need = env.view.needs[0]
    target = next(p for p in need.providers if env.view.tiers[p] == "premium")
    plain = "Budget guard: the call was rejected and cost nothing. Revise your plan."
    trace = ("Budget check failed: the call was not executed and cost nothing.\nPredicted tool trace:\n"
             "step | tool | price | p_success | expected_cost\n"
             f"1 | {target} | 30 | 0.00 | 30\nPlease revise your plan.")
    picks = {"plain": 0, "trace": 0}
    for seed in range(60):
        for kind, fb in (("plain", plain), ("trace", trace)):
            agent = LLMLikeAgent(view=env.view, seed=seed, llm=LLMAgentConfig(quit_rate=0.0))
            msgs = _history(task.query, need.providers[0], dict(need.args), fb)
            msgs[-1] = ToolMessage(fb, tool_call_id="c0", status="error")
            msgs[2] = AIMessage("", tool_calls=[{"name": target, "args": dict(need.args), "id": "c0",
                                                 "type": "tool_call"}])
            msgs += [AIMessage("thinking"), HumanMessage("go on"), AIMessage("thinking"), HumanMessage("go on")]
            call = _first_call(agent, msgs)
            picks[kind] += call is not None and call[0] == target
    assert picks["trace"] < picks["plain"] - 5, picks
    assert picks["trace"] >= 1, picks
