"""The single-trajectory lookahead shared by MCO and INTENT.

From the current history, the proposal (and the calls after it in the same batch) is
executed against a world model instead of the real tool, after the calls of its batch that were
accepted before it (``ctx.accepted_before``: they run with it, so the simulated agent sees their
results too, as it would when the paper's agent proposes its next call; they are not part of the
plan, whose money they already hold); then the agent's own policy proposes
each next step, whose calls are simulated too, until the agent answers or ``max_depth`` model
turns are reached, or until the simulated history no longer fits the policy model's context
(:class:`~intent.errors.ContextOverflowError`: the rollout ends there, ``context_full``).
Identical calls (same tool, same arguments) in one simulated turn are simulated and priced once,
as the guard runs and charges them once (``merge_identical_calls``, the guard's default): a small model
that repeats a call ten times in a reply plans one call, not ten.
Nothing here charges money or runs a real tool. A world model that times
out, cannot be reached or answers garbage raises an :class:`~intent.errors.OracleUnavailableError`
(see :func:`intent.errors.model_call`); other exceptions propagate unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, ToolMessage

from intent.errors import ContextOverflowError, UsageError, model_call
from intent.market import Market
from intent.messages import merge_identical
from intent.model_protocols import simulate_counted
from intent.oracle import DecisionContext
from intent.policy import AgentPolicy

__all__ = ["Rollout", "SimStep", "simulate_rollout"]


@dataclass(frozen=True)
class SimStep:
    tool: str
    args: dict[str, Any]
    reasoning: str
    price: float
    observation: str
    depth: int  # 0 = the proposal's own turn


@dataclass
class Rollout:
    steps: list[SimStep] = field(default_factory=list)
    answered: bool = False
    truncated: bool = False
    context_full: bool = False  # ended because the policy's prompt no longer fit its model's context
    capped: bool = False  # ended on a reply cut by its token cap before any complete call
    turns: int = 0
    policy_tokens: int = 0
    world_model_tokens: int = 0

    @property
    def total_price(self) -> float:
        return sum(s.price for s in self.steps)


def _price(market: Market, tool: str) -> float | None:
    try:
        return market.price(tool)
    except KeyError:  # UnpricedToolError: the agent would be refused this call; not part of the plan
        return None


def simulate_rollout(ctx: DecisionContext, policy: AgentPolicy, world_model: Any, *, satisfied: bool | None,
                     max_depth: int, visible: Sequence[str] | None = None, notes: str | None = None,
                     on_turn: Callable[[list[SimStep]], Iterable[str]] | None = None,
                     merge_identical_calls: bool = True,
                     shown: Callable[[float], tuple[str | None, str | None]] | None = None) -> Rollout:
    """Roll the agent's policy out against ``world_model`` from the proposal, to an answer or ``max_depth`` turns.

    ``on_turn`` sees each turn's new priced steps and returns tools to hide from the policy for the
    rest of the rollout (INTENT's blacklist, updated step by step as in the paper's Algorithm 3).
    ``shown`` (:meth:`intent.oracles.base.PlanningOracle.shown_in_rollout`): given what the rollout has
    spent, the system notes and the note after a tool result that the agent would be shown, so that the
    simulated agent sees its budget go down as the real one does (``notes`` is then only the first turn's).
    """
    if max_depth < 1:
        raise UsageError(f"max_depth must be >= 1, got {max_depth}")
    history = list(ctx.history)
    cut = max((i for i, m in enumerate(history) if isinstance(m, AIMessage)), default=len(history))
    messages: list[BaseMessage] = history[:cut]
    out = Rollout()
    pending = list(ctx.batch[ctx.batch_index:]) or [ctx.proposal]
    before = list(ctx.accepted_before)
    first = AIMessage(content=ctx.reasoning, tool_calls=[
        {"name": p.tool, "args": dict(p.args), "id": f"rollout-0-{k}", "type": "tool_call"}
        for k, p in enumerate(before + pending)
    ])
    turn_calls: list[tuple[AIMessage, list[dict[str, Any]]]] = [(first, first.tool_calls)]
    unpriced = {c["id"] for c in first.tool_calls[:len(before)]}  # held already: simulated, not planned
    depth = 0
    spent_here = 0.0  # what the simulated calls cost so far (every run is charged, whatever it returns)
    while True:
        ai, calls = turn_calls[-1]
        messages.append(ai)
        new_steps: list[SimStep] = []
        for call in calls:
            price = None if call["id"] in unpriced else _price(ctx.market, call["name"])
            with model_call(f"world model {type(world_model).__name__}"):
                text, tokens = simulate_counted(world_model, call["name"], call["args"], satisfied=satisfied)
            out.world_model_tokens += tokens
            seen = text
            if price is not None or call["id"] in unpriced:
                if price is not None:
                    new_steps.append(SimStep(call["name"], dict(call["args"]), str(ai.content), price, text, depth))
                    spent_here += price
                note = shown(spent_here)[1] if shown is not None else None
                if note:
                    seen = f"{text}\n{note}"  # as the guard appends the oracle's result note to a real result
            messages.append(ToolMessage(seen, tool_call_id=call["id"], name=call["name"]))
        out.steps.extend(new_steps)
        if on_turn is not None and new_steps:
            hidden = set(on_turn(new_steps))
            if hidden:
                visible = [n for n in (visible if visible is not None else ctx.market.names) if n not in hidden]
        depth += 1
        out.turns = depth
        if depth >= max_depth:
            out.truncated = True
            return out
        if shown is not None:
            notes = shown(spent_here)[0]
        try:
            reply, tokens = policy.next_action(messages, visible=visible, notes=notes)
        except ContextOverflowError:
            # The simulated history outgrew the agent model's context: the real agent could not
            # go further either, so the rollout ends here, as at max_depth.
            out.truncated = out.context_full = True
            return out
        out.policy_tokens += tokens
        if not reply.tool_calls:
            if (reply.response_metadata or {}).get("finish_reason") == "length" and getattr(policy, "replies_capped",
                                                                                             True):
                # Cut by the reply cap before a whole call (--rollout-max-tokens): not an answer, an
                # unknown rest, so the plan is truncated here and the oracles count it.
                out.truncated = out.capped = True
            else:
                out.answered = True
            return out
        proposed = merge_identical(reply.tool_calls)[0] if merge_identical_calls else list(reply.tool_calls)
        calls = [dict(c, id=f"rollout-{depth}-{k}") for k, c in enumerate(proposed)]
        turn_calls.append((AIMessage(content=reply.content, tool_calls=calls), calls))

