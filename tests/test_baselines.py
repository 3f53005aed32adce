"""Raw, Prompt, BATS and DFSDT: their rules, and each end to end under the guard."""

from __future__ import annotations

import pytest
from fakes import ScriptedToolModel
from langchain_core.messages import AIMessage
from langchain_core.tools import StructuredTool

from baselines.bats import TIER_GUIDELINES, BATSOracle, tier_for, tracker_block
from baselines.dfsdt import DFSDTRunner, is_give_up
from baselines.prompt import PromptOracle
from intent.feedback import price_list
from eval.runner import BenchConfig, run_benchmark
from intent import AcceptAll, BudgetGuard, Market, MemoryLogSink, PricedTool
from intent.oracle import Outcome, Proposal


@pytest.mark.parametrize("remaining,tier", [
    (100, "HIGH"), (70, "HIGH"), (69.99, "MEDIUM"), (30, "MEDIUM"), (29.99, "LOW"), (10, "LOW"),
    (9.99, "CRITICAL"), (0, "CRITICAL"),
])
def test_bats_tier_boundaries(remaining, tier):
    assert tier_for(remaining, 100) == tier


def test_bats_tier_boundary_with_decimal_prices():
    # 3 - (0.9 + 1.8) is 0.2999999999999998 in floats: exactly 10% left is LOW, not CRITICAL.
    assert tier_for(3.0 - (0.9 + 1.8), 3.0) == "LOW" and tier_for(0.299, 3.0) == "CRITICAL"


def test_bats_messages():
    oracle = BATSOracle()
    market = Market([PricedTool("a", 5), PricedTool("b", 7.5)])
    notes = oracle.prompt_notes(market, "e", 45, 5, 50)
    assert "<budget>45/5</budget>" in notes and TIER_GUIDELINES["LOW"] in notes and "- b: 7.5" in notes
    outcome = Outcome("e", Proposal("c", "a", {}), 5, "ok", "{}", 10, 40)
    assert oracle.result_note(outcome) == tracker_block(10, 40) == "<budget>10/40</budget>"
    with pytest.raises(ValueError, match="K=5"):
        BATSOracle(max_verifications=-1)


def test_bats_verification_is_capped_at_k_per_iteration_and_counted():
    class CountingVerifier:
        calls = 0

        def verify(self, query, tool, observation, episode_id):
            from baselines.bats import Verification

            CountingVerifier.calls += 1
            return Verification("PIVOT", "switch", tokens=7)

    oracle = BATSOracle(verifier=CountingVerifier(), max_verifications=2)
    from intent.oracle import DecisionContext

    ctx = DecisionContext("e", "q", Proposal("c", "a", {}), 1, 10, 0, 10, Market([PricedTool("a", 1)]), step=0)
    oracle.decide(ctx)
    notes = [oracle.result_note(Outcome("e", Proposal(f"c{i}", "a", {}), 1, "ok", "x", i, 10 - i)) for i in range(4)]
    assert sum("[Verify] PIVOT" in n for n in notes) == 2
    oracle.decide(DecisionContext("e", "q", Proposal("d", "a", {}), 1, 10, 4, 6, ctx.market, step=1))
    assert "[Verify]" in oracle.result_note(Outcome("e", Proposal("d", "a", {}), 1, "ok", "x", 5, 5))
    assert oracle.episode_usage("e") == {"tokens": 21.0, "llm_calls": 3.0}
    oracle.end("e")  # the run ended: its working state is dropped, its usage is still read
    assert oracle._episodes == {} and oracle.episode_usage("e") == {"tokens": 21.0, "llm_calls": 3.0}


@pytest.mark.parametrize("name", ["bats", "btp"])
def test_a_baseline_oracle_forgets_each_episode_when_its_run_ends(name):
    # Per-episode state is dropped when a run ends (issue 11, bounded memory): it was kept for every
    # episode a guard ever ran.
    from langchain.agents import create_agent

    from baselines.btp import BTPOracle
    from fakes import ai, call, scripted

    oracle = BATSOracle() if name == "bats" else BTPOracle()
    guard = BudgetGuard(oracle, Market([PricedTool("a", 1)]), 100.0)
    for i in range(5):
        agent = create_agent(scripted([ai(call("a", x=i)), AIMessage("done")]), [_tool("a")],
                             middleware=[guard.middleware()])
        agent.invoke({"messages": [("user", "go")]}, {"configurable": {"thread_id": f"t{i}"}})
    assert (oracle._episodes if name == "bats" else oracle._plans) == {}


def test_prompt_shows_prices_and_status():
    oracle = PromptOracle()
    market = Market([PricedTool("a", 5)])
    notes = oracle.prompt_notes(market, "e", 0, 50, 50)
    assert price_list(market) in notes and "hard budget of 50" in notes
    assert "spent 5 of 50; 45 left" in oracle.result_note(Outcome("e", Proposal("c", "a", {}), 5, "ok", "", 5, 45, 50))


def _tool(name):
    return StructuredTool.from_function(lambda x=0: f'{{"{name}": {x}}}', name=name, description=name)


def test_dfsdt_branches_share_one_budget_and_prune():
    # Every expansion proposes a 30-cost call; only one fits in 50, so after the first every
    # expansion (3 below it, 2 more at the root) is pruned by the guard: 6 model calls, no answer.
    calls = iter(range(1000))

    class Greedy(ScriptedToolModel):
        def _generate(self, messages, stop=None, run_manager=None, **kw):
            from langchain_core.outputs import ChatGeneration, ChatResult

            k = next(calls)
            if k > 30:
                msg = AIMessage("I give up.")
            else:
                msg = AIMessage("", tool_calls=[{"name": "big", "args": {"x": k}, "id": f"c{k}", "type": "tool_call"}])
            return ChatResult(generations=[ChatGeneration(message=msg)])

    sink = MemoryLogSink()
    guard = BudgetGuard(AcceptAll(), Market([PricedTool("big", 30)]), 50, log_sink=sink)
    runner = DFSDTRunner(guard, [_tool("big")], width=3, max_depth=4, max_llm_calls=40)
    res = runner.run(Greedy(messages=iter([]), bound=[]), "q")
    ledger = guard.ledger({"intent_ledger": res.channel})
    assert ledger.spent == 30 and ledger.spent <= 50
    assert (res.llm_calls, res.pruned, res.answer) == (6, 5, None)
    assert is_give_up(AIMessage("OK, I give up."))
    assert sum(r.charged for r in sink.records) == 30


def test_dfsdt_counts_merged_identical_calls_as_answered_and_ends_its_episode():
    # Two identical calls in one expansion: the gate merges them (one run, one answer). DFSDT counted both as
    # proposed and one as answered, and the benchmark stopped on a HarnessError. Its episode was never ended:
    # the oracle's end hook was not called (its per-episode state kept), and a batch that raised left its
    # sibling's reservation held.
    from intent import Decision

    class Ends(AcceptAll):
        def __init__(self) -> None:
            self.ended: list[str] = []

        def decide(self, ctx):
            return Decision.accepted()

        def end(self, episode_id: str) -> None:
            self.ended.append(episode_id)

    oracle = Ends()
    guard = BudgetGuard(oracle, Market([PricedTool("a", 10)]), 50)
    twice = AIMessage("", tool_calls=[{"name": "a", "args": {"x": 1}, "id": f"c{i}", "type": "tool_call"}
                                      for i in range(2)])
    model = ScriptedToolModel(messages=iter([twice, AIMessage("the answer")]), bound=[])
    res = DFSDTRunner(guard, [_tool("a")], width=2, max_depth=3).run(model, "q", episode_id="dfs")
    assert res.proposed_calls == res.answered_calls == 1 and res.answer == "the answer"
    assert guard.ledger({"intent_ledger": res.channel}).spent == 10 and oracle.ended == ["dfs"]

    def boom(x: int = 0) -> str:
        raise RuntimeError("upstream 503")

    guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 10), PricedTool("f", 5)]), 50)
    batch = AIMessage("", tool_calls=[{"name": "f", "args": {}, "id": "f1", "type": "tool_call"},
                                      {"name": "a", "args": {"x": 2}, "id": "a1", "type": "tool_call"}])
    runner = DFSDTRunner(guard, [StructuredTool.from_function(boom, name="f", description="f"), _tool("a")])
    with pytest.raises(RuntimeError, match="503"):
        runner.run(ScriptedToolModel(messages=iter([batch]), bound=[]), "q", episode_id="raises")
    assert guard.ledger({"intent_ledger": runner._channel}).reserved == 0


def test_every_baseline_runs_end_to_end_and_enforcing_ones_never_overspend(tmp_path, monkeypatch):
    """FR = 100 is read off the guard's own ledger, so for an enforcing method it holds by
    construction. Here the money is observed independently, by the tools themselves (each run
    adds its price), and the budgets are tight enough to bind: the soft baselines really
    overspend on some tasks, the guard really refuses calls for the enforcing ones, and yet no
    enforcing episode's tools ever ran for more than its budget."""
    import dataclasses
    import threading
    from collections import Counter

    import eval.runner as runner
    from eval.results import ResultStore
    from intent.logs import read_log

    ran: dict[tuple[str, str], float] = {}  # (method, task) -> money the tools ran for
    run_episode = runner.run_episode

    def counted(spec, env, seed, agent_factory, **kw):
        money, lock = [0.0], threading.Lock()

        def counting(tool):
            fn = tool.func

            def run(*args, **kwargs):
                with lock:  # the market is static here (event_rate=0): the listed price is what runs cost
                    money[0] += env.market.price(tool.name)
                return fn(*args, **kwargs)

            return tool.model_copy(update={"func": run})

        result = run_episode(spec, dataclasses.replace(env, tools=[counting(t) for t in env.tools]), seed,
                             agent_factory, **kw)
        ran[(spec.name, env.task_id)] = money[0]  # the warm-up episode is overwritten by the real one
        return result

    monkeypatch.setattr(runner, "run_episode", counted)
    methods = ["raw", "prompt", "tracker", "bats", "dfsdt"]
    enforcing = ("tracker", "bats", "dfsdt")
    summary = run_benchmark(BenchConfig(tasks=25, methods=methods, out=str(tmp_path)), progress=False)
    m = summary["methods"]
    episodes = ResultStore(tmp_path / "episodes.jsonl").load()
    assert len(episodes) == 25 * len(methods)
    over: Counter[str] = Counter()
    for e in episodes:
        money = ran[(e.method, e.task_id)]
        assert e.cost == pytest.approx(money), f"{e.method}/{e.task_id}: ledger {e.cost} but the tools ran {money}"
        over[e.method] += money > e.budget + 1e-9
    for name in ("raw", "prompt"):  # soft: the budget binds and they overspend on some tasks
        assert over[name] > 0 and m[name]["FR"] < 100.0
        assert m[name]["overspend_tasks"] == over[name]
    refused = Counter(r.task_id.split(":")[0] for r in read_log(tmp_path / "logs.jsonl") if r.reason == "over_budget")
    for name in enforcing:
        assert over[name] == 0, f"{name}: the tools ran over budget on {over[name]} tasks"
        assert m[name]["FR"] == 100.0 and m[name]["episode_errors"] == 0
    assert refused["tracker"] > 0 and refused["bats"] > 0  # the guard had something to enforce
    assert m["bats"]["oracle_tokens"] > 0  # the verifier's cost is counted


def test_dfsdt_sees_the_markets_events_as_agents_do(tmp_path):
    # Market events (a tool removed, banned, repriced) reached the guard through an agent middleware, which
    # DFSDT's own search loop never ran: it was gated and charged against the market as it was at the start.
    from intent.logs import read_log

    out = tmp_path / "run"
    run_benchmark(BenchConfig(tasks=8, seed=5, event_rate=0.5, methods=["dfsdt", "bats"], out=str(out),
                              reference="bats"), progress=False)
    versions = {m: max((r.market_version for r in read_log(out / "logs.jsonl") if r.task_id.startswith(f"{m}:")),
                       default=0) for m in ("dfsdt", "bats")}
    assert versions["bats"] > 0 and versions["dfsdt"] > 0, versions


def test_dfsdt_diversity_prompt_shows_each_earlier_attempt_and_what_it_returned():
    # StableToolBench's diversity prompt lists every earlier child of the node with its name, its
    # arguments and its function output; the budget refusal that pruned a child is that output, the
    # one thing that tells the model why the attempt failed. Ours listed the names only.
    seen: list[list] = []

    class Recording(ScriptedToolModel):
        def _generate(self, messages, stop=None, run_manager=None, **kw):
            seen.append(list(messages))
            return super()._generate(messages, stop=stop, run_manager=run_manager, **kw)

    big = AIMessage("", tool_calls=[{"name": "big", "args": {"x": 7}, "id": "c1", "type": "tool_call"}])
    model = Recording(messages=iter([big, AIMessage("the answer")]), bound=[])
    guard = BudgetGuard(PromptOracle(), Market([PricedTool("big", 80), PricedTool("small", 5)]), 50)
    res = DFSDTRunner(guard, [_tool("big"), _tool("small")], width=3, max_depth=3).run(model, "q")
    assert res.pruned == 1 and res.answer == "the answer"
    diversity = str(seen[1][-1].content)
    assert diversity.startswith("Previously tried actions at this point: big\n")
    assert '"x": 7' in diversity  # its arguments
    assert "80" in diversity and "budget" in diversity.lower()  # the refusal it got: the call did not fit


def test_the_simulated_agent_avoids_every_action_dfsdt_says_it_tried():
    # The simulated agent read "Previously tried actions at this point: a, b. Try a different action." as the
    # names "a" and "b. Try a different action.", so it did not avoid the last action tried at the node.
    from eval.agents.simulated import NeedView, SimAgentConfig, SimulatedAgent, TaskView

    need = NeedView("n0", "weather in Oslo", {"city": "Oslo"}, ("w_premium", "w_mid"))
    view = TaskView("t0", "Weather in Oslo?", (need,), covers={"w_premium": frozenset({"n0"}),
                                                               "w_mid": frozenset({"n0"})},
                    tiers={"w_premium": "premium", "w_mid": "mid"})
    agent = SimulatedAgent(view=view, config=SimAgentConfig(myopic_first=1.0, parallel=0.0, arg_noise=0.0), seed=1)
    guard = BudgetGuard(PromptOracle(), Market([PricedTool("w_premium", 80), PricedTool("w_mid", 10)]), 50)
    tools = [StructuredTool.from_function(lambda city="": f'{{"city": "{city}", "forecast": "rain"}}', name=n,
                                          description=n) for n in ("w_premium", "w_mid")]
    res = DFSDTRunner(guard, tools, width=4, max_depth=4).run(agent, "Weather in Oslo?")
    # The myopic first call (premium, over budget) is pruned once; the next expansion tries the other tool.
    assert res.pruned == 1 and res.answer is not None


def test_btp_searches_with_dfsdt_as_the_paper_implements_it(tmp_path):
    # INTENT's Appendix B.2 implements BTP "on top of the DFSDT framework", as BTP's own code runs in
    # StableToolBench's DFS: its quotas gate every branch of one search. Ours ran BTP in a plain agent loop.
    from eval.results import ResultStore

    run_benchmark(BenchConfig(tasks=10, methods=["btp"], out=str(tmp_path)), progress=False)
    episodes = ResultStore(tmp_path / "episodes.jsonl").load()
    assert episodes and all(e.method == "btp" and e.extra.get("nodes", 0) >= 1 for e in episodes)
    assert any(e.extra["summarized"] for e in episodes)  # and it ends with BTP's summarize()


def test_dfsdt_starts_the_oracles_episode_before_its_first_expansion():
    # DFSDT gated its calls but never prepared a model step (an agent's before_model does): an oracle's
    # start hook first ran at the first gate, after the first expansion. BTP's plan was not in force
    # then, so the first expansion was offered the tools its knapsack gives no call (110 of 150 BTP
    # episodes opened with a refusal on the synthetic market).
    from baselines.btp import BTPOracle

    model = ScriptedToolModel(messages=iter([AIMessage("the answer")]), bound=[])
    guard = BudgetGuard(BTPOracle(), Market([PricedTool("a", 30), PricedTool("b", 30)]), 50)
    DFSDTRunner(guard, [_tool("a"), _tool("b")], width=2, max_depth=3).run(model, "q")
    assert model.bound == [["a"]]  # no experience: one call each, and only one fits in 50


def test_a_tree_search_is_judged_on_the_branch_it_returns():
    # Every branch of a DFSDT search runs in the episode's one environment, and the market's judge read
    # what every call returned: a branch that gave up after its successful calls lent them to a sibling
    # that answered without any (the proxy judge passed it). Upstream judges the returned chain only.
    # On StableToolBench (setting b, 120 queries) DFSDT's proxy PR was 5.83 for the tree, 4.17 for the branch.
    from eval.agents.simulated import TaskView
    from eval.markets import EpisodeEnv
    from eval.methods import get_method
    from eval.runner import run_episode
    from langchain_core.messages import ToolMessage

    ran: list[str] = []

    def tool_a() -> str:
        ran.append("a")
        return "found it"

    def branch_judge(messages):
        evidence = any(isinstance(m, ToolMessage) and m.content == "found it" for m in messages)
        return lambda answer: float(bool(answer) and evidence)

    # Branch 1: calls a, then gives up (backtrack to the root); branch 2 answers at once, without evidence.
    script = [AIMessage("", tool_calls=[{"name": "a", "args": {}, "id": "c1", "type": "tool_call"}]),
              AIMessage("I give up"), AIMessage("the answer")]
    env = EpisodeEnv(task_id="t", group="g", query="q", budget=50.0, market=Market([PricedTool("a", 10)]),
                     tools=[StructuredTool.from_function(tool_a, name="a", description="a")],
                     view=TaskView("t", "q", (), covers={}, tiers={}), solvable=True,
                     judge=lambda answer: float(bool(answer) and "a" in ran),  # the whole episode's evidence
                     environment="test", judge_branch=branch_judge)
    result = run_episode(get_method("dfsdt"), env, 0,
                         lambda env, seed: ScriptedToolModel(messages=iter(script), bound=[]))
    assert ran == ["a"] and result.answered and result.passed == 0.0


def test_the_synthetic_branch_judge_reads_only_the_branchs_results():
    from eval.markets import SyntheticBenchMarket
    from langchain_core.messages import ToolMessage

    market = SyntheticBenchMarket(20, 0)
    task = next(t for t in market.tasks() if len(t.needs) >= 2)
    env = market.episode(task, 0)
    ids = [n.id for n in task.needs]
    every = [ToolMessage("ok", tool_call_id=f"c{i}", artifact={"z": 1, "satisfied": [nid]}) for i, nid in enumerate(ids)]
    assert env.judge_branch(every)("answer") == 1.0
    assert env.judge_branch(every)("") == 0.0  # no answer
    assert env.judge_branch(every[1:])("answer") == 0.0  # a need this branch never met


def test_dfsdt_summarize_answers_from_every_call_the_search_ran():
    # BTP's code ends its search with summarize(): the model writes the final answer from every call result
    # the tree gathered, and that answer (with a chain of those calls) replaces the search's own.
    from langchain_core.messages import ToolMessage
    from intent.testing import ai, call

    seen: list[list] = []

    class Recording(ScriptedToolModel):
        def _generate(self, messages, stop=None, run_manager=None, **kw):
            seen.append(list(messages))
            return super()._generate(messages, stop=stop, run_manager=run_manager, **kw)

    script = [ai(call("a")), AIMessage("I give up"), ai(call("big")), ai(call("b")), AIMessage("I give up"),
              AIMessage("a and b say 1")]
    guard = BudgetGuard(PromptOracle(), Market([PricedTool("a", 10), PricedTool("b", 10), PricedTool("big", 90)]), 50)
    res = DFSDTRunner(guard, [_tool("a"), _tool("b"), _tool("big")], width=3, max_depth=3,
                      summarize=True).run(Recording(messages=iter(script), bound=[]), "q")
    assert res.answer == "a and b say 1" and res.pruned == 1 and res.summarized
    ran = [m.name for m in res.messages if isinstance(m, ToolMessage)]
    assert ran == ["a", "b"]  # both branches' calls; the refused one never ran
    assert res.llm_calls == len(seen) == 6
