"""What MCO and INTENT share: the market shown to the agent, failure fallback, usage."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from intent import feedback as fb
from intent.errors import UsageError, as_oracle_unavailable
from intent.market import Market
from intent.oracle import ORACLE_ERROR, Decision, DecisionContext, EpisodeInfo, Oracle, Outcome
from intent.oracles.caches import EpisodeMemory
from intent.policy import AgentPolicy

ModelErrorPolicy = Literal["accept_if_fits", "reject"]


def check_flags(**flags: Any) -> None:
    """An oracle's on/off switches: True or False (a string such as "no" would read as True)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise UsageError(f"{name} must be True or False, got {value!r}")


def check_model(model: Any, name: str, methods: tuple[str, ...]) -> None:
    """A world model / predictor argument: an object with one of ``methods``."""
    if not any(callable(getattr(model, m, None)) for m in methods):
        raise UsageError(f"{name} must have a {' or '.join(m + '()' for m in methods)} method, got "
                         f"{type(model).__name__} {model!r:.80}; see intent.model_protocols")


class PlanningOracle(Oracle):
    """Base of the lookahead oracles. Subclasses implement :meth:`_decide`.

    If the world model, the predictor or the policy fails *recoverably* (a timeout, an
    unreachable server, a malformed answer: an :class:`~intent.errors.OracleUnavailableError`,
    a :class:`~intent.model_protocols.ModelError`, or what :func:`~intent.errors.as_oracle_unavailable`
    maps, see :mod:`intent.errors`), :meth:`decide` returns the documented fallback: with
    ``on_model_error="accept_if_fits"`` (default) it accepts only a call whose own price fits
    what is left (the conservative floor: nothing is predicted beyond it); with ``"reject"`` it
    rejects. The decision carries ``reason="oracle_error"`` and ``usage["model_error"] = 1``, so
    the failure shows in the logs and in the benchmark's ``oracle_errors``. The guard still
    refuses anything that does not fit. Any other exception (a bug in the oracle, the policy's
    or a model adapter's code) propagates unchanged: a fallback would hide it.

    :meth:`adecide` never blocks the event loop: it runs :meth:`decide` (policy, world-model and
    predictor calls are all synchronous) in a worker thread, one decision at a time per episode.
    """

    def __init__(self, policy: AgentPolicy | Callable[[DecisionContext], AgentPolicy], *, max_depth: int,
                 show_market: bool = True, on_model_error: ModelErrorPolicy = "accept_if_fits",
                 merge_identical_calls: bool = True) -> None:
        if not (isinstance(policy, AgentPolicy) or callable(policy)):
            raise UsageError(f"policy must be an intent.policy.AgentPolicy or a function ctx -> AgentPolicy, got "
                             f"{type(policy).__name__} {policy!r:.80}; write AgentPolicy(chat_model, tools)")
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
            raise UsageError(f"max_depth must be an int >= 1 (simulated turns per rollout), got {max_depth!r}")
        if on_model_error not in ("accept_if_fits", "reject"):
            raise UsageError(f"on_model_error must be 'accept_if_fits' or 'reject', got {on_model_error!r}")
        check_flags(show_market=show_market, merge_identical_calls=merge_identical_calls)
        self._policy = policy
        self.max_depth = max_depth
        self.show_market = show_market
        self.on_model_error = on_model_error
        # Rollouts simulate identical calls of one turn once, as the guard runs them; False for a
        # guard built with merge_identical_calls=False.
        self.merge_identical_calls = bool(merge_identical_calls)
        self.memory = EpisodeMemory()
        # adecide: one decision at a time per episode (episode id -> [lock, holders + waiters]).
        self._turns: dict[str, list] = {}
        self._turns_lock = threading.Lock()

    def policy_for(self, ctx: DecisionContext) -> AgentPolicy:
        return self._policy if isinstance(self._policy, AgentPolicy) else self._policy(ctx)

    def start(self, episode: EpisodeInfo) -> None:
        self.memory.reset(episode.episode_id)

    def end(self, episode_id: str) -> None:
        """The run ended: its caches and blacklist are dropped (the next run starts afresh)."""
        self.memory.forget(episode_id)

    def decide(self, ctx: DecisionContext) -> Decision:
        try:
            # Pinned: a decision that outlives its run (an async run cancelled mid-decision, which goes on in
            # its thread) writes its plan into that run's memory, never into the next run's.
            with self.memory.pinned(ctx.episode_id):
                return self._decide(ctx)
        except Exception as exc:
            if as_oracle_unavailable(exc) is None:
                raise  # a bug, not an unavailable model: fail loudly
            # The documented fallback, visible in logs and metrics.
            fits = ctx.price <= ctx.remaining + 1e-9
            accept = fits and self.on_model_error == "accept_if_fits"
            text = fb.oracle_failed(ctx.tool, exc, accepted=accept)
            return Decision(accept, "" if accept else text, (), ORACLE_ERROR,
                            {"model_error": 1.0, "error": 0.0})

    async def adecide(self, ctx: DecisionContext) -> Decision:
        """Async twin of :meth:`decide`, off the event loop: same decision, same cache updates.

        The rollout runs in a worker thread (``asyncio.to_thread``, which carries the context
        variables, so LangChain callbacks still see the run). Decisions of one episode are
        serialized, as they were when ``decide`` ran on the loop, so that the rollout cache and
        the last-call cache see the same sequence of reads and writes; other episodes run in
        parallel (:class:`EpisodeMemory` is thread-safe; the shipped world models and predictors
        lock their own shared state). Cancelling the awaiting task does not stop a decision
        already running: it completes (and updates the caches) in its thread, as a ``decide``
        on the loop would have.
        """
        return await asyncio.to_thread(self._decide_in_turn, ctx)

    def _decide_in_turn(self, ctx: DecisionContext) -> Decision:
        with self._episode_turn(ctx.episode_id):
            return self.decide(ctx)

    @contextmanager
    def _episode_turn(self, episode_id: str) -> Iterator[None]:
        with self._turns_lock:
            turn = self._turns.get(episode_id)
            if turn is None:
                turn = self._turns[episode_id] = [threading.Lock(), 0]
            turn[1] += 1
        try:
            with turn[0]:
                yield
        finally:
            with self._turns_lock:
                turn[1] -= 1
                if turn[1] == 0:  # nobody holds or waits: drop it, so the map does not grow per episode
                    del self._turns[episode_id]

    def _decide(self, ctx: DecisionContext) -> Decision:  # pragma: no cover - abstract
        raise NotImplementedError

    def notes(self, ctx: DecisionContext) -> str | None:
        if not self.show_market:
            return None
        # The agent reads them after its batch ran: the calls accepted before this one are spent by then.
        return fb.market_notes(ctx.market, ctx.spent + ctx.held, ctx.remaining, ctx.budget)

    def prompt_notes(self, market: Market, episode_id: str, spent: float, remaining: float, budget: float
                     ) -> str | None:
        return fb.market_notes(market, spent, remaining, budget) if self.show_market else None

    def result_note(self, outcome: Outcome) -> str | None:
        if not self.show_market:
            return None
        return fb.budget_status(outcome.spent, max(0.0, outcome.budget - outcome.spent), outcome.budget)

    def shown_in_rollout(self, ctx: DecisionContext) -> Callable[[float], tuple[str | None, str | None]] | None:
        """What the agent is shown as a rollout from ``ctx`` spends, given what the rollout has spent so far:
        the system prompt's notes and the note after a tool result, as :meth:`prompt_notes` and
        :meth:`result_note` show them to the real agent after real spending (the paper rolls out the agent's
        own policy: it must see its budget go down in the rollout as it would in the run). ``None`` when the
        method shows the agent no market."""
        if not self.show_market:
            return None

        def at(spent_here: float) -> tuple[str | None, str | None]:
            spent = ctx.spent + ctx.held + spent_here  # (ctx.remaining already subtracts ctx.held)
            return (fb.market_notes(ctx.market, spent, max(0.0, ctx.remaining - spent_here), ctx.budget),
                    fb.budget_status(spent, max(0.0, ctx.budget - spent), ctx.budget))
        return at

    def visible(self, ctx: DecisionContext) -> list[str]:
        hidden = self.memory.blacklist(ctx.episode_id) | set(ctx.market.banned)
        return [n for n in ctx.market.names if n not in hidden]


def usage(**values: Any) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()}
