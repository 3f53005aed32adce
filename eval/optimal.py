"""The exact reference on the synthetic market: the ``optimal`` gate and ``decision_regret``.

Both read the episode's ground truth (the hidden success probabilities and which needs are
satisfied so far), so neither is an oracle one could deploy: ``optimal`` is an **upper bound**,
labelled as such, and the regret is a measurement taken beside the oracle under test.

The value of a state is ``V*(S, b)``, the budget-optimal probability of satisfying every need
from satisfied needs ``S`` with ``b`` money left (:func:`eval.synthetic.optimal_plan`, exact DP,
canonical arguments). The value of a gate decision on a proposed call ``(tool, args)``:

* **accept**: the expected ``V*`` after the call runs, with the call's true outcome model
  (service up with the tool's ``base_success``; each open need it covers then satisfied with
  probability ``arg_quality ** arg_sensitivity``, so sloppy arguments are worth less);
* **reject**: the best the agent could still do instead, ``max Q(call')`` over every other call
  (each available tool with the canonical arguments, the proposal itself excluded); a rejection
  costs nothing, so refusing a bad call is free and refusing the only good one is not.

``regret = V*(S, b) - value(decision)`` (>= 0), averaged over an episode's decisions. The
``optimal`` gate accepts exactly the calls whose value is ``V*`` (so its regret is 0) and
rejects the others naming the best call in its feedback (``Suggested call: tool {args}``).

With sequential dependencies (market v2), a call only counts for the covered needs whose
prerequisites are already satisfied, both in ``V*`` and in the value of a decision.

In a batch of parallel calls, a later call's state counts the money reserved for the earlier
accepted ones but not their outcomes (unknown when the gate decides).
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eval.method_spec import MethodContext, MethodSpec
from intent.errors import UsageError
from intent.market import Market
from intent.oracle import Decision, DecisionContext, Oracle, Outcome

__all__ = ["METHODS", "DecisionAudit", "OptimalGate", "StateValues", "SyntheticTruth"]

_TOL = 1e-9


@dataclass
class SyntheticTruth:
    """What the synthetic environment knows about one episode (never shown to an oracle under test)."""

    task: Any  # eval.synthetic.Task
    env: Any  # eval.synthetic.SyntheticEnvironment
    lock: threading.Lock

    def satisfied(self) -> frozenset[str]:
        with self.lock:
            return frozenset(self.env.truth.satisfied)


class StateValues:
    """``V*`` and the value of one call, for one task, under any market snapshot (cached per version)."""

    def __init__(self, task: Any) -> None:
        self.task = task
        self._plans: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _plan(self, market: Market) -> Any:
        from eval.synthetic import optimal_plan

        with self._lock:
            if market.version not in self._plans:
                self._plans[market.version] = optimal_plan(self.task, market=market)
            return self._plans[market.version]

    def value(self, market: Market, satisfied: frozenset[str], remaining: float) -> float:
        """``V*(S, b)``."""
        return self._plan(market).probability(satisfied, _money(remaining))

    def call_value(self, market: Market, satisfied: frozenset[str], remaining: float, tool: str,
                   args: Mapping[str, Any] | None) -> float:
        """The expected ``V*`` after running ``tool(args)`` now (0 if it cannot run)."""
        from eval.synthetic import arg_quality

        plan, task = self._plan(market), self.task
        spec = task.tool(tool)
        b = _money(remaining)
        if spec is None or tool not in market or not market.is_available(tool):
            return 0.0
        price = int(math.ceil(market.price(tool) - 1e-9))
        if price > b:
            return 0.0
        rest = b - price
        stay = plan.probability(satisfied, rest)
        # With sequential dependencies (market v2) a need whose prerequisites are not yet
        # satisfied cannot be satisfied by this call: only the enabled open needs count.
        open_needs = sorted(task.enabled(spec.covers, satisfied) - satisfied)
        if not open_needs:
            return stay
        q = [arg_quality(args or {}, task.canonical_args[n]) ** spec.arg_sensitivity for n in open_needs]
        up = 0.0
        for got in itertools.product((True, False), repeat=len(open_needs)):
            weight = math.prod(qi if g else 1.0 - qi for qi, g in zip(q, got))
            if weight > 0:
                up += weight * plan.probability(satisfied | {n for n, g in zip(open_needs, got) if g}, rest)
        return spec.base_success * up + (1.0 - spec.base_success) * stay

    def best_calls(self, market: Market, satisfied: frozenset[str], remaining: float
                   ) -> list[tuple[float, str, dict[str, str]]]:
        """Every available tool with the canonical arguments of its needs, best value first."""
        out = []
        for spec in self.task.tools:
            args = self.canonical_args(spec.name)
            out.append((self.call_value(market, satisfied, remaining, spec.name, args), spec.name, args))
        price = {n: market.price(n) if n in market else math.inf for _, n, _ in out}
        return sorted(out, key=lambda x: (-x[0], price[x[1]], x[1]))

    def canonical_args(self, tool: str) -> dict[str, str]:
        spec = self.task.tool(tool)
        args: dict[str, str] = {}
        for n in sorted(spec.covers) if spec else ():
            args.update(self.task.canonical_args[n])
        return args

    def regret(self, market: Market, satisfied: frozenset[str], remaining: float, tool: str,
               args: Mapping[str, Any] | None, accepted: bool) -> float:
        best = self.value(market, satisfied, remaining)
        if accepted:
            taken = self.call_value(market, satisfied, remaining, tool, args)
        else:
            proposal_is_canonical = self._is_canonical(tool, args)
            taken = max((v for v, name, _ in self.best_calls(market, satisfied, remaining)
                         if not (name == tool and proposal_is_canonical)), default=0.0)
        return max(0.0, best - taken)

    def _is_canonical(self, tool: str, args: Mapping[str, Any] | None) -> bool:
        from eval.synthetic import arg_quality

        spec = self.task.tool(tool)
        if spec is None:
            return False
        return all(arg_quality(args or {}, self.task.canonical_args[n]) >= 1.0 for n in spec.covers)


def _money(remaining: float) -> int:
    # Prices are integers: only the whole part of what is left can be spent.
    return max(0, int(math.floor(remaining + 1e-9)))


class OptimalGate(Oracle):
    """Accepts exactly the calls the budget-optimal policy would make; names the best call otherwise.

    An upper bound (it reads the hidden success probabilities and the satisfied needs).
    """

    name = "optimal"

    def __init__(self, truth: SyntheticTruth, values: StateValues | None = None) -> None:
        self.truth = truth
        self.values = values or StateValues(truth.task)

    def decide(self, ctx: DecisionContext) -> Decision:
        satisfied = self.truth.satisfied()
        best = self.values.value(ctx.market, satisfied, ctx.remaining)
        mine = self.values.call_value(ctx.market, satisfied, ctx.remaining, ctx.tool, ctx.args)
        if mine >= best - _TOL:
            return Decision.accepted(v_star=best, v_call=mine)
        ranked = self.values.best_calls(ctx.market, satisfied, ctx.remaining)
        value, tool, args = ranked[0]
        feedback = (f"Rejected: {ctx.tool} is not the best next call (success chance of the whole task "
                    f"{mine:.2f} with it, {value:.2f} at best). Suggested call: {tool} "
                    f"{json.dumps(args, sort_keys=True)}")
        return Decision.rejected(feedback, reason="not_optimal", v_star=best, v_call=mine)


class DecisionAudit(Oracle):
    """Wraps the oracle under test and measures each of its decisions' regret (see the module doc).

    Every hook is forwarded unchanged; the audit only reads the ground truth after the oracle
    decided, so it cannot change a decision.
    """

    def __init__(self, inner: Oracle, truth: SyntheticTruth, values: StateValues | None = None) -> None:
        self.inner = inner
        self.truth = truth
        self.values = values or StateValues(truth.task)
        self.name = getattr(inner, "name", type(inner).__name__)
        self.regrets: list[float] = []
        self.accepted: list[bool] = []  # beside each regret: was the decision an acceptance?
        self.reasons: list[str] = []  # ... and the oracle's reason (accepted, cache_hit, plan_over_budget, ...)
        self._lock = threading.Lock()

    def _measure(self, ctx: DecisionContext, decision: Decision) -> Decision:
        accepted = bool(getattr(decision, "accept", False))
        regret = self.values.regret(ctx.market, self.truth.satisfied(), ctx.remaining, ctx.tool, ctx.args, accepted)
        with self._lock:
            self.regrets.append(regret)
            self.accepted.append(accepted)
            self.reasons.append(str(getattr(decision, "reason", "") or ("accepted" if accepted else "rejected")))
        return decision

    def split(self) -> dict[str, Any]:
        """Regret sums and counts by decision kind (acceptances, rejections) and by the oracle's
        reason (``regret_by_reason``: reason -> [sum, count]), for pooling over episodes."""
        with self._lock:
            pairs = list(zip(self.regrets, self.accepted))
            by_reason: dict[str, list[float]] = {}
            for r, reason in zip(self.regrets, self.reasons):
                acc = by_reason.setdefault(reason, [0.0, 0])
                acc[0] += r
                acc[1] += 1
        return {"regret_accept_sum": sum(r for r, a in pairs if a), "regret_accept_n": sum(a for _, a in pairs),
                "regret_reject_sum": sum(r for r, a in pairs if not a), "regret_reject_n": sum(not a for _, a in pairs),
                "regret_by_reason": by_reason}

    def decide(self, ctx: DecisionContext) -> Decision:
        return self._measure(ctx, self.inner.decide(ctx))

    async def adecide(self, ctx: DecisionContext) -> Decision:
        return self._measure(ctx, await self.inner.adecide(ctx))

    def start(self, episode: Any) -> None:
        self.inner.start(episode)

    def observe(self, outcome: Outcome) -> None:
        self.inner.observe(outcome)

    def visible_tools(self, market: Market, episode_id: str) -> Any:
        return self.inner.visible_tools(market, episode_id)

    def prompt_notes(self, market: Market, episode_id: str, spent: float, remaining: float, budget: float) -> Any:
        return self.inner.prompt_notes(market, episode_id, spent, remaining, budget)

    def result_note(self, outcome: Outcome) -> Any:
        return self.inner.result_note(outcome)

    def episode_usage(self, episode_id: str) -> Any:
        return self.inner.episode_usage(episode_id)

    def __getattr__(self, name: str) -> Any:  # anything else an oracle offers (e.g. finish hooks)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _optimal(ctx: MethodContext) -> Oracle:
    truth = getattr(ctx.env, "ground_truth", None)
    if not isinstance(truth, SyntheticTruth):
        raise UsageError("method 'optimal' needs the synthetic market's ground truth; run it with --market synthetic "
                         "or --market synthetic-v2")
    return OptimalGate(truth)


METHODS: tuple[MethodSpec, ...] = (
    MethodSpec("optimal", True, _optimal,
               "UPPER BOUND: exact DP over (needs left, budget left) with the true success probabilities "
               "(synthetic market only)", upper_bound=True),
)
