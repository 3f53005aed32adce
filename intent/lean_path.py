"""The lean path: the common model step written for itself, the general code as the fallback.

Most model steps of a guarded agent are alike: a run already under way, its state and the episode's
working copy in agreement, nothing held, no top-up or oracle bug pending, no fan-out branch, no
sub-agent, and a reply with one well-formed call to a priced tool. For that step the general code
(:meth:`intent.guard.BudgetGuard.prepared`, :mod:`intent.gate`, ``_Step`` in :mod:`intent.middleware`)
runs dozens of checks that each find nothing to do, and builds objects it then throws away; issue #11
asks the guard to cost under 0.2 ms per tool call, and that work was a large part of the rest
(``README.md``, "## Performance").

:func:`prepared` tells, with cheap checks only and before anything changes, whether the step is such
a step, and does what the general settling does there (the episode found and marked used, the model
request as it is); :func:`gate_one` then takes the model's reply when it is one call, and
:func:`decided` writes the gate's decision and the step's response as the general gate and ``_Step``
would. Whenever a check fails they return ``None`` and the middleware runs the general code, which
does the whole of it again from the start (nothing was changed before the checks). The result is the
same ledger, the same log records, the same state update and the same response: ``tests/test_lean_path.py``
drives the same scenarios through both (:data:`ENABLED` off for the general one) and compares them.

Imports point down: this module knows the guard's parts, never the middleware.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from langchain.agents.middleware import ModelResponse
from langchain.agents.middleware.types import ExtendedModelResponse
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.types import Command

from intent import feedback as fb
from intent import lean_tool
from intent.gate import _context, _proposal
from intent.ledger import BudgetExceededError, BudgetLedger
from intent.market import UnpricedToolError
from intent.lifecycle import follow
from intent.lineage import _CHECKPOINTER
from intent.messages import text_of, turns_before
from intent.metering import CallRun
from intent.nesting import current_parent
from intent.oracle import OVER_BUDGET, Decision
from intent.state import LEDGER_KEY

if TYPE_CHECKING:
    from intent.episodes import Episode
    from intent.guard import BudgetGuard

__all__ = ["ENABLED", "decided", "gate_one", "open_call", "prepared"]

# Off: every step takes the general code (the differential test drives both ways with it).
ENABLED = True

def prepared(guard: BudgetGuard, request: Any, config: Any) -> tuple[Any, Episode, Any] | None:
    """``(request, episode, model request)`` for a model step whose settling changes nothing, or ``None``.

    What :meth:`BudgetGuard.prepared` (and the middleware's ``_prepare``) would do for such a step, and only
    that: the episode looked up and marked recently used, the offered tools noted, the step's checkpoint
    noted for the lineage. The checks, each the reason the general code would do more:

    * the guard: no metered models (their reservations are settled and their episode named at each step), the
      oracle's tokens not charged (held and committed at each decision), no human asked for top-ups, no
      shared store, no carved budget (a sub-agent's), no oracle hooks that shape the request, no cap on
      refusal notes (the request is shortened and the gate cuts each turn's notes), no tool banned (tools hidden);
    * the step: no sub-agent scope above it, the top of its graph (no fan-out branch), a run under way by
      state (``runs_started`` > ``runs_ended``) that this working copy started at the same run, no new user
      message last (a run left behind);
    * the episode: live here, synced, the only branch ``""``, not revived, no oracle bug, no top-up pending or
      made, no late bill waiting, nothing held, and its ledger's entries exactly state's (so catching up,
      releasing and writing what state lacks all find nothing).
    """
    if (not ENABLED or guard.charge_models or guard.made_metered_models or guard.store_outbox is not None
            or guard.charge_oracle or guard.on_over_budget != "refuse" or guard.feedback_chars is not None):
        # (charge_models: what the meters_models property reads; feedback_chars: the general gate cuts each
        # turn's refusal notes to the cap, which gate_one does not)
        return None
    state = request.state
    if type(state) is not dict:
        return None
    channel = state.get(LEDGER_KEY)
    if not channel or type(channel) is not dict:
        return None
    named = channel.get("episode_id")
    started = channel.get("runs_started")
    if not named or started is None or channel.get("runs_ended", 0) >= started:
        return None  # a new run (or a channel from before runs were counted): the general start
    configurable = (config or {}).get("configurable") or {}
    thread = configurable.get("thread_id")
    if thread is not None and named != thread:
        return None  # a copied thread or a sub-agent's episode name: BudgetGuard.episode_of
    if "|" in str(configurable.get("checkpoint_ns") or ""):
        return None  # a branch of a subgraph (a fan-out): branch_of is not ""
    messages = state.get("messages") or []
    if messages and isinstance(messages[-1], HumanMessage):
        return None  # maybe the thread's next run (intent.lifecycle.run_left_behind)
    if current_parent() is not None:
        return None  # inside a guarded tool call: sub-agent rules (inherits_parent_ledger, carves)
    episodes = guard.episodes
    if episodes._carves or episodes._late or episodes._tails:
        return None
    episode = episodes.peek(str(named))
    if (episode is None or not episode.synced or episode.revived or not episode.started
            or episode.oracle_bug is not None or episode.pending_top_ups or episode.run != started
            or episode.visitors or len(episode.branches) != 1 or episode.branches.get("", 0) is not None
            or episode.market is None and channel.get("market_scope") == "episode"):
        return None
    ledger = episode.ledger
    if type(ledger) is not BudgetLedger or ledger.shared is not None:
        return None
    # The start and the settle, by the same locks as the general code (a start hook running elsewhere is waited for).
    with episode.start_lock, episode.lock, ledger._lock:
        if ledger._held_ids or ledger._top_ups or not ledger._same_as(channel.get("entries") or {}):
            return None
    with episodes._lock:  # EpisodeRegistry.get: found again, most recently used
        if episodes._episodes.get(episode.episode_id) is not episode:
            return None
        episodes._episodes.move_to_end(episode.episode_id)
    if configurable.get(_CHECKPOINTER) is not None:  # (without one, checkpoint_here is None: follow does nothing)
        # lifecycle.follow: with the ledger as state has it no fork is possible; the step's checkpoint noted.
        follow(guard, episode, channel, config, branch="", stamp=None)
    offered = request.tools
    if offered is not None:
        if episode.offered is None:
            guard._warn_unpriced(guard.market_for(episode.episode_id, channel), offered)
        episode.offered = offered
    model_request = None
    # (guard.market_for, read here: the episode's market, else the guard's; an episode-scoped one in state is
    # not, checked above)
    hooks = guard._hooks  # (BudgetGuard._has_hook's answers, once known)
    if (not (guard._market if episode.market is None else episode.market).banned
            and (hooks.get("visible_tools") is False or not guard._has_hook("visible_tools"))
            and (hooks.get("prompt_notes") is False or not guard._has_hook("prompt_notes"))):
        model_request = request  # what BudgetGuardMiddleware._prepare returns for it: nothing to hide or add
    return request, episode, model_request


class LeanGate:
    """The gate of a reply with one call, between :func:`gate_one` and :func:`decided`."""

    __slots__ = ("ai", "call_id", "channel", "ctx", "index", "key", "market", "messages", "name", "price",
                 "query", "query_kept", "response", "started", "step")


def gate_one(guard: BudgetGuard, state: Mapping[str, Any], episode: Episode, result: Any) -> LeanGate | None:
    """The reply's one call, priced and ready for the oracle (:attr:`LeanGate.ctx`), or ``None`` for any
    other reply (the general ``_Step`` and :func:`intent.gate.gate_batch` then take it, unchanged)."""
    if type(result) is AIMessage:
        ai, response = result, None
    elif type(result) is ModelResponse and len(result.result) == 1 and type(result.result[0]) is AIMessage:
        ai, response = result.result[0], result
    else:
        return None
    calls = ai.tool_calls
    if len(calls) != 1 or ai.invalid_tool_calls:
        return None
    call = calls[0]
    cid, name = call.get("id"), call.get("name")
    channel = state[LEDGER_KEY]
    market = guard._market if episode.market is None else episode.market  # guard.market_for, as prepared() found it
    if cid is None or name in market.banned:
        return None
    try:
        price = market.price(name)
    except UnpricedToolError:
        return None
    ledger = episode.ledger
    if not ai.id:
        import uuid

        ai.id = f"lc_{uuid.uuid4()}"  # as _Step.open names it
    key = f"{ai.id}:{cid}"
    if key in ledger or key in (channel.get("decisions") or {}):
        return None
    messages = [*(state.get("messages") or []), ai]
    index = len(messages) - 1
    turns = channel.get("turns")
    step = _turn(messages, index, turns)
    # episode.task(channel, messages): the run's task as state keeps it (query_of), when it keeps this run's
    query_kept = isinstance(channel.get("query"), str) and int(channel.get("query_run") or 1) == episode.run
    query = channel["query"] if query_kept else episode.task(channel, messages)
    args = dict(call.get("args") or {})
    proposal = _proposal(cid, name, args, text_of(ai))
    gate = LeanGate()
    gate.ai, gate.call_id, gate.channel, gate.index, gate.key, gate.market = ai, cid, channel, index, key, market
    gate.messages, gate.name, gate.price, gate.query, gate.step = messages, name, price, query, step
    gate.response, gate.query_kept = response, query_kept
    if ledger._caps:
        budget, spent, left = ledger.budget, ledger.spent, ledger.remaining_for("tool")
    else:
        # ledger.budget, .spent and .remaining_for("tool") read at once, the same arithmetic (no sub-cap, no
        # shared store: checked by prepared()).
        with ledger._lock:
            totals, top_ups = ledger._totals, ledger._top_ups
            committed, reserved = totals["committed"], totals["reserved"]
            budget = ledger._budget + sum(top_ups.values()) if top_ups else ledger._budget
        spent = 0.0 if abs(committed) < 1e-12 else committed
        committed = 0.0 if -1e-12 < committed < 1e-12 else committed
        reserved = 0.0 if -1e-12 < reserved < 1e-12 else reserved
        left = max(0.0, budget - committed - reserved)
    # As gate_batch asks: what the tool budget has left, nothing held earlier in this batch of one.
    gate.ctx = _context(
        episode_id=episode.episode_id, query=query, proposal=proposal, price=price, budget=budget,
        spent=spent, remaining=max(0.0, left - 0.0), market=market, step=step,
        history=messages, batch=(proposal,), batch_index=0,
    )
    gate.started = guard._clock()
    return gate


def _turn(messages: list[Any], index: int, turns: Mapping[str, Any] | None) -> int:
    """``turns_before(messages, index, turns, gate=True)`` when the last reply counted is the latest
    AIMessage before this one (every step of a run under way); the general function otherwise."""
    if turns and not turns.get("pending") and turns.get("last_id"):
        for j in range(index - 1, -1, -1):
            m = messages[j]
            if isinstance(m, AIMessage):
                if m.id == turns["last_id"] and m.id != messages[index].id:
                    return max(int(turns.get("total") or 0), int(turns["count"]))
                break
    return turns_before(messages, index, turns, gate=True)


def decided(guard: BudgetGuard, episode: Episode, gate: LeanGate, answer: Any) -> Any:
    """The oracle's answer applied as :func:`intent.gate.gate_batch` applies it to a batch of one, and the
    step's response as ``_Step.close`` makes it: the reply, with the gate's update as a ``Command``."""
    decision_ms = (guard._clock() - gate.started) * 1000.0
    ctx = gate.ctx
    decision = guard.check_decision(answer, ctx)
    ledger, market, price, name, step = episode.ledger, gate.market, gate.price, gate.name, gate.step
    # (ledger.fits: its local part alone without a shared store, which prepared() checked)
    if decision.accept and guard.enforce and not (ledger._fits_here(price, "tool") if ledger._shared is None
                                                  else ledger.fits(price)):
        decision = Decision.rejected(
            fb.no_room(name, price, ctx.remaining, ledger),
            reason=OVER_BUDGET, trace=decision.trace, **decision.usage,
        )
    key, cid, args = gate.key, gate.call_id, ctx.proposal.args
    entry = None
    if decision.accept:
        meta = {
            "accept": True, "tool": name, "args": dict(args), "price": price, "step": step,
            "reason": decision.reason, "feedback": decision.feedback,
            "trace": [s.to_dict() for s in decision.trace] if decision.trace else [], "decision_ms": decision_ms,
            "usage": dict(decision.usage),
        }
        try:
            entry = ledger.reserve(key, name, price, market_version=market.version, tool_call_id=cid)
        except BudgetExceededError:
            # Another run took the money since the check (gate_batch's reserve effect): refused, not run.
            meta = _refusal(guard, episode, gate, price, "reject", OVER_BUDGET,
                            fb.over_budget(name, price, ledger.remaining_for("tool"), ledger.budget))
    else:
        meta = _refusal(guard, episode, gate, price, "reject", decision.reason,
                        decision.feedback or fb.generic_rejection(name), decision, decision_ms)
    # intent.top_ups.channel_base(episode) for a plain BudgetLedger (prepared() checked: not a carve), then
    # gate_batch's keys
    update = {"episode_id": episode.episode_id, "budget": ledger._budget, "allow_overspend": ledger._allow_overspend}
    if ledger._caps:
        update["caps"] = dict(ledger._caps)
    update["entries"] = {key: ledger.serialized(entry)} if entry is not None else {}
    update["decisions"] = {key: meta}
    episode.decided[key] = meta  # (intent.gate: a gate run again on this message after its update was lost)
    update["market_version"] = market.version
    if not gate.query_kept:
        update |= episode.query_update(gate.channel, gate.messages)
    if episode.market is not None:
        update["market"] = market.to_dict()
        update["market_scope"] = "episode"
    ai = gate.ai
    update["turns"] = {"count": step + 1, "total": step + 1, "last_id": ai.id, "at": gate.index}
    response = gate.response if gate.response is not None else ModelResponse(result=[ai])
    return ExtendedModelResponse(model_response=response, command=Command(update={LEDGER_KEY: update}))


def _refusal(guard: BudgetGuard, episode: Episode, gate: LeanGate, price: float | None, kind: Any, reason: str,
             text: str, decision: Decision | None = None, decision_ms: float = 0.0) -> dict[str, Any]:
    """gate_batch's ``refuse`` for the one call (no cap on notes here: :func:`prepared` checks): its log
    record now, its decision for state returned."""
    args = gate.ctx.proposal.args
    guard.records.refusal(
        episode.ledger, episode_id=episode.episode_id, step=gate.step, query=gate.query, reasoning=gate.ctx.proposal.reasoning,
        call_id=gate.call_id, tool=gate.name, args=args, price=price, kind=kind, reason=reason, text=text,
        market_version=gate.market.version, decision=decision, decision_ms=decision_ms)
    return {"accept": False, "tool": gate.name, "args": dict(args), "price": price, "step": gate.step,
            "reason": reason, "feedback": text, "kind": kind}


def open_call(guard: BudgetGuard, request: Any) -> CallRun | None:
    """:func:`intent.metering.open_call` for a call the gate accepted in the latest message of a run going on
    here: the same :class:`~intent.metering.CallRun` (an :class:`intent.lean_tool.LeanRun` where
    :func:`intent.lean_tool.call_run` allows one), found with cheap checks; ``None`` for anything else
    (a refusal to answer, a call never gated or rebuilt, a copied thread, a sub-agent's carve, a late bill
    waiting), which the general function then takes from the start (nothing was changed here)."""
    if not ENABLED:
        return None
    state = request.state
    if type(state) is not dict:
        return None
    channel = state.get(LEDGER_KEY)
    if not channel or type(channel) is not dict:
        return None
    named = channel.get("episode_id")
    if not named:
        return None
    config = getattr(request.runtime, "config", None)
    configurable = (config or {}).get("configurable") or {}
    thread = configurable.get("thread_id")
    if thread is not None and named != thread:
        return None  # BudgetGuard.episode_of names another episode (a copied thread, a sub-agent's)
    messages = state.get("messages") or []
    if not messages:
        return None
    ai = messages[-1]  # find_call: the latest AIMessage proposing the call, when it is the last message
    if type(ai) is not AIMessage or not ai.id:
        return None
    cid = request.tool_call["id"]
    for c in ai.tool_calls:
        if c.get("id") == cid:
            break
    else:
        return None
    episodes = guard.episodes
    if episodes._carves or episodes._late:
        return None
    episode = episodes.peek(str(named))
    if episode is None or not episode.synced:
        return None
    key = f"{ai.id}:{cid}"
    meta = (channel.get("decisions") or {}).get(key)
    if not meta or not meta.get("accept", True) or key not in episode.ledger:
        return None  # a refusal, an answered call, a call never gated: the general function answers it
    with episodes._lock:  # EpisodeRegistry.get: found again, most recently used
        if episodes._episodes.get(episode.episode_id) is not episode:
            return None
        episodes._episodes.move_to_end(episode.episode_id)
    if configurable.get(_CHECKPOINTER) is not None:
        episode = follow(guard, episode, channel, config)  # a fork runs on its checkpoint's ledger
        if key not in episode.ledger:
            return None  # (made again from a checkpoint that never gated it: the general function decides)
    return lean_tool.call_run(guard, episode, key, request, dict(meta), messages, ai, channel)
