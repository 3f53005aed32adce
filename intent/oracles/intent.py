"""INTENT: the intention-based oracle (paper, section 3.3, Algorithm 3, Appendix A.2).

For a proposal ``a_t`` with ``B_t`` left:

1. **Last-call cache**: the same call as the last rejected one (``a_t ≈ ā``: same tool, arguments matched
   tolerantly as the rollout cache's, :func:`~intent.oracles.caches.args_match`) is accepted if
   ``price <= B_t``. The
   paper has one call per step; with parallel calls every call rejected in the previous simulated turn
   counts as "the last rejected" (see :mod:`intent.oracles.caches`), whatever else that turn or this
   one decided.
2. **Rollout cache**: a proposal matching the head of the cached plan is accepted (if it fits)
   without simulating, and the head is popped; a miss clears the cache.
3. **Ideal trajectory**: the agent's policy is rolled out against the conditional generator
   ``W_psi(o | T, u, z=1)`` (every call succeeds), to an answer or ``max_depth`` turns.
4. **Intention prediction**, one batched call per simulated turn: ``p_k = P(z=1 | r_k, T_k, u_k)``.
   Tools with ``p_k < delta`` join the episode's **blacklist** at once (hidden from the rest of the
   rollout and from the agent), as in Algorithm 3.
5. **Geometric cost calibration**: ``c_k = price_k / p_k``; accept iff
   ``price(a_t) <= B_t and gamma * sum_k c_k <= B_t``. On acceptance the rest of the plan is
   cached; on rejection the agent gets the predicted tool trace (price, p_success,
   expected cost; no arguments, no simulated contents) and the call becomes the last rejected.

Switches map to the paper's ablations (Tables 3 and 4): ``predictor`` = Optimistic /
Uncalibrated / Empirical Mean; ``stochastic=True`` samples the unconditional world model
(MCO-style) instead of the ideal trajectory; ``lookahead=False`` is "No Rollout" (only the
immediate action, risk-adjusted); ``trace_feedback=False`` is "No Trace";
``rollout_cache``, ``last_call_cache``, ``blacklist`` switch each mechanism off.

``ideal_plan_must_fit=True`` is an extension (off: Algorithm 3 as published): the plan must also fit at
face value, ``sum_k price_k <= B_t``. The ideal trajectory is what the plan costs if every call works
the first time, and ``gamma < 1`` alone can accept a plan over the budget even then. The check reads
the same steps as the paper's test, so with ``stochastic=True`` it is the sampled trajectory's prices
(MCO's test), and with ``lookahead=False`` it adds nothing (the immediate price must fit anyway). The
caches are the paper's: a rollout-cache hit is not checked again, and the last-call cache accepts a
call the agent proposes again after this refusal too. ``usage["plan_price"]`` is reported with every
simulated decision, ``usage["best_case_over"]`` = 1 when the plan is over the budget at face value.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable
from typing import Any

from intent import feedback as fb
from intent.errors import UsageError, model_call
from intent.market import Market
from intent.model_protocols import predict_many
from intent.oracle import ACCEPTED, CACHE_HIT, PLAN_OVER_BUDGET, Decision, DecisionContext, PlannedStep
from intent.oracles.base import ModelErrorPolicy, PlanningOracle, check_flags, check_model, usage
from intent.oracles.caches import CachedStep
from intent.policy import AgentPolicy
from intent.rollout import SimStep, simulate_rollout

__all__ = ["IntentOracle"]

LAST_CALL_HIT = "last_call_cache"
P_FLOOR = 1e-3  # p is clipped here so that price / p stays finite


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)


class IntentOracle(PlanningOracle):
    name = "intent"

    def __init__(
        self,
        policy: AgentPolicy | Callable[[DecisionContext], AgentPolicy],
        generator: Any,
        predictor: Any,
        *,
        gamma: float = 0.5,
        delta: float = 0.1,
        max_depth: int = 8,
        rollout_cache: bool = True,
        last_call_cache: bool = True,
        blacklist: bool = True,
        trace_feedback: bool = True,
        stochastic: bool = False,
        lookahead: bool = True,
        show_market: bool = True,
        alternatives: int = 0,
        ideal_plan_must_fit: bool = False,
        on_model_error: ModelErrorPolicy = "accept_if_fits",
        merge_identical_calls: bool = True,
    ) -> None:
        super().__init__(policy, max_depth=max_depth, show_market=show_market, on_model_error=on_model_error,
                         merge_identical_calls=merge_identical_calls)
        if not (_is_number(gamma) and 0 < gamma < math.inf):
            raise UsageError(f"gamma must be a finite number > 0 (the paper uses 0.5; 0.5-0.7 is the sweet spot), "
                             f"got {gamma!r}")
        if not (_is_number(delta) and 0 <= delta < 1):
            raise UsageError(f"delta must be a number in [0, 1) (the paper uses 0.1), got {delta!r}")
        check_model(generator, "generator (the conditional world model)", ("simulate", "simulate_with_usage"))
        check_model(predictor, "predictor (the intention predictor)", ("predict", "predict_batch"))
        check_flags(rollout_cache=rollout_cache, last_call_cache=last_call_cache, blacklist=blacklist,
                    trace_feedback=trace_feedback, stochastic=stochastic, lookahead=lookahead,
                    ideal_plan_must_fit=ideal_plan_must_fit)
        self.generator, self.predictor = generator, predictor
        self.gamma, self.delta = gamma, delta
        self.rollout_cache, self.last_call_cache, self.use_blacklist = rollout_cache, last_call_cache, blacklist
        self.trace_feedback, self.stochastic, self.lookahead = trace_feedback, stochastic, lookahead
        if isinstance(alternatives, bool) or not isinstance(alternatives, int) or alternatives < 0:
            raise UsageError(f"alternatives must be an int >= 0 (0 = off), got {alternatives!r}")
        self.alternatives = alternatives
        self.ideal_plan_must_fit = ideal_plan_must_fit

    def visible_tools(self, market: Market, episode_id: str) -> list[str] | None:
        if not self.use_blacklist:
            return None
        hidden = self.memory.blacklist(episode_id)
        return [n for n in market.names if n not in hidden] if hidden else None

    def _decide(self, ctx: DecisionContext) -> Decision:
        started = time.perf_counter()
        eid, tool, args, price, left = ctx.episode_id, ctx.tool, dict(ctx.args), ctx.price, ctx.remaining
        fits = price <= left + 1e-9
        if self.last_call_cache and self.memory.is_last_rejected(eid, tool, args, step=ctx.step):
            if fits:
                self.memory.take_last_rejected(eid, tool, args, step=ctx.step)
                return Decision.accepted(reason=LAST_CALL_HIT, last_call_hit=1)
        if self.rollout_cache:
            if self.memory.pop_if_head(eid, tool, args, fits=fits):
                return Decision.accepted(reason=CACHE_HIT, cache_hit=1)

        predicted: list[float] = []
        newly_hidden = 0

        def predict(batch: list[SimStep]) -> list[float]:
            with model_call(f"intention predictor {type(self.predictor).__name__}"):
                got = predict_many(self.predictor, [(s.reasoning, s.tool, s.args) for s in batch])
            return [min(1.0, max(P_FLOOR, p)) for p in got]

        def on_turn(batch: list[SimStep]) -> set[str]:
            # Algorithm 3: each simulated step is scored as it is taken; a tool below delta joins the
            # blacklist at once, so the rest of this rollout (and the agent from now on) cannot use it.
            nonlocal newly_hidden
            ps_turn = predict(batch)
            predicted.extend(ps_turn)
            low = {s.tool for s, p in zip(batch, ps_turn) if p < self.delta}
            if not (self.use_blacklist and low):
                return set()
            newly_hidden += len(low - self.memory.blacklist(eid))
            self.memory.blacklist(eid, low)
            return low

        if self.lookahead:
            rollout = simulate_rollout(
                ctx, self.policy_for(ctx), self.generator, satisfied=None if self.stochastic else True,
                max_depth=self.max_depth, visible=self.visible(ctx), notes=self.notes(ctx), on_turn=on_turn,
                merge_identical_calls=self.merge_identical_calls, shown=self.shown_in_rollout(ctx))
            steps = rollout.steps
        else:  # "No Rollout": the immediate action alone
            rollout = None
            steps = [SimStep(tool, args, ctx.reasoning, price, "", 0)]
            on_turn(steps)
        if not steps or steps[0].tool != tool:
            first = SimStep(tool, args, ctx.reasoning, price, "", 0)
            steps = [first, *steps]
            predicted[:0] = predict([first])
        ps = predicted
        trace = [PlannedStep(s.tool, s.price, p) for s, p in zip(steps, ps)]
        sigma = sum(step.expected_cost or 0.0 for step in trace)
        plan_price = sum(s.price for s in steps)
        # The ideal trajectory is what the plan costs if every call works the first time. With
        # gamma < 1 the paper's test alone can accept a plan over the budget even then
        # (gamma * sigma <= B while sum(price) > B); ``ideal_plan_must_fit`` refuses those too
        # (an extension; off = Algorithm 3 as published).
        best_case_over = plan_price > left + 1e-9
        info = usage(
            tokens=(rollout.policy_tokens + rollout.world_model_tokens) if rollout else 0,
            policy_tokens=rollout.policy_tokens if rollout else 0,
            world_model_tokens=rollout.world_model_tokens if rollout else 0,
            rollout_steps=len(steps), rollout_turns=rollout.turns if rollout else 0,
            rollout_capped=int(rollout.capped) if rollout else 0,
            predictor_items=len(steps), risk_cost=self.gamma * sigma, plan_price=plan_price,
            best_case_over=best_case_over,
            below_delta=sum(p < self.delta for p in ps), blacklisted=newly_hidden,
            oracle_ms=(time.perf_counter() - started) * 1000.0,
        )
        if fits and self.gamma * sigma <= left + 1e-9 and not (self.ideal_plan_must_fit and best_case_over):
            if self.rollout_cache:
                self.memory.set_rollout(eid, [CachedStep(s.tool, s.args) for s in steps[1:]])
            self.memory.set_last_rejected(eid, None, step=ctx.step)
            return Decision(True, "", tuple(trace), ACCEPTED, info)
        self.memory.set_last_rejected(eid, tool, args, step=ctx.step)
        feedback = fb.plan_rejection(left, self.gamma * sigma, self.gamma, trace if self.trace_feedback else None,
                                     plan_price=plan_price if self.ideal_plan_must_fit else None)
        if self.alternatives:
            alts = self._alternatives(ctx, left)
            if alts:
                feedback += "\n" + fb.alternatives_table(alts)
        return Decision(False, feedback, tuple(trace), PLAN_OVER_BUDGET, info)

    def _alternatives(self, ctx: DecisionContext, left: float) -> list[PlannedStep]:
        """Other visible tools that take the same arguments, scored by the predictor on the same
        reasoning and arguments: the ``alternatives`` affordable ones of least expected cost."""
        keys = set(ctx.args)
        schemas = {_tool_name(t): _arg_keys(t) for t in self.policy_for(ctx).tools}
        names = [n for n in self.visible(ctx)
                 if n != ctx.tool and schemas.get(n) == keys and ctx.market.price(n) <= left + 1e-9]
        if not names:
            return []
        with model_call(f"intention predictor {type(self.predictor).__name__}"):
            ps = predict_many(self.predictor, [(ctx.reasoning, n, dict(ctx.args)) for n in names])
        steps = [PlannedStep(n, ctx.market.price(n), min(1.0, max(P_FLOOR, p))) for n, p in zip(names, ps)]
        return sorted(steps, key=lambda s: (s.expected_cost or 0.0, s.tool))[: self.alternatives]


def _tool_name(tool: Any) -> str:
    return tool["name"] if isinstance(tool, dict) else getattr(tool, "name", str(tool))


def _arg_keys(tool: Any) -> set[str] | None:
    """The argument names a tool's schema declares (LangChain tool or OpenAI-style dict)."""
    if isinstance(tool, dict):
        params = tool.get("parameters") or tool.get("function", {}).get("parameters") or {}
        return set((params.get("properties") or {}).keys())
    args = getattr(tool, "args", None)
    return set(args) if isinstance(args, dict) else None
