"""MCO: the Monte Carlo oracle (paper, section 3.2, Algorithm 2).

One lookahead rollout: the agent's own policy against the unconditional world model
``W_phi(o | T, u)``, sampled at the oracle's ``temperature`` (1.0, the paper's B.2), to an
answer or ``max_depth`` turns. The temperature reaches the world model on every call
(:class:`intent.model_protocols.AtTemperature`) when the model takes a per-call ``temperature``
(every shipped sampling backend does); a model without that keyword samples at its own
setting, and ``temperature_applied`` is then False. ``temperature=None`` also leaves the
model's own setting. Accept iff the simulated plan's total price is at most ``B_t``; otherwise
reject with the simulated future actions as feedback. The optional rollout cache accepts a
proposal that matches the head of the last accepted plan without simulating.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable
from typing import Any

from intent import feedback as fb
from intent.model_protocols import AtTemperature, accepts_temperature, canonical_args
from intent.oracle import ACCEPTED, CACHE_HIT, PLAN_OVER_BUDGET, Decision, DecisionContext, PlannedStep
from intent.errors import UsageError
from intent.oracles.base import ModelErrorPolicy, PlanningOracle, check_flags, check_model, usage
from intent.oracles.caches import CachedStep
from intent.policy import AgentPolicy
from intent.rollout import simulate_rollout

__all__ = ["MCOOracle"]


class MCOOracle(PlanningOracle):
    name = "mco"

    def __init__(self, policy: AgentPolicy | Callable[[DecisionContext], AgentPolicy], world_model: Any, *,
                 max_depth: int = 8, temperature: float | None = 1.0, rollout_cache: bool = True,
                 show_market: bool = True, on_model_error: ModelErrorPolicy = "accept_if_fits",
                 merge_identical_calls: bool = True) -> None:
        super().__init__(policy, max_depth=max_depth, show_market=show_market, on_model_error=on_model_error,
                         merge_identical_calls=merge_identical_calls)
        check_model(world_model, "world_model", ("simulate", "simulate_with_usage"))
        if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, numbers.Real)
                                        or not 0 <= temperature < math.inf):
            raise UsageError(f"temperature must be a finite number >= 0 (the paper samples at 1.0) or None (the world "
                             f"model's own setting), got {temperature!r}")
        check_flags(rollout_cache=rollout_cache)
        self.temperature = temperature
        self.temperature_applied = temperature is not None and accepts_temperature(world_model)
        self.world_model = AtTemperature(world_model, temperature) if self.temperature_applied else world_model
        self.rollout_cache = rollout_cache

    def _decide(self, ctx: DecisionContext) -> Decision:
        started = time.perf_counter()
        eid, left = ctx.episode_id, ctx.remaining
        fits = ctx.price <= left + 1e-9
        if self.rollout_cache and self.memory.pop_if_head(eid, ctx.tool, dict(ctx.args), fits=fits):
            return Decision.accepted(reason=CACHE_HIT, cache_hit=1)
        rollout = simulate_rollout(ctx, self.policy_for(ctx), self.world_model, satisfied=None,
                                   max_depth=self.max_depth, visible=self.visible(ctx), notes=self.notes(ctx),
                                   merge_identical_calls=self.merge_identical_calls, shown=self.shown_in_rollout(ctx))
        total = rollout.total_price
        trace = tuple(PlannedStep(s.tool, s.price) for s in rollout.steps)
        info = usage(tokens=rollout.policy_tokens + rollout.world_model_tokens, policy_tokens=rollout.policy_tokens,
                     world_model_tokens=rollout.world_model_tokens, rollout_steps=len(rollout.steps),
                     rollout_turns=rollout.turns, rollout_capped=int(rollout.capped), plan_cost=total, oracle_ms=(time.perf_counter() - started) * 1000)
        if fits and total <= left + 1e-9:
            if self.rollout_cache:
                self.memory.set_rollout(eid, [CachedStep(s.tool, s.args) for s in rollout.steps[1:]])
            return Decision(True, "", trace, ACCEPTED, info)
        actions = [{"tool": s.tool, "args": canonical_args(s.args), "price": s.price} for s in rollout.steps]
        return Decision(False, fb.rollout_rejection(left, total, actions), trace, PLAN_OVER_BUDGET, info)
