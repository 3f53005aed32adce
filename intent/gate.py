"""The batch gate: the tool calls of one model message, decided in order as one batch.

:func:`gate_batch` is a generator that yields a :class:`~intent.oracle.DecisionContext` per
call and reads the oracle's decision from the list its driver passes (``io[0]``); :meth:`BudgetGuard.gate` drives it with a sync loop and
:meth:`BudgetGuard.agate` with an async one, so the logic is written once. It validates each call
(malformed, duplicated id, banned, unpriced, already answered by another middleware), asks the
oracle, applies the guard's own check that the call fits what the batch has not yet held, asks
a human for a top-up when configured, and returns the state update: the decisions (which the
tool step reads from graph state) and the reservations. The oracle's own tokens, when charged,
are held and committed here too (:func:`hold_oracle`, :func:`charge_oracle`).
"""

from __future__ import annotations

import operator
import uuid
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.messages import AIMessage, ToolMessage

from intent import feedback as fb
from intent._build import builder
from intent.errors import OracleUnavailableError
from intent import lifecycle
from intent.human import HumanTopUps
from intent.ledger import BudgetExceededError, LedgerEntry
from intent.lifecycle import ANSWERED_ELSEWHERE, RELEASED_UNUSED, answered_decision
from intent.market import UnpricedToolError
from intent.messages import (
    answered_after,
    call_key,
    last_ai,
    merge_identical,
    messages_of,
    text_of,
    turns_before,
)
from intent.model_gate import MAX_ASKS
from intent.oracle import (
    BAD_ARGUMENTS,
    BANNED_TOOL,
    DUPLICATE_CALL,
    OVER_BUDGET,
    PLAN_OVER_BUDGET,
    UNKNOWN_TOOL,
    UNPRICED_TOOL,
    Decision,
    DecisionContext,
    Proposal,
)
from intent.state import LEDGER_KEY, branch_of, channel_of
from intent.top_ups import channel_base

if TYPE_CHECKING:
    from intent.episodes import Episode
    from intent.guard import BudgetGuard
    from intent.pricing import ModelPrice

__all__ = ["ANSWERED_ELSEWHERE", "HUMAN_APPROVED", "RELEASED_UNUSED", "charge_oracle", "dedupe_ids",
           "gate_batch", "hold_oracle"]

# RELEASED_UNUSED, ANSWERED_ELSEWHERE and answered_decision live in intent.lifecycle (the episode's settle and
# run end write them too) and are imported from there.
HUMAN_APPROVED = "human_approved"  # a call over budget a human approved (on_over_budget="ask")
# Rejections a human may overrule with money (on_over_budget="ask"): the call does not fit,
# or the oracle's plan does not.
_BUDGET_REASONS = frozenset({OVER_BUDGET, PLAN_OVER_BUDGET})


@dataclass
class _Pending:
    """A tool call that passed the gate's validation and waits for the oracle."""

    key: str
    proposal: Proposal
    price: float


# HumanInTheLoopMiddleware's private state key: {call id: the reviewer's edited action}.
HITL_EDITS_KEY = "hitl_edited_tool_calls"


# Proposal(...) and DecisionContext(...) for every call gated, made the cheap way (intent._build).
_proposal = builder(Proposal)
_context = builder(DecisionContext)
_proposal_of = operator.attrgetter("proposal")


def _edited_ids(state: Any) -> Any:
    edits = state.get(HITL_EDITS_KEY) if isinstance(state, Mapping) else getattr(state, HITL_EDITS_KEY, None)
    return edits if isinstance(edits, Mapping) else ()


def gate_batch(
    guard: BudgetGuard, state: Any, config: Mapping[str, Any] | None, settle: bool = True,
    episode: Episode | None = None, io: list[Any] | None = None,
) -> Generator[DecisionContext, None, None]:
    """The batch gate as a generator: yields each context and reads the oracle's decision from ``io[0]``,
    where the driver puts it before going on; leaves the state update (or ``None``) in ``io[0]`` at its end.
    (Not sent in and returned: the driver's ``for`` loop then sees the end without the StopIteration that
    ends a generator's ``send``, an exception raised and caught at every gate.)

    Written once and driven by a sync loop (:meth:`BudgetGuard.gate`) or an async one
    (:meth:`BudgetGuard.agate`). ``episode``: the episode the same model step prepared (already
    started), or ``None`` to find it from ``state``.
    """
    if io is None:
        io = [None]
    messages = messages_of(state)
    index, ai = last_ai(messages)
    if ai is None:
        io[0] = None
        return
    channel = channel_of(state)
    if episode is None:
        episode = lifecycle.follow(guard, guard.episodes.get(lifecycle.episode_id(guard, state, config), channel),
                                   channel, config)
        lifecycle.start(guard, episode, channel, messages, config)
    episode_id = episode.episode_id
    # A graph whose agent node did not call prepare() (a hand-built one) is settled here.
    settled = (lifecycle.settle(guard, episode, state, reason=RELEASED_UNUSED, branch=branch_of(config)) if settle
               else None)
    ledger = episode.ledger
    market = guard.market_for(episode_id, channel)
    query = episode.task(channel, messages)
    turns = (channel or {}).get("turns")
    step = turns_before(messages, index, turns, gate=True)
    answered = answered_after(messages, index)
    known_decisions = (channel or {}).get("decisions") or {}
    reasoning = text_of(ai)
    out_messages: list[Any] = []
    new_entries: dict[str, LedgerEntry] = {}
    decisions: dict[str, dict[str, Any]] = {}
    # The batch's reservations and log records, applied in order once every decision is in:
    # an oracle that raises mid-batch (a bug, not a fallback case) leaves nothing of the
    # batch reserved or logged, so a resumed run gates the message afresh.
    effects: list[Callable[[], None]] = []

    def record(cid: str, name: str, args: Any, price: float | None, kind: Literal["reject", "invalid"],
               reason: str, text: str, decision: Decision | None = None, decision_ms: float = 0.0) -> None:
        effects.append(lambda: guard.records.refusal(
            ledger, episode_id=episode_id, step=step, query=query, reasoning=reasoning, call_id=cid, tool=name,
            args=args, price=price, kind=kind, reason=reason, text=text, market_version=market.version,
            decision=decision, decision_ms=decision_ms))

    feedback_left = [guard.feedback_chars]  # characters of refusal notes this turn may still show

    def refuse(key: str, cid: str, name: str, args: Any, price: float | None, kind: Literal["reject", "invalid"],
               reason: str, text: str, decision: Decision | None = None, decision_ms: float = 0.0) -> None:
        # The refusal is answered at the tool step, not here: a middleware that answers
        # calls after the gate (a call limit, a human's reject) must not answer it twice.
        left = feedback_left[0]
        if left is not None and len(text) > left:
            # The first long note of the turn is cut to the cap; once half of it is used, the
            # rest of the turn's refusals get their first lines only.
            text = (fb.cut_to(text, left) if 2 * left >= guard.feedback_chars else
                    fb.shortened(name, text, why="shortened: this turn's budget notes are above"))
        if left is not None:
            feedback_left[0] = max(0, left - len(text))
        record(cid, name, args, price, kind, reason, text, decision, decision_ms)
        decisions[key] = {"accept": False, "tool": name, "args": dict(args) if isinstance(args, Mapping) else {},
                          "price": price, "step": step, "reason": reason, "feedback": text, "kind": kind}

    # Calls the model could not even format: answered here, cost nothing.
    for bad in ai.invalid_tool_calls or []:
        cid = bad.get("id")
        if not cid or cid in answered:
            continue
        # Not in tool_calls, so no tool step will answer it: answered here.
        text = fb.invalid_call(bad.get("name"), bad.get("error") or "its arguments are not valid JSON")
        out_messages.append(ToolMessage(text, tool_call_id=cid, name=bad.get("name") or "", status="error",
                                        artifact={"intent_reason": BAD_ARGUMENTS}))
        record(cid, bad.get("name") or "", bad.get("args") or "", None, "invalid", BAD_ARGUMENTS, text)

    # Two calls sharing an id cannot each get their own answer (answers match by id), so
    # the later one is renamed in the message and refused: each call answered once.
    # (A message of one call, the common case, has no id to share: nothing to rename.)
    calls, renamed = dedupe_ids(ai) if ai.id and len(ai.tool_calls) > 1 else (list(ai.tool_calls), {})
    merged: dict[str, str] = {}
    if guard.merge_identical_calls and ai.id and len(calls) > 1:
        # A call renamed for a reused id, or one another middleware already answered (a call
        # limit, a reviewer), is left alone: removing it would orphan its answer. So is one a
        # reviewer edited before this gate: HumanInTheLoopMiddleware keeps the edit in state and runs
        # it at the tool step, so the message's arguments are not what will run.
        edited = _edited_ids(state)
        calls, merged = merge_identical(
            calls, keep=lambda c: c.get("id") is None or c["id"] in renamed or c["id"] in answered
            or c["id"] in edited)
    if (renamed or merged) and ai.id:
        update: dict[str, Any] = {"tool_calls": calls}
        if merged:
            update["additional_kwargs"] = {**ai.additional_kwargs,
                                           "intent_merged_calls": {**ai.additional_kwargs.get(
                                               "intent_merged_calls", {}), **merged}}
        out_messages.insert(0, ai.model_copy(update=update))
    for dropped, kept in merged.items():
        # Not a proposed call any more (removed from the message), but logged: the
        # duplicate-call rate of a model is read from these records.
        dup = next(c for c in ai.tool_calls if c.get("id") == dropped)
        record(dropped, dup["name"], dict(dup.get("args") or {}), None, "invalid", DUPLICATE_CALL,
               fb.merged_call(dup["name"], kept))
    pending: list[_Pending] = []
    for call in calls:
        cid = call["id"]
        if cid is None:
            continue
        key = call_key(ai, index, cid)
        if key in known_decisions:
            continue  # gated before (the gate ran again on the same message)
        kept = episode.decided.get(key)
        if kept is not None:
            # Gated here before by a run of this gate whose update was lost (its step was cancelled, or crashed,
            # after the gate had decided and reserved): its decision and reservation are written again, not
            # decided again, so that the tool step knows what was approved (a reviewer's edit of it is re-gated)
            # and a resume in another process finds both in state.
            decisions[key] = kept
            entry = ledger.get(key)
            if entry is not None:
                new_entries[key] = entry
            continue
        if key in ledger:
            continue  # reserved before, not by a gate of this process (nothing to write again)
        if cid in answered:
            # Another middleware answered it before this gate (a call limit or a reviewer whose
            # after_model runs first): nothing to decide or reserve, but the call gets its one
            # record, and its decision in state keeps a re-run of the gate from logging it again.
            name, args = call["name"], dict(call.get("args") or {})
            effects.append(lambda cid=cid, name=name, args=args: guard.records.answered(
                ledger, episode_id=episode_id, step=step, query=query, reasoning=reasoning, call_id=cid,
                tool=name, args=args, reason=ANSWERED_ELSEWHERE, market_version=market.version))
            decisions[key] = answered_decision(name, args, step)
            continue
        name, args = call["name"], dict(call.get("args") or {})
        if cid in renamed:
            refuse(key, cid, name, args, None, "invalid", BAD_ARGUMENTS, fb.duplicate_call(name, renamed[cid]))
            continue
        proposal = _proposal(cid, name, args, reasoning)
        if name in market.banned:
            refuse(key, cid, name, args, None, "invalid", BANNED_TOOL, fb.banned_tool(name))
            continue
        try:
            pending.append(_Pending(key, proposal, market.price(name)))
        except UnpricedToolError as exc:
            offered = episode.offered_names()
            if name in market:
                refuse(key, cid, name, args, None, "invalid", UNPRICED_TOOL, fb.unpriced_tool(name, str(exc)))
            elif offered is not None and name in offered:
                # A tool the agent has (a middleware's own, say) that the market does not price.
                guard._unpriced_offered(name)
                refuse(key, cid, name, args, None, "invalid", UNPRICED_TOOL,
                       fb.unpriced_offered_tool(name, guard._visible_names(state, config, market, offered)))
            else:
                refuse(key, cid, name, args, None, "invalid", UNKNOWN_TOOL,
                       fb.unknown_tool(name, guard._visible_names(state, config, market, offered)))

    batch = tuple(map(_proposal_of, pending))  # (no generator made per gate)
    held = 0.0  # accepted earlier in this batch: reserved once the whole batch is decided
    accepted: list[Proposal] = []  # those calls, in batch order: an oracle's lookahead starts after them
    top_ups: dict[str, float] = {}
    # Top-ups a human approves in this run: taken back if the run is interrupted before it
    # ends (it replays the answers on resume), logged once when it completes.
    humans: HumanTopUps | None = None  # made when a human is first asked (rarely)
    try:
        for batch_index, item in enumerate(pending):
            asked = 0
            while True:
                left = max(0.0, ledger.remaining_for("tool") - held)
                ctx = _context(
                    episode_id=episode_id, query=query, proposal=item.proposal, price=item.price,
                    budget=ledger.budget, spent=ledger.spent, remaining=left, market=market, step=step,
                    history=messages, batch=batch, batch_index=batch_index,
                    accepted_before=tuple(accepted), held=held,
                )
                started = guard._clock()
                oracle_hold = hold_oracle(guard, episode, step) if guard.charge_oracle else None
                if (oracle_hold is None and guard.charge_oracle and guard.enforce
                        and not ledger.fits(held + item.price)):
                    # A paid oracle with no bound is charged after it decides, so asking it about a call the
                    # guard's check below refuses whatever it answers would only overrun the budget, once per
                    # such call; refused here, the overrun is at most the one decision that found money left.
                    answer = Decision.rejected(fb.no_room(item.proposal.tool, item.price, left, ledger),
                                               reason=OVER_BUDGET)
                    oracle_hold = ""  # not asked: nothing to charge
                elif oracle_hold == "":
                    # The budget cannot pay for the oracle's next decision: the guard decides
                    # alone (its hard check below), as when the oracle is unavailable.
                    answer = OracleUnavailableError("the budget left does not cover the oracle's next "
                                                    f"decision ({guard.oracle_max_tokens} tokens)")
                else:
                    yield ctx
                    answer = io[0]
                decision_ms = (guard._clock() - started) * 1000.0
                decision = guard.check_decision(answer, ctx)
                if guard.charge_oracle and oracle_hold != "":
                    oracle_entry = charge_oracle(guard, episode, decision, step, query, oracle_hold)
                    if oracle_entry is not None:
                        new_entries[oracle_entry.call_id] = oracle_entry
                if decision.accept and guard.enforce and not ledger.fits(held + item.price):
                    # The guard's own check: no oracle can overspend the budget.
                    # Halted by an overrun, the money left does not matter: say why nothing runs.
                    decision = Decision.rejected(
                        fb.no_room(item.proposal.tool, item.price, left, ledger),
                        reason=OVER_BUDGET, trace=decision.trace, **decision.usage,
                    )
                if (decision.accept or guard.on_over_budget != "ask" or not guard.enforce or ledger.halted
                        or decision.reason not in _BUDGET_REASONS or asked >= MAX_ASKS):
                    break
                # Over budget: ask a human (a LangGraph interrupt; the node re-runs on resume).
                top_up_id = f"top-up:{item.key}:{asked}"
                shortfall = max(0.0, held + item.price - ledger.remaining_for("tool"))
                if humans is None:
                    humans = HumanTopUps(guard, episode)
                action, amount = humans.ask(ctx, decision, top_up_id, shortfall, kind="tool")
                asked += 1
                if amount:
                    top_ups[top_up_id] = amount
                if action == "deny":
                    break
                if action == "approve_once":
                    if ledger.fits(held + item.price):
                        decision = Decision.accepted(reason=HUMAN_APPROVED, trace=decision.trace, **decision.usage)
                    break
                # A top-up: the oracle decides again against the raised budget.
            if decision.accept:
                held += item.price
                accepted.append(item.proposal)

                def reserve(item: _Pending = item) -> None:
                    try:
                        entry = ledger.reserve(item.key, item.proposal.tool, item.price,
                                               market_version=market.version, tool_call_id=item.proposal.call_id)
                    except BudgetExceededError:
                        # Another run took the shared budget's money since the check: refused, not
                        # run. refuse() appends its log record to `effects`, which runs it next.
                        refuse(item.key, item.proposal.call_id, item.proposal.tool, item.proposal.args,
                               item.price, "reject", OVER_BUDGET,
                               fb.over_budget(item.proposal.tool, item.price, ledger.remaining_for("tool"),
                                              ledger.budget))
                        return
                    new_entries[entry.call_id] = entry

                effects.append(reserve)
                decisions[item.key] = {
                    "accept": True, "tool": item.proposal.tool, "args": dict(item.proposal.args), "price": item.price, "step": step,
                    "reason": decision.reason, "feedback": decision.feedback,
                    "trace": [s.to_dict() for s in decision.trace] if decision.trace else [], "decision_ms": decision_ms,
                    "usage": dict(decision.usage),
                }
            else:
                refuse(item.key, item.proposal.call_id, item.proposal.tool, item.proposal.args, item.price, "reject",
                       decision.reason, decision.feedback or fb.generic_rejection(item.proposal.tool), decision,
                       decision_ms)
    except BaseException:
        if humans is not None:
            humans.rollback()
        raise
    if humans is not None:
        effects.insert(0, humans.log)
    for effect in effects:  # (a list: what an effect appends, a late refusal's record, runs too)
        effect()
    if decisions:
        with episode.lock:
            episode.decided.update(decisions)

    update: dict[str, Any] = {}
    if out_messages:
        update["messages"] = out_messages
    written = (settled or {}).get(LEDGER_KEY)
    if written:
        channel_update = dict(written)
        entries = dict(channel_update.get("entries", {}))
    else:  # (a new dict already: not copied again)
        channel_update, entries = channel_base(episode), {}
    for k, e in new_entries.items():  # (a loop, not a dict comprehension: no function made per gate)
        entries[k] = ledger.serialized(e)
    channel_update["entries"] = entries
    if decisions:
        channel_update["decisions"] = decisions
    if top_ups:
        by = ledger.approved_by
        channel_update["top_ups"] = {**channel_update.get("top_ups", {}), **top_ups}
        channel_update["top_up_by"] = {**channel_update.get("top_up_by", {}),
                                       **{k: by[k] for k in top_ups if k in by}}
    channel_update["market_version"] = market.version
    channel_update |= episode.query_update(channel, messages)  # the run's task, as its first step had it
    if episode.market is not None:
        channel_update["market"] = market.to_dict()
        channel_update["market_scope"] = "episode"
    # ``at``: where the message sits in the history, so that a message rebuilt outside the guard is
    # told from a later one that reuses its call ids (intent.metering); a model step's ``pending``
    # count for this gate is replaced.
    counted = {"count": step + 1, "total": step + 1, "last_id": ai.id, "at": index} if ai.id else turns
    if counted:
        channel_update["turns"] = counted  # the next turn is numbered on from this one (turns_before)
    if (settled or not channel or decisions or top_ups or channel.get("market_version") != market.version
            or counted != turns):
        update[LEDGER_KEY] = channel_update
    io[0] = update or None


def _oracle_price(guard: BudgetGuard) -> tuple[str, ModelPrice]:
    found = guard.model_prices.find(guard.oracle_model)
    assert found is not None  # checked in __init__
    return found

def hold_oracle(guard: BudgetGuard, episode: Episode, step: int) -> str | None:
    """With ``oracle_max_tokens``, hold the most the oracle's next decision may cost before it runs.

    Returns the hold's charge id, ``""`` when it does not fit (the oracle is not asked), or
    ``None`` without a per-decision bound (the decision is charged after the fact).
    """
    if guard.oracle_max_tokens is None:
        return None
    name, price = _oracle_price(guard)
    worst = guard.oracle_max_tokens * max(price.input_per_mtok, price.output_per_mtok) / 1e6
    charge_id = f"oracle:{episode.episode_id}:{step}:{uuid.uuid4().hex[:10]}"
    try:
        episode.ledger.reserve(charge_id, name, worst, kind="oracle", execution=1)
    except BudgetExceededError:
        return ""
    return charge_id

def charge_oracle(guard: BudgetGuard, episode: Episode, decision: Decision, step: int, query: str,
                  hold: str | None) -> LedgerEntry | None:
    """Charge the oracle's own model tokens (``Decision.usage``) at ``oracle_model``'s price.

    With ``oracle_max_tokens`` the decision's worst case was held before it ran (``hold``) and
    the real cost is committed against it, so the budget is never exceeded unless the oracle
    used more than its bound (an overrun, recorded). Without it the oracle has already run when
    it is charged: money spent is spent, and a charge that does not fit is an overrun.
    ``input_tokens`` / ``output_tokens`` are priced as such; a bare ``tokens`` count at the dearer
    of the two per-token prices (an upper bound).
    """
    usage = decision.usage
    name, price = _oracle_price(guard)
    if "input_tokens" in usage or "output_tokens" in usage:
        inp, out = int(usage.get("input_tokens", 0)), int(usage.get("output_tokens", 0))
        cost = price.cost(inp, out)
    else:
        inp, out = int(usage.get("tokens", 0)), 0
        cost = inp * max(price.input_per_mtok, price.output_per_mtok) / 1e6
    ledger = episode.ledger
    if hold is None:  # no bound: the oracle has already spent this
        if cost <= 0:
            return None
        with episode.lock:
            entry = ledger.charge_now(f"oracle:{episode.episode_id}:{step}:{uuid.uuid4().hex[:10]}", name,
                                      cost, kind="oracle")
    elif cost <= 0:
        ledger.release(hold)
        return ledger.get(hold)
    else:
        entry = ledger.commit(hold, cost)
    guard.records.model_charge(ledger, entry, episode_id=episode.episode_id, step=step, query=query, model=name,
                              tokens={"input": inp, "output": out, "cached": 0}, reason="oracle_decision")
    return entry


def dedupe_ids(ai: AIMessage) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The message's calls with later duplicates of an id renamed; ``{new id: shared id}``."""
    seen: set[str] = set()
    calls: list[dict[str, Any]] = []
    renamed: dict[str, str] = {}
    for call in ai.tool_calls:
        cid = call.get("id")
        if cid is not None and cid in seen:
            n = 1
            while f"{cid}~dup{n}" in seen:
                n += 1
            new = f"{cid}~dup{n}"
            renamed[new] = cid
            call = {**call, "id": new}
        if call.get("id") is not None:
            seen.add(call["id"])
        calls.append(call)
    return calls, renamed
