"""Benchmark markets behind one small interface, so the runner does not care which one it runs.

A :class:`BenchMarket` lists tasks and turns one into an :class:`EpisodeEnv`: the priced
market, LangChain tools bound to a (simulated) environment, what the simulated agent knows
about the task, the ground truth where there is one, and the judge.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from langchain_core.tools import BaseTool, StructuredTool

from eval.agents.simulated import NeedView, TaskView
from intent.errors import IntentError, UsageError
from intent.market import Market

__all__ = ["BenchMarket", "EnvironmentUnavailableError", "EpisodeEnv", "SyntheticBenchMarket", "tier_from_description"]


class EnvironmentUnavailableError(IntentError):
    """The tool environment's endpoint failed to answer calls (see ``EpisodeEnv.environment_failures``)."""

    @classmethod
    def of(cls, env: EpisodeEnv) -> EnvironmentUnavailableError:
        fails = env.environment_failures
        return cls(f"{env.task_id}: {len(fails)} call(s) got no response from the environment's endpoint (first: "
                   f"{fails[0]}); check --stb-env-url and --stb-env-model, then run the same command again")


@dataclass
class EpisodeEnv:
    task_id: str
    group: str
    query: str
    budget: float
    market: Market
    tools: list[BaseTool]
    view: TaskView
    solvable: bool | None
    judge: Callable[[str | None], float]
    environment: str
    # Called by the runner after every executed call with the market now in force
    # (CostBench-style events); None when the market is static.
    market_now: Callable[[], Market] | None = None
    # (No answer key here: method builders get this object as ctx.env, and only the judge may read the key,
    # which its closure holds.)
    # A world model that knows this market's response schemas (StableToolBench), used by the
    # planning oracles instead of the replay model when present.
    schema_world_model: Any = None
    # The environment's hidden state (synthetic: eval.optimal.SyntheticTruth). Only upper bounds
    # (the ``optimal`` gate) and measurements (decision regret) may read it, never an oracle under test.
    ground_truth: Any = None
    # Calls the environment's own infrastructure failed to answer (a MirrorAPI-style simulator's
    # endpoint down, timing out, answering 500 or not JSON), filled by the market as calls run. The
    # runner records an episode with any as crashed (failed, infeasible, listed, re-run on resume):
    # its observations were not the environment's, so its row must not count it.
    environment_failures: list[str] = field(default_factory=list)
    # The judge of one search branch (``judge_branch(messages)`` is a judge like ``judge``), for a tree
    # search whose branches all run in this one environment: a branch is judged on what its own calls
    # returned, as StableToolBench judges the chain a DFS returns, never on what an abandoned sibling found.
    judge_branch: Callable[[Sequence[Any]], Callable[[str | None], float]] | None = None


class BenchMarket(Protocol):
    name: str
    label: str

    def tasks(self) -> Sequence[Any]: ...

    def task_id(self, task: Any) -> str: ...

    def episode(self, task: Any, seed: int) -> EpisodeEnv: ...


def scale_relevant_prices(task: Any, factor: float) -> Any:
    """The paper's price-robustness study: scale the prices of the reference (relevant) tools.

    In the synthetic market the relevant tools are those that cover at least one need; prices
    stay integers >= 1 (rounded half to even). Distractors keep their prices.
    """
    from dataclasses import replace

    tools = tuple(replace(t, price=max(1, int(round(t.price * factor)))) if t.covers else t for t in task.tools)
    return replace(task, tools=tools)


def tier_from_description(description: str) -> str:
    """How an agent reads a provider's tier off its description (no hidden information)."""
    d = description.lower()
    if "bundle" in d:
        return "composite"
    if "premium" in d:
        return "premium"
    if "standard" in d:
        return "mid"
    if "community" in d or "cheap" in d:
        return "cheap"
    return "unknown"


class SyntheticBenchMarket:
    """The built-in default: ``eval.synthetic`` tasks with exact ground truth (simulated)."""

    name = "synthetic"

    def __init__(self, n: int, seed: int, *, event_rate: float = 0.0, budget: float | None = None,
                 budget_scale: float = 1.0, relevant_price_scale: float = 1.0) -> None:
        from eval.synthetic import SIMULATED_LABEL, generate_tasks

        if relevant_price_scale <= 0:
            raise UsageError(f"relevant_price_scale must be > 0, got {relevant_price_scale}")
        self.label = SIMULATED_LABEL
        tasks = generate_tasks(n, seed, event_rate=event_rate, budget=budget, budget_scale=budget_scale)
        if relevant_price_scale != 1.0:
            tasks = [scale_relevant_prices(t, relevant_price_scale) for t in tasks]
        self._tasks = tasks

    def tasks(self) -> Sequence[Any]:
        return self._tasks

    def task_id(self, task: Any) -> str:
        return str(task.task_id)

    def solvable(self, task: Any, seed: int) -> bool:
        """OR's denominator: can a policy that knows every call's outcome solve this episode in budget?"""
        from eval.synthetic import clairvoyant_plan

        return clairvoyant_plan(task, seed).solvable

    def episode(self, task: Any, seed: int) -> EpisodeEnv:
        from eval.optimal import SyntheticTruth
        from eval.synthetic import ENVIRONMENT_LABEL, SyntheticEnvironment, judge

        env = SyntheticEnvironment(task, seed)
        lock = threading.Lock()  # parallel tool calls share one environment

        def make_tool(spec: Any) -> StructuredTool:
            keys = sorted({k for nid in spec.covers for k in task.need(nid).arg_keys})
            schema = {
                "title": spec.name,
                "type": "object",
                "properties": {k: {"type": "string", "description": k} for k in keys},
                "required": keys,
            }

            def run(**kwargs: Any) -> tuple[str, dict[str, Any]]:
                with lock:
                    obs = env.call(spec.name, kwargs)
                # The artifact is not shown to the agent; the guard logs it, so training and the
                # replay world model get the exact label z (did the call satisfy a need?).
                return obs.text, {"z": int(bool(obs.satisfied)), "satisfied": sorted(obs.satisfied),
                                  "environment": obs.environment}

            return StructuredTool.from_function(run, name=spec.name, description=spec.description,
                                                args_schema=schema, response_format="content_and_artifact")

        def market_now() -> Market:
            with lock:
                return env.market

        needs = tuple(
            NeedView(n.id, n.description, dict(task.canonical_args[n.id]), tuple(s.name for s in task.providers(n.id)))
            for n in task.needs
        )
        view = TaskView(
            task_id=task.task_id,
            query=task.query,
            needs=needs,
            covers={s.name: frozenset(s.covers) for s in task.tools},
            tiers={s.name: tier_from_description(s.description) for s in task.tools},
        )
        return EpisodeEnv(
            task_id=task.task_id,
            group=f"{len(task.needs)}-need",
            query=task.query,
            budget=float(task.budget),
            market=task.market(),
            tools=[make_tool(s) for s in task.tools],
            view=view,
            solvable=self.solvable(task, seed),
            judge=lambda answer: float(judge(env.truth, bool(answer))),
            judge_branch=lambda messages: _branch_judge(task, messages),
            environment=ENVIRONMENT_LABEL,
            market_now=market_now if task.events else None,
            ground_truth=SyntheticTruth(task, env, lock),
        )


def _branch_judge(task: Any, messages: Sequence[Any]) -> Callable[[str | None], float]:
    """The synthetic judge (an answer, and every need satisfied) on one branch's own tool results."""
    from langchain_core.messages import ToolMessage

    satisfied: set[str] = set()
    for m in messages:
        if isinstance(m, ToolMessage) and isinstance(m.artifact, dict):
            satisfied.update(m.artifact.get("satisfied", ()))
    return lambda answer: float(bool(answer) and all(n.id in satisfied for n in task.needs))


class SyntheticV2BenchMarket(SyntheticBenchMarket):
    """Market v2 (``--market synthetic-v2``): dependencies, cost traps, query-dependent quality
    (:mod:`eval.synthetic.generator_v2`), exact ground truth kept. Budgets are 50-equivalent:
    ``--budget`` sets the budget and every price scales with it."""

    name = "synthetic-v2"

    def __init__(self, n: int, seed: int, *, event_rate: float = 0.0, budget: float | None = None,
                 budget_scale: float = 1.0, relevant_price_scale: float = 1.0) -> None:
        from eval.synthetic import SIMULATED_LABEL
        from eval.synthetic.generator_v2 import generate_tasks_v2

        if relevant_price_scale <= 0:
            raise UsageError(f"relevant_price_scale must be > 0, got {relevant_price_scale}")
        self.label = SIMULATED_LABEL + "; market v2 (dependencies, cost traps, query-dependent quality)"
        tasks = generate_tasks_v2(n, seed, event_rate=event_rate, budget=budget, budget_scale=budget_scale)
        if relevant_price_scale != 1.0:
            tasks = [scale_relevant_prices(t, relevant_price_scale) for t in tasks]
        self._tasks = tasks

    def episode(self, task: Any, seed: int) -> EpisodeEnv:
        from dataclasses import fields

        from eval.agents.llm_like import TaskViewV2

        env = super().episode(task, seed)
        # The query states which need takes another's result ("then, using that result"), so
        # the agent's view carries it; the hidden probabilities stay out of the view.
        base = {f.name: getattr(env.view, f.name) for f in fields(env.view)}
        env.view = TaskViewV2(**base, requires={n.id: tuple(n.requires) for n in task.needs if n.requires})
        env.group = f"{len(task.needs)}-need" + ("+dep" if task.has_dependencies else "")
        return env


def follow_market_events(guard: Any, episode_id: str, market_now: Callable[[], Market]) -> None:
    """Give ``guard``'s episode the market as the environment's events have made it (before each model step)."""
    now = market_now()
    if now.version != guard.market_for(episode_id).version:
        # (create: the first model step of a run calls this before the guard's own step makes the episode)
        guard.update_episode_market(episode_id, now, create=True)
