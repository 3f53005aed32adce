"""What MCO and INTENT share: the market shown to the agent, failure fallback, usage."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from intent import feedback as fb
from intent.market import Market
from intent.oracle import ORACLE_ERROR, Decision, DecisionContext, EpisodeInfo, Oracle, Outcome
from intent.oracles.caches import EpisodeMemory
from intent.policy import AgentPolicy

ModelErrorPolicy = Literal["accept_if_fits", "reject"]


class PlanningOracle(Oracle):
    """Base of the lookahead oracles. Subclasses implement :meth:`_decide`.

    If the world model, the predictor or the policy fails (a :class:`worldmodel.ModelError`,
    a timeout, any exception), :meth:`decide` returns the documented fallback: with
    ``on_model_error="accept_if_fits"`` (default) it accepts only a call whose own price fits
    what is left (the conservative floor: nothing is predicted beyond it); with ``"reject"`` it
    rejects. The decision carries ``reason="oracle_error"`` and ``usage["model_error"] = 1``, so
    the failure shows in the logs and in the benchmark's ``oracle_errors``. The guard still
    refuses anything that does not fit.
    """

    def __init__(self, policy: AgentPolicy | Callable[[DecisionContext], AgentPolicy], *, max_depth: int,
                 show_market: bool = True, on_model_error: ModelErrorPolicy = "accept_if_fits") -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if on_model_error not in ("accept_if_fits", "reject"):
            raise ValueError(f"on_model_error must be 'accept_if_fits' or 'reject', got {on_model_error!r}")
        self._policy = policy
        self.max_depth = max_depth
        self.show_market = show_market
        self.on_model_error = on_model_error
        self.memory = EpisodeMemory()

    def policy_for(self, ctx: DecisionContext) -> AgentPolicy:
        return self._policy if isinstance(self._policy, AgentPolicy) else self._policy(ctx)

    def start(self, episode: EpisodeInfo) -> None:
        self.memory.reset(episode.episode_id)

    def decide(self, ctx: DecisionContext) -> Decision:
        try:
            return self._decide(ctx)
        except Exception as exc:  # noqa: BLE001 - the documented fallback, visible in logs and metrics
            fits = ctx.price <= ctx.remaining + 1e-9
            accept = fits and self.on_model_error == "accept_if_fits"
            text = fb.oracle_failed(ctx.tool, exc, accepted=accept)
            return Decision(accept, "" if accept else text, (), ORACLE_ERROR,
                            {"model_error": 1.0, "error": 0.0})

    def _decide(self, ctx: DecisionContext) -> Decision:  # pragma: no cover - abstract
        raise NotImplementedError

    def notes(self, ctx: DecisionContext) -> str | None:
        if not self.show_market:
            return None
        return fb.market_notes(ctx.market, ctx.spent, ctx.remaining, ctx.budget)

    def prompt_notes(self, market: Market, episode_id: str, spent: float, remaining: float, budget: float
                     ) -> str | None:
        return fb.market_notes(market, spent, remaining, budget) if self.show_market else None

    def result_note(self, outcome: Outcome) -> str | None:
        if not self.show_market:
            return None
        return fb.budget_status(outcome.spent, max(0.0, outcome.budget - outcome.spent), outcome.budget)

    def visible(self, ctx: DecisionContext) -> list[str]:
        hidden = self.memory.blacklist(ctx.episode_id) | set(ctx.market.banned)
        return [n for n in ctx.market.names if n not in hidden]


def usage(**values: Any) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()}
