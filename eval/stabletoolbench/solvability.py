"""OR's denominator on StableToolBench: which queries are solvable under the budget (paper B.3).

The paper's procedure: for each query, an exhaustive DFSDT search (width 10) enumerates
tool-use trajectories until it has five unique solutions that satisfy the budget; the query is
solvable when at least one of them is judged correct. Here:

* the search is :class:`baselines.dfsdt.DFSDTRunner` with width 10, through the same guard as
  the DFSDT baseline (prices shown, hard gate), but with **a budget per path**
  (``per_path_budget``): every branch spends only what its own trajectory spends, so a
  solution is in budget when its own trajectory is; and a parallel batch that partly fits goes
  on with the calls that ran (``prune_partial_batches=False``), as upstream, where each call of
  a batch is its own node;
* a solution is a real (not give-up) answer; two solutions are the same when their executed
  calls (tool, canonical arguments) and answers are;
* each solution is judged by the market's own judge applied to that branch's calls
  (:meth:`StableToolBenchMarket.judge_path`: the proxy, or SoPR when configured); a score above
  0.5 is correct. A give-up that the judge passes (the proxy passes a partial answer that has
  every relevant API's result) also makes the query solvable: the judge would pass it in an
  episode, so the upper bound must count it; it does not count among the five solutions;
* the search stops at the first correct solution (the verdict is then already "solvable", as
  it would be after five), after five unique solutions, or after ``max_llm_calls`` agent turns
  (StableToolBench's ``max_query_count``, 200), which is recorded as ``capped``.

Results go to ``OUT/solvability.json``, keyed by everything that decides the verdict (budget,
prices, retrieval, environment, judge, the agent's need inference, the search's settings, the
agent and its seed); :func:`load_solvable` gives a market the verdicts of its own configuration
(it lives in :mod:`eval.stb_market`, which reads them, and is re-exported here: the market never imports
this module), and :func:`ensure_solvability` runs the searches still missing. ``python -m
eval.stabletoolbench.solvability --out DIR ...`` runs it from the command line with the
simulated agent.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eval.stb_market import SOLVABILITY_FILE, load_solvable, market_key, market_key_json
from intent.errors import UsageError

__all__ = ["SOLVABILITY_FILE", "SearchSettings", "SolvabilityResult", "ensure_solvability", "load_solvable",
           "search_solvable"]

_WRITE_LOCK = threading.Lock()


@dataclass(frozen=True)
class SearchSettings:
    width: int = 10
    solutions: int = 5
    max_llm_calls: int = 200
    max_depth: int = 12

    def __post_init__(self) -> None:
        for name in ("width", "solutions", "max_llm_calls", "max_depth"):
            if getattr(self, name) < 1:
                raise UsageError(f"SearchSettings.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class SolvabilityResult:
    solvable: bool
    solutions: int  # unique in-budget solutions found
    correct: int  # of which judged correct
    llm_calls: int
    capped: bool  # the search hit max_llm_calls before it could finish
    best_cost: float | None  # the cheapest correct solution's cost


def _signature(messages: Sequence[Any]) -> tuple[Any, ...]:
    from langchain_core.messages import AIMessage

    from worldmodel.formats import canonical_args

    calls = tuple((c["name"], canonical_args(c.get("args", {}))) for m in messages if isinstance(m, AIMessage)
                  for c in m.tool_calls)
    return calls, str(messages[-1].content)


def _path_cost(messages: Sequence[Any], market: Any) -> float:
    """What the branch's executed calls cost (a call the guard refused never ran)."""
    from langchain_core.messages import AIMessage, ToolMessage

    names: dict[str, str] = {}
    cost = 0.0
    for m in messages:
        if isinstance(m, AIMessage):
            names.update({c["id"]: c["name"] for c in m.tool_calls})
        elif isinstance(m, ToolMessage) and m.tool_call_id in names:
            artifact = m.artifact if isinstance(m.artifact, dict) else {}
            if "intent_reason" not in artifact and names[m.tool_call_id] in market:
                cost += market.price(names[m.tool_call_id])
    return cost


def search_solvable(market: Any, task: Any, agent_factory: Callable[[Any, int], Any], *, seed: int,
                    settings: SearchSettings = SearchSettings()) -> SolvabilityResult:
    """The exhaustive DFSDT search for one query (see the module docstring)."""
    from baselines.dfsdt import DFSDTRunner
    from baselines.prompt import PromptOracle
    from eval.method_spec import SYSTEM_PROMPT
    from intent.guard import BudgetGuard

    env = market.episode(task, seed)
    guard = BudgetGuard(PromptOracle(), env.market, env.budget, enforce=True, tool_errors="message")
    seen: set[tuple[Any, ...]] = set()
    correct_costs: list[float] = []

    def on_answer(messages: list[Any], gave_up: bool) -> bool:
        if gave_up:
            correct = market.judge_path(task, str(messages[-1].content), messages) > 0.5
            if correct:
                correct_costs.append(_path_cost(messages, env.market))
            return correct
        signature = _signature(messages)
        if signature in seen:
            return False
        cost = _path_cost(messages, env.market)
        if cost > env.budget + 1e-9:  # cannot happen under the per-path gate; never counted if it did
            return False
        seen.add(signature)
        if market.judge_path(task, str(messages[-1].content), messages) > 0.5:
            correct_costs.append(cost)
            return True
        return len(seen) >= settings.solutions

    runner = DFSDTRunner(guard, env.tools, width=settings.width, max_depth=settings.max_depth,
                         max_llm_calls=settings.max_llm_calls, system_prompt=SYSTEM_PROMPT, per_path_budget=True,
                         prune_partial_batches=False, on_answer=on_answer)
    res = runner.run(agent_factory(env, seed), env.query, episode_id=f"solvability:{env.task_id}:{seed}")
    if getattr(env, "environment_failures", None):
        # The environment's endpoint failed: "no solution found" would be the endpoint's verdict, cached in
        # OUT/solvability.json for good (a dead MirrorAPI endpoint marked every query unsolvable).
        from eval.markets import EnvironmentUnavailableError

        raise EnvironmentUnavailableError.of(env)
    return SolvabilityResult(solvable=bool(correct_costs), solutions=len(seen), correct=len(correct_costs),
                             llm_calls=res.llm_calls,
                             capped=not correct_costs and len(seen) < settings.solutions
                             and res.llm_calls >= settings.max_llm_calls,
                             best_cost=min(correct_costs) if correct_costs else None)


def ensure_solvability(market: Any, agent_factory: Callable[[Any, int], Any], *, seed: int,
                       agent_label: str, tasks: Sequence[Any] | None = None,
                       settings: SearchSettings = SearchSettings(), workers: int = 1,
                       progress: bool = False) -> dict[str, bool]:
    """Run the searches ``OUT/solvability.json`` lacks for ``market``'s configuration, save each
    verdict as it comes, and give the market its table (task id -> solvable)."""
    from eval.progress import progress as progress_bar

    path = market.out / SOLVABILITY_FILE
    key = market_key_json(market)
    search = {**asdict(settings), "agent": agent_label, "agent_seed": seed}
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault("label", "OR's denominator: exhaustive DFSDT search per query (paper B.3); see "
                             "eval/stabletoolbench/solvability.py")
    data.setdefault("searches", {})
    entry = data["searches"].get(key)
    if entry is None or entry.get("search") != search:  # other search settings: those verdicts do not apply
        entry = data["searches"][key] = {"market": market_key(market), "search": search, "tasks": {}}
    todo = [t for t in (tasks if tasks is not None else market.tasks()) if market.task_id(t) not in entry["tasks"]]

    def run(task: Any) -> None:
        result = search_solvable(market, task, agent_factory, seed=seed, settings=settings)
        with _WRITE_LOCK:
            entry["tasks"][market.task_id(task)] = asdict(result)
            _atomic_write(path, json.dumps(data, indent=2))

    with progress_bar(len(todo), "solvability", enabled=progress) as bar, ThreadPoolExecutor(max_workers=workers) as pool:
        for _ in pool.map(run, todo):
            bar.update(1)
    market.solvable_table = {tid: bool(r["solvable"]) for tid, r in entry["tasks"].items()}
    return market.solvable_table


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m eval.stabletoolbench.solvability --out DIR [--tasks N] ...`` (simulated agent)."""
    from eval.agents.simulated import SIMULATED_AGENT_LABEL, SimAgentConfig, SimulatedAgent
    from eval.stb_market import BUDGET, StableToolBenchMarket  # (imports nothing from here)

    p = argparse.ArgumentParser(prog="python -m eval.stabletoolbench.solvability", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the run directory (solvability.json is written there)")
    p.add_argument("--stb-path", default=None)
    p.add_argument("--groups", default=None, help="comma-separated groups (default: all six)")
    p.add_argument("--tasks", type=int, default=None, help="a spread subset of this many queries (default: all)")
    p.add_argument("--seed", type=int, default=0, help="the price seed and the agent's seed")
    p.add_argument("--retriever", choices=["tfidf", "minilm"], default="tfidf")
    p.add_argument("--budget", type=float, default=BUDGET)
    p.add_argument("--width", type=int, default=SearchSettings.width)
    p.add_argument("--solutions", type=int, default=SearchSettings.solutions)
    p.add_argument("--max-llm-calls", type=int, default=SearchSettings.max_llm_calls)
    p.add_argument("--workers", type=int, default=1)
    args = p.parse_args(argv)
    market = StableToolBenchMarket(root=args.stb_path, groups=args.groups.split(",") if args.groups else None,
                                   limit=args.tasks, seed=args.seed, out=args.out, retriever=args.retriever,
                                   budget=args.budget)
    table = ensure_solvability(
        market, lambda env, seed: SimulatedAgent(view=env.view, config=SimAgentConfig(), seed=seed), seed=args.seed,
        agent_label=SIMULATED_AGENT_LABEL, workers=args.workers, progress=True,
        settings=SearchSettings(width=args.width, solutions=args.solutions, max_llm_calls=args.max_llm_calls))
    print(f"{sum(table.values())} of {len(table)} queries solvable under budget {market.budget:g}; "
          f"{Path(args.out) / SOLVABILITY_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
