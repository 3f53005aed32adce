"""BTP's enforcement as an oracle under the guard (following BTP's DFS/rapidapi code).

At the start of an episode: estimate v and F for the market's tools from experience, solve the
knapsack with ``capacity = B - c_s`` (``c_s`` = what was already spent, 0 at the start), hide the
tools with a zero quota and list them in the system prompt ("forbidden": budget-exceeded or
useless). Per call, checks in BTP's order: blacklisted -> "Useless API"; quota exhausted or
price above what is left -> "Budget Limitation Exceeded". Quotas decrement when a call is
accepted. After each call a usefulness judgment (pluggable) feeds the blacklist: one useless
result with no earlier success blacklists the tool (BTP's ``th_blacklist = 1``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from baselines.btp.experience import Embedder, ExperienceStore
from baselines.btp.knapsack import plan_quotas
from intent.feedback import market_notes
from intent.market import Market
from intent.oracle import (
    BLACKLISTED,
    OVER_BUDGET,
    QUOTA_EXHAUSTED,
    Decision,
    DecisionContext,
    EpisodeInfo,
    Oracle,
    Outcome,
)

__all__ = ["BTPOracle", "BUDGET_MESSAGE", "USELESS_MESSAGE"]

BUDGET_MESSAGE = ('{"error": "Budget Limitation Exceeded", "message": "This API is forbidden since using it will '
                  'exceed the budget limitation."}')
USELESS_MESSAGE = '{"error": "Useless API", "response": "This API was judged useless for this query; use another."}'


@dataclass
class _Plan:
    quotas: dict[str, int]
    useless: set[str]
    blacklist: set[str] = field(default_factory=set)
    succeeded: set[str] = field(default_factory=set)
    message: str = ""
    planning_ms: float = 0.0


class BTPOracle(Oracle):
    name = "btp"
    enforce = True

    def __init__(self, store: ExperienceStore | None = None, *, embedder: Embedder | None = None, tau: float = 0.15,
                 usefulness: Callable[[Outcome], bool] | None = None, show_prices: bool = True) -> None:
        self.store = store or ExperienceStore()
        self.embedder, self.tau = embedder, tau
        self.usefulness = usefulness or _default_usefulness
        self.show_prices = show_prices
        self._plans: dict[str, _Plan] = {}
        self._lock = threading.Lock()

    def start(self, episode: EpisodeInfo) -> None:
        started = time.perf_counter()
        market = episode.market
        prices = market.prices()
        est = self.store.estimate(episode.query, list(prices), self.embedder, tau=self.tau)
        # The knapsack's capacity is what is left, B - c_s (a later turn of a thread has spent some).
        quotas = plan_quotas(prices, est.values, est.caps, max(0.0, episode.budget - episode.spent))
        plan = _Plan(quotas, {t for t, f in est.caps.items() if f == 0}, message=est.message,
                     planning_ms=(time.perf_counter() - started) * 1000.0)
        with self._lock:
            self._plans[episode.episode_id] = plan

    def end(self, episode_id: str) -> None:
        """The run ended: its plan is dropped (the next run plans afresh at its start)."""
        with self._lock:
            self._plans.pop(episode_id, None)

    def _plan(self, episode_id: str) -> _Plan | None:
        with self._lock:
            return self._plans.get(episode_id)

    def decide(self, ctx: DecisionContext) -> Decision:
        plan = self._plan(ctx.episode_id)
        if plan is None:  # no start() (a guard built around an existing thread): plan now
            self.start(EpisodeInfo(ctx.episode_id, ctx.query, ctx.budget, ctx.market, spent=ctx.budget - ctx.remaining))
            plan = self._plan(ctx.episode_id)
            assert plan is not None
        with self._lock:
            if ctx.tool in plan.blacklist:
                return Decision.rejected(USELESS_MESSAGE, reason=BLACKLISTED)
            if plan.quotas.get(ctx.tool, 0) <= 0:
                return Decision.rejected(BUDGET_MESSAGE, reason=QUOTA_EXHAUSTED)
            if ctx.price > ctx.remaining + 1e-9:
                return Decision.rejected(BUDGET_MESSAGE, reason=OVER_BUDGET)
            plan.quotas[ctx.tool] -= 1
        return Decision.accepted(planning_ms=plan.planning_ms if ctx.step == 0 else 0.0)

    def observe(self, outcome: Outcome) -> None:
        plan = self._plan(outcome.episode_id)
        if plan is None:
            return
        useful = self.usefulness(outcome)
        with self._lock:
            if useful:
                plan.succeeded.add(outcome.proposal.tool)
            elif outcome.proposal.tool not in plan.succeeded:
                plan.blacklist.add(outcome.proposal.tool)

    def visible_tools(self, market: Market, episode_id: str) -> list[str] | None:
        plan = self._plan(episode_id)
        if plan is None:
            return None
        return [t for t in market.names if plan.quotas.get(t, 0) > 0 and t not in plan.blacklist]

    def prompt_notes(self, market: Market, episode_id: str, spent: float, remaining: float, budget: float) -> str:
        plan = self._plan(episode_id)
        parts = [market_notes(market, spent, remaining, budget)] if self.show_prices else []
        if plan is not None:
            exceeded = sorted(t for t in market.names if plan.quotas.get(t, 0) <= 0 and t not in plan.useless)
            useless = sorted((plan.useless | plan.blacklist) & set(market.names))
            if exceeded:
                parts.append("These functions are forbidden because using them would exceed the budget: "
                             + ", ".join(exceeded) + ".")
            if useless:
                parts.append("These functions are forbidden because they were judged useless: " + ", ".join(useless) + ".")
            if plan.message:
                parts.append(plan.message)
        return "\n".join(parts)

    def quotas(self, episode_id: str) -> dict[str, int]:
        plan = self._plan(episode_id)
        return dict(plan.quotas) if plan else {}


def _default_usefulness(outcome: Outcome) -> bool:
    """A stand-in for BTP's learned classifier: a result without an error reads as useful."""
    text = outcome.observation.strip().lower()
    return outcome.status == "ok" and not (text.startswith(("error", "{\"error\": \"", "{\"error\":\""))
                                           or text[:3].isdigit())
