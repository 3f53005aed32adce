"""The oracle interface: what an oracle sees, what it answers, and its optional hooks.

An oracle is any object with ``decide(ctx) -> Decision``. Subclass :class:`Oracle` to
get the optional hooks as no-ops (the pydantic-ai pattern: override only what you need)
and an ``adecide`` that defaults to ``decide``. Oracles never touch money: they only
decide; the guard owns the ledger and refuses unaffordable calls whatever the oracle says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from intent._build import builder
from intent.errors import IntentError, UsageError
from intent.market import Market

__all__ = [
    "AcceptAll",
    "Decision",
    "DecisionContext",
    "EpisodeInfo",
    "InvalidDecisionError",
    "Oracle",
    "Outcome",
    "PlannedStep",
    "Proposal",
    "ReasonCode",
]

# Reason codes are strings so that logs and metrics stay readable; these are the ones the
# project emits. Oracles may use their own (they are logged as given).
ReasonCode = str
ACCEPTED: ReasonCode = "accepted"
OVER_BUDGET: ReasonCode = "over_budget"  # the call itself does not fit
PLAN_OVER_BUDGET: ReasonCode = "plan_over_budget"  # the call fits, the predicted plan does not
UNPRICED_TOOL: ReasonCode = "unpriced_tool"
UNKNOWN_TOOL: ReasonCode = "unknown_tool"
BANNED_TOOL: ReasonCode = "banned_tool"
BAD_ARGUMENTS: ReasonCode = "bad_arguments"
QUOTA_EXHAUSTED: ReasonCode = "quota_exhausted"
DUPLICATE_CALL: ReasonCode = "duplicate_call"  # an identical call earlier in the same message (merged)
BLACKLISTED: ReasonCode = "blacklisted"
ORACLE_ERROR: ReasonCode = "oracle_error"
CACHE_HIT: ReasonCode = "cache_hit"


class InvalidDecisionError(IntentError, TypeError):
    """An oracle returned something that is not a :class:`Decision`."""


@dataclass(frozen=True, slots=True)
class Proposal:
    """One tool call the agent proposed, as the guard sees it."""

    call_id: str
    tool: str
    args: Mapping[str, Any]
    reasoning: str = ""


@dataclass(frozen=True, slots=True)
class PlannedStep:
    """One step of a predicted future: what it costs and how likely it satisfies the intention."""

    tool: str
    price: float
    p_success: float = 1.0
    expected_cost: float | None = None

    def __post_init__(self) -> None:
        if not (0.0 < self.p_success <= 1.0) or math.isnan(self.p_success):
            raise UsageError(
                f"PlannedStep.p_success for {self.tool!r} is {self.p_success}; it must be in (0, 1] "
                "(clip predictor outputs away from 0)"
            )
        if self.expected_cost is None:
            object.__setattr__(self, "expected_cost", self.price / self.p_success)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tool": self.tool,
            "price": self.price,
            "p_success": self.p_success,
            "expected_cost": self.expected_cost,
        }


@dataclass(frozen=True, slots=True)
class Decision:
    """An oracle's answer about one proposal.

    ``feedback`` is shown to the agent on rejection (and may be empty on acceptance);
    ``trace`` is the predicted future the decision was based on; ``reason`` is a short
    machine-readable code; ``usage`` carries the oracle's own cost (tokens, rollout steps,
    latency) so that the benchmark can report it.
    """

    accept: bool
    feedback: str = ""
    trace: tuple[PlannedStep, ...] = ()
    reason: ReasonCode = ACCEPTED
    usage: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def accepted(cls, *, trace: Sequence[PlannedStep] = (), reason: ReasonCode = ACCEPTED, **usage: float) -> Decision:
        return (_decision if cls is Decision else cls)(True, "", tuple(trace), reason, dict(usage))

    @classmethod
    def rejected(
        cls, feedback: str, *, reason: ReasonCode, trace: Sequence[PlannedStep] = (), **usage: float
    ) -> Decision:
        return (_decision if cls is Decision else cls)(False, feedback, tuple(trace), reason, dict(usage))

    def to_dict(self) -> dict[str, Any]:
        return {
            "accept": self.accept,
            "feedback": self.feedback,
            "trace": [s.to_dict() for s in self.trace],
            "reason": self.reason,
            "usage": dict(self.usage),
        }


# Decision(...) for accepted() and rejected(), called for most decisions: made the cheap way (intent._build).
_decision = builder(Decision)


@dataclass(frozen=True, slots=True)
class EpisodeInfo:
    """Passed to :meth:`Oracle.start` the first time the guard sees an episode (graph thread)."""

    episode_id: str
    query: str
    budget: float
    market: Market
    # What the thread has spent before this run (its earlier turns): a planner plans with budget - spent.
    spent: float = 0.0


@dataclass(frozen=True, slots=True)
class DecisionContext:
    """Everything an oracle may use to decide on one proposal.

    ``remaining`` already subtracts the reservations of the calls accepted earlier in the
    same batch of parallel tool calls, so an oracle sees what is really left. Those calls are
    ``accepted_before`` (in batch order) and their money is ``held``: they run with this one, so a
    lookahead from this call starts after them (the paper decides one call per step, each after the
    last one ran), not before them, and it does not pay for them again.
    """

    episode_id: str
    query: str
    proposal: Proposal
    price: float
    budget: float
    spent: float
    remaining: float
    market: Market
    step: int
    history: Sequence[Any] = ()
    batch: Sequence[Proposal] = ()
    batch_index: int = 0
    accepted_before: Sequence[Proposal] = ()
    held: float = 0.0

    @property
    def tool(self) -> str:
        return self.proposal.tool

    @property
    def args(self) -> Mapping[str, Any]:
        return self.proposal.args

    @property
    def reasoning(self) -> str:
        return self.proposal.reasoning


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to an accepted call, passed to :meth:`Oracle.observe`."""

    episode_id: str
    proposal: Proposal
    price: float
    status: Literal["ok", "error"]
    observation: str
    spent: float
    remaining: float
    budget: float = 0.0


class Oracle:
    """Base class for oracles. Only :meth:`decide` is required; every hook is a no-op.

    Per-episode state (caches, blacklists) must be keyed by ``episode_id`` so that one
    oracle instance can serve concurrent episodes.
    """

    name: str = "oracle"

    def decide(self, ctx: DecisionContext) -> Decision:
        raise NotImplementedError(f"{type(self).__name__} must implement decide(ctx) -> Decision")

    async def adecide(self, ctx: DecisionContext) -> Decision:
        return self.decide(ctx)

    def start(self, episode: EpisodeInfo) -> None:
        """Called before the first decision of each run of the episode's thread: its first turn, and each
        later turn after the last one ended (``end``, an optional hook with the episode id, is called after
        each run). A run resumed after an interrupt or a crash is the same run: not started again. The
        episode's id, budget and ledger go on from turn to turn; ``episode.query`` is the run's own task
        (the human message that started it)."""

    def observe(self, outcome: Outcome) -> None:
        """Called after each accepted call ran (and was charged)."""

    def visible_tools(self, market: Market, episode_id: str) -> Sequence[str] | None:
        """Names of the tools the agent may see now; ``None`` means all of them."""
        return None

    def prompt_notes(
        self, market: Market, episode_id: str, spent: float, remaining: float, budget: float
    ) -> str | None:
        """Extra text for the agent's system prompt (prices, quotas, guidelines)."""
        return None

    def result_note(self, outcome: Outcome) -> str | None:
        """Text appended to a tool result the agent sees (e.g. a budget status line)."""
        return None

    def episode_usage(self, episode_id: str) -> Mapping[str, float] | None:
        """The oracle's own cost over a whole episode (``tokens``, ``llm_calls``...).

        ``None`` (the default) means "the sum of ``Decision.usage``"; an oracle that also
        spends outside ``decide`` (a verifier run after each tool result) returns the total.
        """
        return None


class AcceptAll(Oracle):
    """Accepts every proposal. The guard still refuses calls that do not fit the budget."""

    name = "accept_all"

    def decide(self, ctx: DecisionContext) -> Decision:
        return Decision.accepted()
