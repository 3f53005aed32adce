"""Market v2 (issue 16, section 1): dependency-aware DP, clairvoyant bound, executor, generator,
and the optimal gate's zero regret. Brute-force references are written independently of the DP."""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace

import pytest

from eval.synthetic import Need, SyntheticEnvironment, Task, ToolSpec, clairvoyant_plan, optimal_plan
from eval.synthetic.generator_v2 import entity_region, generate_tasks_v2, provider_region


def _need(nid: str, requires: tuple[str, ...] = ()) -> Need:
    return Need(nid, f"dom_{nid}", f"the {nid} fact", (f"k_{nid}",), requires)


def _tool(name: str, covers: set[str], price: int, p: float) -> ToolSpec:
    tier = "composite" if len(covers) > 1 else "mid"
    return ToolSpec(name, "x", frozenset(covers), tier, price, p, 1.0)


def _task(needs: list[Need], tools: list[ToolSpec], budget: float, seed: int = 7) -> Task:
    return Task("hand", "q", tuple(needs), tuple(tools), budget,
                {n.id: {f"k_{n.id}": f"v_{n.id}"} for n in needs}, seed=seed)


def _brute_value(task: Task, satisfied: frozenset[str], budget: int) -> float:
    """V(S, b) by plain recursion over every next call (no pruning, no vectorisation)."""
    need_ids = task.need_ids

    @functools.lru_cache(maxsize=None)
    def v(s: frozenset[str], b: int) -> float:
        if need_ids <= s:
            return 1.0
        best = 0.0
        for t in task.tools:
            if t.price > b:
                continue
            gained = frozenset(n for n in t.covers if n not in s and set(task.need(n).requires) <= s)
            if not gained:
                continue
            val = t.base_success * v(s | gained, b - t.price) + (1 - t.base_success) * v(s, b - t.price)
            best = max(best, val)
        return best

    return v(frozenset(satisfied), budget)


# A: independent; B takes A's result; C independent; bundle_bc covers B and C (a tool that touches
# a dependency and an independent need: the DP must handle it, the clairvoyant bound refuses it).
_DEP_NEEDS = [_need("a"), _need("b", ("a",)), _need("c")]
_DEP_TOOLS = [
    _tool("a_cheap", {"a"}, 2, 0.4), _tool("a_sure", {"a"}, 5, 0.95),
    _tool("b_cheap", {"b"}, 1, 0.3), _tool("b_sure", {"b"}, 4, 0.9),
    _tool("c_one", {"c"}, 3, 0.7), _tool("bundle_bc", {"b", "c"}, 4, 0.6),
]


def test_dp_matches_brute_force_with_dependencies_on_every_state() -> None:
    task = _task(_DEP_NEEDS, _DEP_TOOLS, 16)
    plan = optimal_plan(task)
    ids = [n.id for n in task.needs]
    for r in range(len(ids) + 1):
        for sat in itertools.combinations(ids, r):
            for b in range(17):
                assert plan.probability(sat, b) == pytest.approx(_brute_value(task, frozenset(sat), b), abs=1e-9), \
                    (sat, b)


def test_dependency_makes_a_dependent_call_useless_until_its_prerequisite() -> None:
    task = _task(_DEP_NEEDS, _DEP_TOOLS, 16)
    plan = optimal_plan(task)
    # Without the dependency the bundle may go first (for B and C at once); with it, B's part of
    # the bundle is wasted until A is in, so the optimal value is strictly lower.
    free = _task([_need("a"), _need("b"), _need("c")], _DEP_TOOLS, 16)
    assert plan.probability((), 16) < optimal_plan(free).probability((), 16) - 1e-3
    # From {c}, a B provider alone is worth nothing: the value equals not calling it.
    assert plan.probability({"c"}, 1) == 0.0
    # The optimal policy never opens with a B-only provider when A is missing.
    for b in range(17):
        assert plan.next_call((), b) not in ("b_cheap", "b_sure")
        assert plan.next_call({"c"}, b) not in ("b_cheap", "b_sure")


def test_executor_refuses_a_dependent_need_before_its_prerequisite() -> None:
    task = _task([_need("a"), _need("b", ("a",))], [_tool("a_sure", {"a"}, 1, 1.0), _tool("b_sure", {"b"}, 1, 1.0)], 10)
    env = SyntheticEnvironment(task, 0)
    early = env.call("b_sure", {"k_b": "v_b"})
    assert not early.success and early.kind == "bad_args" and "come from the result of" in early.text
    assert env.call("a_sure", {"k_a": "v_a"}).satisfied == {"a"}
    assert env.call("b_sure", {"k_b": "v_b"}).satisfied == {"b"}


def _args_for(task: Task, tool: ToolSpec) -> dict[str, str]:
    return {k: v for n in tool.covers for k, v in task.canonical_args[n].items()}


def _brute_clairvoyant(task: Task, seed: int) -> int | None:
    """The least total price of a call sequence that solves the episode, by depth-first search over
    call sequences replayed in a fresh environment. Only calls that could still add a need (one
    of the tool's open needs has its prerequisites met) are tried: any other call pays for a draw
    that a later call would get anyway, so dropping it never raises the minimum."""
    cap = int(task.budget)
    relevant = [t for t in task.tools if t.covers]
    best: list[int | None] = [None]

    def replay(seq: tuple[ToolSpec, ...]) -> frozenset[str]:
        env = SyntheticEnvironment(task, seed)
        for t in seq:
            env.call(t.name, _args_for(task, t))
        return env.truth.satisfied

    def dfs(seq: tuple[ToolSpec, ...], cost: int) -> None:
        sat = replay(seq)
        if sat >= task.need_ids:
            best[0] = cost if best[0] is None else min(best[0], cost)
            return
        for t in relevant:
            if cost + t.price > cap or (best[0] is not None and cost + t.price >= best[0]):
                continue
            if not any(n not in sat and set(task.need(n).requires) <= sat for n in t.covers):
                continue
            dfs((*seq, t), cost + t.price)

    dfs((), 0)
    return best[0]


@pytest.mark.parametrize("seed", range(8))
def test_clairvoyant_plan_matches_brute_force_over_call_sequences(seed: int) -> None:
    needs = [_need("a"), _need("b", ("a",)), _need("c"), _need("d")]
    tools = [_tool("a1", {"a"}, 2, 0.5), _tool("a2", {"a"}, 4, 0.9), _tool("b1", {"b"}, 1, 0.5),
             _tool("c1", {"c"}, 2, 0.6), _tool("cd", {"c", "d"}, 3, 0.5), _tool("d1", {"d"}, 2, 0.7)]
    task = _task(needs, tools, 12, seed=seed)
    plan = clairvoyant_plan(task, seed)
    expected = _brute_clairvoyant(task, seed)
    assert plan.solvable == (expected is not None)
    assert plan.cost == expected
    if plan.solvable:  # replaying the plan's calls, in its order, solves the episode
        env = SyntheticEnvironment(task, seed)
        for name in plan.calls:
            spec = task.tool(name)
            env.call(name, {k: v for n in spec.covers for k, v in task.canonical_args[n].items()})
        assert env.truth.satisfied >= task.need_ids


def test_clairvoyant_plan_refuses_bundles_on_dependencies() -> None:
    with pytest.raises(ValueError, match="bundle_bc"):
        clairvoyant_plan(_task(_DEP_NEEDS, _DEP_TOOLS, 16), 0)


def test_bad_dependencies_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="requires names the need itself"):
        _need("a", ("a",))
    with pytest.raises(ValueError, match="requires unknown needs"):
        _task([_need("a", ("zz",))], [_tool("t", {"a"}, 1, 0.5)], 5)
    with pytest.raises(ValueError, match="cycle"):
        _task([_need("a", ("b",)), _need("b", ("a",))], [_tool("t", {"a"}, 1, 0.5)], 5)


def test_generator_v2_recipe() -> None:
    tasks = generate_tasks_v2(120, 3)
    assert tasks == generate_tasks_v2(120, 3) and tasks[:10] == generate_tasks_v2(10, 3)
    assert sum(t.has_dependencies for t in tasks) >= 30
    for t in tasks:
        assert t.budget == 50
        related = {n.id for n in t.needs if n.requires} | {r for n in t.needs for r in n.requires}
        for tool in t.tools:
            assert len(tool.covers) < 2 or not (tool.covers & related), "bundles stay off dependencies"
        for n in t.needs:
            provs = t.providers(n.id)
            cheap = [x for x in provs if x.tier == "cheap"]
            mids = [x for x in provs if x.tier == "mid"]
            prem = [x for x in provs if x.tier == "premium"]
            good = [x for x in mids if x.base_success >= 0.85]
            assert len(good) == 1 and len(mids) == 2
            # the reliable standard provider is the one whose region matches the query's entity
            word = good[0].name.split("_")[1]
            assert provider_region(n.domain, word) == entity_region(n.domain, t.canonical_args[n.id])
            # traps: a cheap call's expected cost exceeds one reliable call; the premium eats most of B
            assert cheap[0].price / cheap[0].base_success > good[0].price
            assert prem[0].price >= 0.55 * t.budget - 1
        for tool in t.tools:
            if tool.tier == "composite":
                singles = sum(min(x.price / x.base_success for x in t.providers(n) if len(x.covers) == 1)
                              for n in tool.covers)
                assert tool.price < sum(min(x.price for x in t.providers(n) if x.tier == "mid") for n in tool.covers)
                assert tool.price / tool.base_success > 0.9 * singles  # cheap per need, poor as a whole
    # 50-equivalent: another budget scales every price with it
    doubled = generate_tasks_v2(5, 3, budget=100)
    assert [t.budget for t in doubled] == [100] * 5
    assert sum(x.price for x in doubled[0].tools if x.covers) > 1.6 * sum(x.price for x in tasks[0].tools if x.covers)


def test_generator_v2_bad_input_names_the_field() -> None:
    with pytest.raises(ValueError, match="budget"):
        generate_tasks_v2(3, 0, budget=-1)
    with pytest.raises(ValueError, match="event_rate"):
        generate_tasks_v2(3, 0, event_rate=2)


def test_optimal_gate_has_zero_regret_on_v2() -> None:
    from eval.agents.llm_like import llm_agent_factory
    from eval.markets import SyntheticV2BenchMarket
    from eval.methods import get_method
    from eval.runner import run_episode

    market = SyntheticV2BenchMarket(25, 0)
    spec = get_method("optimal")
    audited = 0
    for task in market.tasks():
        res = run_episode(spec, market.episode(task, 0), 0, llm_agent_factory())
        assert not res.error
        audited += res.extra["decisions_audited"]
        if res.extra["decisions_audited"]:
            assert res.extra["decision_regret"] == pytest.approx(0.0, abs=1e-9)
    assert audited > 25


def test_v2_optimal_value_differs_from_the_dependency_blind_value() -> None:
    # The dependency-aware DP is what the gate uses: on generated tasks with dependencies,
    # ignoring them would overstate V* somewhere (else the dependencies would not matter).
    tasks = [t for t in generate_tasks_v2(60, 1) if t.has_dependencies]
    blind = [replace(t, needs=tuple(replace(n, requires=()) for n in t.needs)) for t in tasks]
    gaps = [optimal_plan(b).probability((), 20) - optimal_plan(t).probability((), 20) for t, b in zip(tasks, blind)]
    assert min(gaps) >= -1e-12 and max(gaps) > 0.01


def test_call_value_counts_a_dependent_need_only_after_its_prerequisite() -> None:
    from eval.optimal import StateValues

    task = _task(_DEP_NEEDS, _DEP_TOOLS, 16)
    values, market = StateValues(task), task.market()
    plan = optimal_plan(task)
    # Before A: b_sure only spends money; its value is that of the state with less budget.
    assert values.call_value(market, frozenset(), 16, "b_sure", {"k_b": "v_b"}) == \
        pytest.approx(plan.probability((), 12), abs=1e-12)
    # After A it can satisfy B.
    after = values.call_value(market, frozenset({"a"}), 16, "b_sure", {"k_b": "v_b"})
    assert after == pytest.approx(0.9 * plan.probability({"a", "b"}, 12) + 0.1 * plan.probability({"a"}, 12))
    # The bundle before A counts for C only.
    bundle = values.call_value(market, frozenset(), 16, "bundle_bc", {"k_b": "v_b", "k_c": "v_c"})
    assert bundle == pytest.approx(0.6 * plan.probability({"c"}, 12) + 0.4 * plan.probability((), 12))
