"""OR's denominator on StableToolBench: the exhaustive DFSDT search with a budget per path, and its cache."""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import AIMessage
from langchain_core.tools import tool

from baselines.dfsdt import DFSDTRunner
from baselines.prompt import PromptOracle
from intent import Market, PricedTool
from intent.guard import BudgetGuard
from intent.testing import ai, call, scripted


@tool
def a() -> str:
    """Tool a."""
    return '{"a": 1}'


@tool
def b() -> str:
    """Tool b."""
    return '{"b": 1}'


@tool
def c() -> str:
    """Tool c."""
    return '{"c": 1}'


MARKET = Market([PricedTool("a", 40), PricedTool("b", 30), PricedTool("c", 10)])
# First branch: a (40), then gives up. Second branch: b (30) then c (10), then answers.
SCRIPT = [ai(call("a")), AIMessage("I give up"), ai(call("b")), ai(call("c")), AIMessage("the answer")]


def _search(script=SCRIPT, **hooks):
    guard = BudgetGuard(PromptOracle(), MARKET, 50.0, enforce=True, tool_errors="message")
    return DFSDTRunner(guard, [a, b, c], width=2, **hooks).run(scripted(script), "q", episode_id="s")


def test_per_path_budget_lets_a_branch_spend_what_an_abandoned_one_spent():
    shared = _search()  # the baseline: one budget for the whole tree; 40 spent on the dead branch
    assert shared.pruned >= 1 and shared.answer != "the answer"
    per_path = _search(per_path_budget=True)  # b + c = 40 <= 50 on its own path
    assert per_path.answer == "the answer" and per_path.pruned == 0
    names = [c["name"] for m in per_path.messages if isinstance(m, AIMessage) for c in m.tool_calls]
    assert names == ["b", "c"]


def test_a_partly_refused_batch_goes_on_with_the_calls_that_ran():
    batch = ai(call("a"), call("b"))  # a (40) runs, then b (30) no longer fits
    pruned = _search([batch, AIMessage("I give up")])  # the baseline prunes; the root's next child gives up
    assert pruned.pruned == 1 and pruned.answer == "I give up"
    script = [batch, AIMessage("the answer")]
    kept = _search(script, per_path_budget=True, prune_partial_batches=False)
    assert kept.pruned == 0 and kept.answer == "the answer"
    refusal = next(m for m in kept.messages if getattr(m, "tool_call_id", None) == script[0].tool_calls[1]["id"])
    assert refusal.artifact["intent_reason"] == "over_budget"  # the refused call still got its answer


def test_on_answer_keeps_the_search_going():
    seen = []
    # after the refused answer, the node before it tries its second child (which gives up)
    res = _search([*SCRIPT, AIMessage("I give up")], per_path_budget=True,
                  on_answer=lambda messages, gave_up: seen.append((messages[-1].content, gave_up)) or False)
    assert seen == [("I give up", True), ("the answer", False), ("I give up", True)]  # give-ups are shown too
    assert res.answer != "the answer" and res.llm_calls == 6


# ---------------------------------------------------------------------------------------- on the real data
@pytest.fixture(scope="module")
def market(tmp_path_factory):
    from eval.stabletoolbench import StbDataError, resolve_root
    from eval.stb_market import StableToolBenchMarket

    try:
        resolve_root()
    except StbDataError as exc:
        pytest.skip(f"StableToolBench data not available: {exc}")
    return StableToolBenchMarket(groups=["G2_instruction"], out=tmp_path_factory.mktemp("stb"), seed=0)


def _factory(env, seed):
    from eval.agents.simulated import SimAgentConfig, SimulatedAgent

    return SimulatedAgent(view=env.view, config=SimAgentConfig(), seed=seed)


def test_solvability_cache_feeds_the_episodes(market):
    from eval.stabletoolbench.solvability import SOLVABILITY_FILE, ensure_solvability, load_solvable
    from eval.stb_market import StableToolBenchMarket

    by_id = {market.task_id(t): t for t in market.tasks()}
    # 11627: both inferred needs are the relevant APIs and fit the budget; the search finds no solution
    # that the judge passes for the other two (their inferred needs miss a relevant API, or cost too much)
    chosen = [by_id["G2_instruction:11627"], by_id["G2_instruction:10941"], by_id["G2_instruction:12142"]]
    assert all(market.episode(t, 0).solvable is None for t in chosen)  # nothing searched yet
    table = ensure_solvability(market, _factory, seed=0, agent_label="sim", tasks=chosen)
    assert table == {"G2_instruction:11627": True, "G2_instruction:10941": False, "G2_instruction:12142": False}
    assert [market.episode(t, 0).solvable for t in chosen] == [True, False, False]
    other = next(t for t in market.tasks() if market.task_id(t) not in table)
    assert market.episode(other, 0).solvable is None  # not searched: OR leaves it out

    saved = json.loads((market.out / SOLVABILITY_FILE).read_text())
    (entry,) = saved["searches"].values()
    assert entry["search"]["width"] == 10 and entry["search"]["solutions"] == 5 and entry["market"]["budget"] == 50
    solved = entry["tasks"]["G2_instruction:11627"]
    assert solved["correct"] >= 1 and solved["best_cost"] <= 50
    assert all(r["llm_calls"] > 0 for r in entry["tasks"].values())

    # a new run of the same configuration reads the verdicts; another budget does not
    assert load_solvable(market.out, market) == table
    tight = StableToolBenchMarket(groups=["G2_instruction"], out=market.out, seed=0, budget=20)
    assert tight.solvable_table == {} and tight.episode(chosen[0], 0).solvable is None
    assert ensure_solvability(tight, _factory, seed=0, agent_label="sim", tasks=chosen[:1]) == {
        "G2_instruction:11627": False}  # its two APIs cost more than 20 together
    assert load_solvable(market.out, market) == table  # the budget-50 verdicts are kept beside it


def test_judge_path_reads_only_the_branch(market):
    from langchain_core.messages import HumanMessage, ToolMessage

    task = next(t for t in market.tasks() if t.query_id == 11627)
    names = task.relevant_function_names
    calls = [{"name": n, "args": {}, "id": f"c{i}", "type": "tool_call"} for i, n in enumerate(names)]
    ok = [ToolMessage('{"error": "", "response": "x"}', tool_call_id=f"c{i}", artifact={"z": 1})
          for i in range(len(names))]
    path = [HumanMessage(task.query), AIMessage("", tool_calls=calls), *ok, AIMessage("done")]
    assert market.judge_path(task, "done", path) == 1.0
    refused = [ToolMessage("refused", tool_call_id="c0", artifact={"intent_reason": "over_budget"}), *ok[1:]]
    assert market.judge_path(task, "done", [*path[:2], *refused, path[-1]]) == 0.0
    # The label is read by intent.logs.label_of, as everywhere: "1" or "true" is a success (`z == 1` was not).
    as_text = [ToolMessage(m.content, tool_call_id=m.tool_call_id, artifact={"z": z})
               for m, z in zip(ok, ["1", "true"] * len(ok))]
    assert market.judge_path(task, "done", [*path[:2], *as_text, path[-1]]) == 1.0


class _EndCounting(PromptOracle):
    def __init__(self):
        super().__init__()
        self.ended: list[str] = []

    def end(self, episode_id):
        self.ended.append(episode_id)


def test_per_path_branches_are_ended_episodes():
    """Each branch of a per-path search is a guard episode of its own: every one is ended (nothing kept by
    the guard, the oracle's end hook called), the abandoned branches and the found path's ancestors too."""
    oracle = _EndCounting()
    guard = BudgetGuard(oracle, MARKET, 50.0, enforce=True, tool_errors="message")
    res = DFSDTRunner(guard, [a, b, c], width=2, per_path_budget=True).run(scripted(SCRIPT), "q", episode_id="s")
    assert res.answer == "the answer"
    assert len(guard.episodes) == 0
    # the root (its expansions are model steps: prepared, so started), the abandoned branch 0.0, the found
    # path 0.1 and its child 0.1.0
    assert sorted(oracle.ended) == ["s", "s/0.0", "s/0.1", "s/0.1.0"]
