"""BudgetGuard: an oracle + a market + a budget, as LangChain middleware or LangGraph nodes.

One guarded step:

1. the model emits an AIMessage with one or more tool calls;
2. the *gate* (``after_model`` of the middleware, or :meth:`BudgetGuard.node`) goes through
   the calls **in order, as one batch**: prices from one market snapshot, the oracle's
   decision, then the guard's own check that the call fits what is left *after the
   reservations made earlier in the batch*; accepted calls are reserved, rejected ones
   get a ToolMessage with the feedback (status ``error``) and cost nothing;
3. the tool runs inside :meth:`BudgetGuard.wrap_tool_call`, which commits the reservation
   afterwards, even if the tool raised (money spent is spent);
4. the record goes to the log sink and the oracle's ``observe`` hook runs.

The ledger lives in graph state under :data:`LEDGER_KEY` with a merge-by-call-id reducer,
so a thread resumed from a checkpointer knows its spend and a replayed call id is never
charged twice. The guard keeps a small in-process mirror of each episode's ledger (an
LRU cache, rebuilt from state when missing) only so that parallel tool calls can log
exact running totals and a retried call id inside one process returns its first result.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, ToolMessage
from langgraph.errors import GraphBubbleUp
from langgraph.graph.message import add_messages
from langgraph.types import Command
from typing_extensions import NotRequired, TypedDict

from intent import feedback as fb
from intent.ledger import BudgetLedger, LedgerEntry, merge_ledger_states
from intent.logs import LogSink, StepRecord
from intent.market import Market, UnpricedToolError, check_amount
from intent.oracle import (
    ACCEPTED,
    BAD_ARGUMENTS,
    BANNED_TOOL,
    ORACLE_ERROR,
    OVER_BUDGET,
    UNKNOWN_TOOL,
    UNPRICED_TOOL,
    Decision,
    DecisionContext,
    EpisodeInfo,
    InvalidDecisionError,
    Oracle,
    Outcome,
    Proposal,
)

__all__ = ["LEDGER_KEY", "BudgetGuard", "GuardState", "OracleErrorPolicy"]

LEDGER_KEY = "intent_ledger"
OracleErrorPolicy = Literal["accept_if_fits", "reject"]
_MIRROR_EPISODES = 4096  # episodes whose ledger mirror is kept in memory (state stays the truth)
_RESULT_CACHE = 65536  # executed call ids whose result is kept for in-process retries


class GuardState(TypedDict):
    """Graph state for hand-built graphs: messages plus the guard's ledger channel.

    Extend it like ``MessagesState``: ``class MyState(GuardState): ...``.
    """

    messages: Annotated[list[AnyMessage], add_messages]
    intent_ledger: NotRequired[Annotated[dict[str, Any] | None, merge_ledger_states]]


@dataclass
class _Pending:
    """A tool call that passed the gate's validation and waits for the oracle."""

    call: Mapping[str, Any]
    proposal: Proposal
    price: float


class BudgetGuard:
    """Gate every priced tool call of an agent through an oracle and a hard budget.

    ``BudgetGuard(oracle, market, budget, *, enforce=True, log_sink=None, on_oracle_error="accept_if_fits")``

    * ``enforce=False`` is for the soft benchmark baselines only: calls that do not fit are
      still run, and the overspend is recorded in the ledger (``overspent``) and the logs.
    * ``on_oracle_error``: what to do when the oracle raises (a world-model server down, a
      timeout). ``"accept_if_fits"`` (default) accepts only a call that fits the remaining
      budget; ``"reject"`` rejects. Either way the guard never accepts a call that does not
      fit, and the error is logged with reason ``oracle_error``. An oracle that returns
      something other than a :class:`Decision` is a programming error and raises.
    """

    def __init__(
        self,
        oracle: Oracle | Any,
        market: Market,
        budget: float,
        *,
        enforce: bool = True,
        log_sink: LogSink | None = None,
        on_oracle_error: OracleErrorPolicy = "accept_if_fits",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not callable(getattr(oracle, "decide", None)):
            raise TypeError(
                f"oracle must have a decide(ctx) -> Decision method, got {type(oracle).__name__}; "
                "subclass intent.Oracle or pass intent.AcceptAll()"
            )
        if not isinstance(market, Market):
            raise TypeError(f"market must be an intent.Market, got {type(market).__name__}; build one with Market([...])")
        if on_oracle_error not in ("accept_if_fits", "reject"):
            raise ValueError(f"on_oracle_error must be 'accept_if_fits' or 'reject', got {on_oracle_error!r}")
        self.oracle = oracle
        self.budget = check_amount(budget, "budget")
        self.enforce = bool(enforce)
        self.log_sink = log_sink
        self.on_oracle_error = on_oracle_error
        self._clock = clock
        self._market = market
        self._episode_markets: dict[str, Market] = {}
        self._lock = threading.RLock()
        self._mirrors: OrderedDict[str, BudgetLedger] = OrderedDict()
        self._results: OrderedDict[tuple[str, str], ToolMessage] = OrderedDict()
        self._started: set[str] = set()
        # What the gate decided about each reserved call, for the record written after it runs.
        self._pending_meta: dict[tuple[str, str], tuple[int, str, Decision, float, int]] = {}

    # ================================================================== market
    @property
    def market(self) -> Market:
        return self._market

    def update_market(self, update: Market | Callable[[Market], Market]) -> Market:
        """Swap the market for every episode; applies from the next decision on."""
        with self._lock:
            new = update(self._market) if callable(update) else update
            if not isinstance(new, Market):
                raise TypeError(f"update_market needs a Market (or a function returning one), got {type(new).__name__}")
            self._market = new
            return new

    def update_episode_market(self, episode_id: str, update: Market | Callable[[Market], Market]) -> Market:
        """Swap the market of one episode only (e.g. CostBench-style mid-episode events)."""
        with self._lock:
            current = self._episode_markets.get(episode_id, self._market)
            new = update(current) if callable(update) else update
            if not isinstance(new, Market):
                raise TypeError(f"update_episode_market needs a Market, got {type(new).__name__}")
            self._episode_markets[episode_id] = new
            return new

    def market_for(self, episode_id: str, state_ledger: Mapping[str, Any] | None = None) -> Market:
        with self._lock:
            if episode_id in self._episode_markets:
                return self._episode_markets[episode_id]
        # A resumed episode whose market was scoped to it keeps that market.
        if state_ledger and state_ledger.get("market_scope") == "episode" and state_ledger.get("market"):
            market = Market.from_dict(state_ledger["market"])
            with self._lock:
                self._episode_markets.setdefault(episode_id, market)
            return market
        return self._market

    # ================================================================== ledger
    def ledger(self, state: Mapping[str, Any]) -> BudgetLedger:
        """The episode's ledger as recorded in ``state`` (merged with this process's mirror)."""
        channel = state.get(LEDGER_KEY) if isinstance(state, Mapping) else getattr(state, LEDGER_KEY, None)
        if not channel:
            return BudgetLedger(self.budget, allow_overspend=not self.enforce)
        return self._mirror(str(channel.get("episode_id", "")), channel)

    def _mirror(self, episode_id: str, channel: Mapping[str, Any] | None) -> BudgetLedger:
        """This process's ledger object for the episode, brought up to date with ``channel``.

        The same object is returned to every caller (parallel tool calls commit on it under
        its lock); entries only move forward, so a stale ``channel`` never undoes a charge.
        """
        with self._lock:
            ledger = self._mirrors.get(episode_id)
            if ledger is None:
                ledger = (
                    BudgetLedger.from_state(channel)
                    if channel and "budget" in channel
                    else BudgetLedger(self.budget, allow_overspend=not self.enforce)
                )
                self._mirrors[episode_id] = ledger
            elif channel:
                ledger.absorb(channel)
            self._mirrors.move_to_end(episode_id)
            while len(self._mirrors) > _MIRROR_EPISODES:
                self._mirrors.popitem(last=False)
            return ledger

    # ============================================================ the gate
    def _episode_id(self, state: Mapping[str, Any], config: Mapping[str, Any] | None) -> str:
        channel = state.get(LEDGER_KEY) if isinstance(state, Mapping) else None
        if channel and channel.get("episode_id"):
            return str(channel["episode_id"])
        thread_id = ((config or {}).get("configurable") or {}).get("thread_id")
        return str(thread_id) if thread_id is not None else f"episode-{uuid.uuid4().hex[:12]}"

    def _gate(
        self, state: Mapping[str, Any], config: Mapping[str, Any] | None
    ) -> Generator[DecisionContext, Decision | BaseException, dict[str, Any] | None]:
        """The batch gate as a generator: yields each context, receives the oracle's decision.

        Written once and driven by a sync loop (``decide``) or an async loop (``adecide``).
        """
        messages: Sequence[AnyMessage] = state.get("messages", [])
        last_ai = next((m for m in reversed(messages) if isinstance(m, AIMessage)), None)
        if last_ai is None:
            return None
        answered = {m.tool_call_id for m in messages if isinstance(m, ToolMessage)}
        channel = state.get(LEDGER_KEY)
        episode_id = self._episode_id(state, config)
        ledger = self._mirror(episode_id, channel)
        market = self.market_for(episode_id, channel)
        query = _first_human_text(messages)
        step = sum(1 for m in messages if isinstance(m, AIMessage)) - 1

        with self._lock:
            first_time = episode_id not in self._started and not channel
            self._started.add(episode_id)
        if first_time:
            self._call_hook("start", EpisodeInfo(episode_id, query, ledger.budget, market))

        out_messages: list[ToolMessage] = []
        new_entries: dict[str, LedgerEntry] = {}
        reasoning = _text_of(last_ai)

        # Calls the model could not even format: answered here, cost nothing.
        for bad in last_ai.invalid_tool_calls or []:
            cid = bad.get("id")
            if not cid or cid in answered:
                continue
            text = fb.invalid_call(bad.get("name"), bad.get("error") or "its arguments are not valid JSON")
            out_messages.append(ToolMessage(text, tool_call_id=cid, name=bad.get("name") or "", status="error",
                                            artifact={"intent_reason": BAD_ARGUMENTS}))
            self._log_rejection(episode_id, step, query, reasoning, cid, bad.get("name") or "", bad.get("args") or "",
                                None, "invalid", BAD_ARGUMENTS, text, ledger, market)

        pending: list[_Pending] = []
        for call in last_ai.tool_calls:
            cid = call["id"]
            if cid is None or cid in answered or cid in ledger:
                continue  # answered already, or gated before (a replay after resume)
            name = call["name"]
            proposal = Proposal(cid, name, dict(call.get("args") or {}), reasoning)
            if name in market.banned:
                text = fb.banned_tool(name)
                reason = BANNED_TOOL
            else:
                try:
                    pending.append(_Pending(call, proposal, market.price(name)))
                    continue
                except UnpricedToolError as exc:
                    text = fb.unpriced_tool(name, str(exc))
                    reason = UNPRICED_TOOL if name in market else UNKNOWN_TOOL
            out_messages.append(ToolMessage(text, tool_call_id=cid, name=name, status="error",
                                            artifact={"intent_reason": reason}))
            self._log_rejection(episode_id, step, query, reasoning, cid, name, proposal.args, None,
                                "invalid", reason, text, ledger, market)

        batch = tuple(p.proposal for p in pending)
        for index, item in enumerate(pending):
            ctx = DecisionContext(
                episode_id=episode_id,
                query=query,
                proposal=item.proposal,
                price=item.price,
                budget=ledger.budget,
                spent=ledger.spent,
                remaining=ledger.remaining,
                market=market,
                step=step,
                history=messages,
                batch=batch,
                batch_index=index,
            )
            started = self._clock()
            answer = yield ctx
            decision_ms = (self._clock() - started) * 1000.0
            decision = self._check_decision(answer, ctx)
            if decision.accept and self.enforce and not ledger.fits(item.price):
                # The guard's own check: no oracle can overspend the budget.
                decision = Decision.rejected(
                    fb.over_budget(item.proposal.tool, item.price, ledger.remaining, ledger.budget),
                    reason=OVER_BUDGET,
                    trace=decision.trace,
                    **decision.usage,
                )
            if decision.accept:
                entry = ledger.reserve(item.proposal.call_id, item.proposal.tool, item.price,
                                       market_version=market.version)
                new_entries[entry.call_id] = entry
                self._pending_meta[(episode_id, entry.call_id)] = (step, query, decision, decision_ms, market.version)
            else:
                text = decision.feedback or fb.generic_rejection(item.proposal.tool)
                out_messages.append(
                    ToolMessage(text, tool_call_id=item.proposal.call_id, name=item.proposal.tool, status="error",
                                artifact={"intent_reason": decision.reason})
                )
                self._log_rejection(episode_id, step, query, reasoning, item.proposal.call_id, item.proposal.tool,
                                    item.proposal.args, item.price, "reject", decision.reason, text, ledger,
                                    market, decision=decision, decision_ms=decision_ms)

        update: dict[str, Any] = {}
        if out_messages:
            update["messages"] = out_messages
        channel_update = {
            "episode_id": episode_id,
            "budget": ledger.budget,
            "allow_overspend": ledger.allow_overspend,
            "entries": {cid: _entry_dict(e) for cid, e in new_entries.items()},
            "market_version": market.version,
        }
        if episode_id in self._episode_markets:
            channel_update["market"] = market.to_dict()
            channel_update["market_scope"] = "episode"
        if not channel or new_entries or channel.get("market_version") != market.version:
            update[LEDGER_KEY] = channel_update
        return update or None

    def _check_decision(self, answer: Decision | BaseException, ctx: DecisionContext) -> Decision:
        if isinstance(answer, BaseException):
            # The oracle failed (timeout, server down): the documented fallback.
            if self.on_oracle_error == "reject":
                return Decision.rejected(fb.oracle_failed(ctx.tool, answer, accepted=False), reason=ORACLE_ERROR)
            return Decision(True, fb.oracle_failed(ctx.tool, answer, accepted=True), (), ORACLE_ERROR, {"oracle_error": 1.0})
        if not isinstance(answer, Decision):
            raise InvalidDecisionError(
                f"{type(self.oracle).__name__}.decide() returned {type(answer).__name__}, not an intent.Decision; "
                "return Decision.accepted() or Decision.rejected(feedback, reason=...)"
            )
        return answer

    def gate(self, state: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """Gate the last AIMessage's tool calls (sync). Returns a state update."""
        gen = self._gate(state, config)
        try:
            ctx = next(gen)
            while True:
                try:
                    answer: Decision | BaseException = self.oracle.decide(ctx)
                except Exception as exc:  # noqa: BLE001 - the fallback policy decides
                    answer = exc
                ctx = gen.send(answer)
        except StopIteration as stop:
            return stop.value

    async def agate(self, state: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """Async twin of :meth:`gate`, using the oracle's ``adecide`` when it has one."""
        gen = self._gate(state, config)
        adecide = getattr(self.oracle, "adecide", None)
        try:
            ctx = next(gen)
            while True:
                try:
                    answer: Decision | BaseException = (
                        await adecide(ctx) if adecide is not None else self.oracle.decide(ctx)
                    )
                except Exception as exc:  # noqa: BLE001
                    answer = exc
                ctx = gen.send(answer)
        except StopIteration as stop:
            return stop.value

    # ===================================================== running a tool call
    def _before_run(self, request: Any) -> tuple[str, LedgerEntry | None, ToolMessage | None]:
        channel = _channel_of(request)
        call = request.tool_call
        cid, name = call["id"], call["name"]
        episode_id = str(channel.get("episode_id")) if channel else ""
        ledger = self._mirror(episode_id, channel) if channel else None
        entry = ledger.get(cid) if ledger is not None else None
        with self._lock:
            cached = self._results.get((episode_id, cid))
        if entry is not None and entry.status == "committed":
            # A replay or retry of a call that already ran: it is not run (nor charged) again,
            # and the state that replays it records the one charge.
            message = cached or ToolMessage(fb.already_ran(name), tool_call_id=cid, name=name, status="error")
            return episode_id, entry, message
        if entry is None or entry.status == "released":
            return episode_id, None, ToolMessage(fb.not_gated(name), tool_call_id=cid, name=name, status="error")
        if request.tool is None:
            return episode_id, entry, ToolMessage(fb.unknown_tool(name), tool_call_id=cid, name=name, status="error")
        problem = _argument_problem(request.tool, call)
        if problem is not None:
            return episode_id, entry, ToolMessage(fb.invalid_call(name, problem), tool_call_id=cid, name=name,
                                                  status="error")
        return episode_id, entry, None

    def _after_run(
        self,
        request: Any,
        episode_id: str,
        entry: LedgerEntry,
        result: ToolMessage | Command | BaseException | None,
        tool_ms: float,
    ) -> ToolMessage | Command:
        """Commit the charge, log it once, tell the oracle, and build the state update."""
        call = request.tool_call
        cid, name = call["id"], call["name"]
        ledger = self._mirror(episode_id, _channel_of(request))
        committed = ledger.commit(cid)
        snap = ledger.snapshot()
        if isinstance(result, BaseException):
            message = ToolMessage(fb.tool_raised(name, result), tool_call_id=cid, name=name, status="error")
            extra_updates: dict[str, Any] = {}
        elif isinstance(result, Command):
            message, extra_updates = _tool_message_of_command(result, cid, name)
        else:
            message, extra_updates = result, {}  # type: ignore[assignment]
        status: Literal["ok", "error"] = "error" if getattr(message, "status", "success") == "error" else "ok"
        observation = _text_of(message)
        proposal = Proposal(cid, name, dict(call.get("args") or {}), "")
        outcome = Outcome(episode_id, proposal, committed.amount, status, observation, snap["spent"], snap["remaining"],
                          snap["budget"])
        self._call_hook("observe", outcome)
        note = self._call_hook("result_note", outcome)
        if note:
            message = ToolMessage(
                f"{observation}\n{note}", tool_call_id=cid, name=name, status=message.status,
                artifact=getattr(message, "artifact", None),
            )
        with self._lock:
            meta = self._pending_meta.pop((episode_id, cid), None)
            self._results[(episode_id, cid)] = message
            while len(self._results) > _RESULT_CACHE:
                self._results.popitem(last=False)
        step, query, decision, decision_ms, version = meta or (-1, "", Decision.accepted(), 0.0, committed.market_version)
        self._write(StepRecord(
            task_id=episode_id, step=step, call_id=cid, query=query, reasoning=_reasoning_for(request, cid),
            tool=name, args=dict(call.get("args") or {}), price=committed.amount, decision="accept",
            reason=decision.reason, oracle=_oracle_name(self.oracle), feedback=decision.feedback,
            trace=[s.to_dict() for s in decision.trace], observation=observation, status=status,
            charged=committed.amount, spent=snap["spent"], remaining=snap["remaining"], budget=snap["budget"],
            market_version=version, decision_ms=decision_ms, tool_ms=tool_ms,
            oracle_usage=dict(decision.usage), enforce=self.enforce, artifact=_json_artifact(message),
        ))
        update = {
            **extra_updates,
            "messages": [message],
            LEDGER_KEY: {"episode_id": episode_id, "budget": ledger.budget, "entries": {cid: _entry_dict(committed)}},
        }
        return Command(update=update)

    def _refuse(self, episode_id: str, entry: LedgerEntry | None, message: ToolMessage, request: Any) -> ToolMessage | Command:
        """Answer a call without running it. A held reservation is given back (costs nothing)."""
        if entry is None:
            return message
        if entry.status == "committed":
            return Command(update={
                "messages": [message],
                LEDGER_KEY: {"episode_id": episode_id, "budget": self._mirror(episode_id, None).budget,
                             "entries": {entry.call_id: _entry_dict(entry)}},
            })
        ledger = self._mirror(episode_id, _channel_of(request))
        released = ledger.release(entry.call_id)
        snap = ledger.snapshot()
        call = request.tool_call
        with self._lock:
            meta = self._pending_meta.pop((episode_id, entry.call_id), None)
        step, query = (meta[0], meta[1]) if meta else (-1, "")
        self._write(StepRecord(
            task_id=episode_id, step=step, call_id=entry.call_id, query=query, tool=call["name"],
            args=dict(call.get("args") or {}), price=entry.amount, decision="invalid",
            reason=BAD_ARGUMENTS if request.tool is not None else UNKNOWN_TOOL, oracle=_oracle_name(self.oracle),
            feedback=_text_of(message), status="invalid", charged=0.0, spent=snap["spent"],
            remaining=snap["remaining"], budget=snap["budget"], market_version=entry.market_version,
            enforce=self.enforce,
        ))
        return Command(update={
            "messages": [message],
            LEDGER_KEY: {"episode_id": episode_id, "budget": ledger.budget,
                         "entries": {entry.call_id: _entry_dict(released)}},
        })

    def wrap_tool_call(self, request: Any, handler: Callable[[Any], ToolMessage | Command]) -> ToolMessage | Command:
        """Run a gated call and charge it (LangChain ``wrap_tool_call`` / ToolNode wrapper)."""
        episode_id, entry, refusal = self._before_run(request)
        if refusal is not None:
            return self._refuse(episode_id, entry, refusal, request)
        assert entry is not None
        started = self._clock()
        try:
            result: ToolMessage | Command | BaseException = handler(request)
        except GraphBubbleUp:
            raise  # an interrupt: the call did not finish, it stays reserved and re-runs on resume
        except Exception as exc:  # noqa: BLE001 - money spent is spent; the agent sees the error
            result = exc
        return self._after_run(request, episode_id, entry, result, (self._clock() - started) * 1000.0)

    async def awrap_tool_call(
        self, request: Any, handler: Callable[[Any], Awaitable[ToolMessage | Command]]
    ) -> ToolMessage | Command:
        """Async twin of :meth:`wrap_tool_call`."""
        episode_id, entry, refusal = self._before_run(request)
        if refusal is not None:
            return self._refuse(episode_id, entry, refusal, request)
        assert entry is not None
        started = self._clock()
        try:
            result: ToolMessage | Command | BaseException = await handler(request)
        except GraphBubbleUp:
            raise
        except Exception as exc:  # noqa: BLE001
            result = exc
        return self._after_run(request, episode_id, entry, result, (self._clock() - started) * 1000.0)

    # ================================================= what the model is shown
    def visible_tool_names(self, state: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> set[str] | None:
        """Tools the agent may see now: not banned, and allowed by the oracle. ``None``: no filter."""
        channel = state.get(LEDGER_KEY) if isinstance(state, Mapping) else None
        episode_id = self._episode_id(state, config)
        market = self.market_for(episode_id, channel)
        allowed = self._call_hook("visible_tools", market, episode_id)
        if allowed is None and not market.banned:
            return None
        names = set(market.names) if allowed is None else set(allowed)
        return names - set(market.banned)

    def system_notes(self, state: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> str | None:
        channel = state.get(LEDGER_KEY) if isinstance(state, Mapping) else None
        episode_id = self._episode_id(state, config)
        ledger = self.ledger(state)
        return self._call_hook(
            "prompt_notes", self.market_for(episode_id, channel), episode_id, ledger.spent, ledger.remaining,
            ledger.budget,
        )

    # =============================================================== adapters
    def middleware(self) -> Any:
        """This guard as a LangChain v1 ``AgentMiddleware`` for ``create_agent(..., middleware=[...])``."""
        from intent.middleware import BudgetGuardMiddleware

        return BudgetGuardMiddleware(self)

    def node(self) -> Any:
        """The gate as a LangGraph node (sync and async) for hand-built graphs."""
        from intent.graph import guard_node

        return guard_node(self)

    def tool_node(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        """A ``ToolNode`` whose calls are charged by this guard."""
        from intent.graph import guarded_tool_node

        return guarded_tool_node(self, tools, **kwargs)

    def route(self, state: Mapping[str, Any], *, tools: str = "tools", agent: str = "agent") -> Any:
        """Conditional edge after :meth:`node`: ``Send`` each accepted pending call to ``tools``."""
        from intent.graph import route_after_guard

        return route_after_guard(state, tools=tools, agent=agent)

    # ================================================================ helpers
    def _call_hook(self, name: str, *args: Any) -> Any:
        hook = getattr(self.oracle, name, None)
        return hook(*args) if callable(hook) else None

    def _write(self, record: StepRecord) -> None:
        if self.log_sink is not None:
            self.log_sink.write(record)

    def _log_rejection(
        self, episode_id: str, step: int, query: str, reasoning: str, cid: str, tool: str, args: Any,
        price: float | None, kind: Literal["reject", "invalid"], reason: str, text: str, ledger: BudgetLedger,
        market: Market, *, decision: Decision | None = None, decision_ms: float = 0.0,
    ) -> None:
        snap = ledger.snapshot()
        self._write(StepRecord(
            task_id=episode_id, step=step, call_id=cid, query=query, reasoning=reasoning, tool=tool,
            args=args if isinstance(args, (dict, str)) else {"value": repr(args)}, price=price, decision=kind,
            reason=reason, oracle=_oracle_name(self.oracle), feedback=text,
            trace=[s.to_dict() for s in decision.trace] if decision else [],
            status="rejected" if kind == "reject" else "invalid", charged=0.0, spent=snap["spent"],
            remaining=snap["remaining"], budget=snap["budget"], market_version=market.version,
            decision_ms=decision_ms, oracle_usage=dict(decision.usage) if decision else {}, enforce=self.enforce,
        ))


# ---------------------------------------------------------------- helpers
def _entry_dict(entry: LedgerEntry) -> dict[str, Any]:
    return {
        "call_id": entry.call_id,
        "tool": entry.tool,
        "amount": entry.amount,
        "status": entry.status,
        "seq": entry.seq,
        "market_version": entry.market_version,
    }


def _json_artifact(message: Any) -> dict[str, Any] | None:
    artifact = getattr(message, "artifact", None)
    if not isinstance(artifact, dict):
        return None
    try:
        json.dumps(artifact)
    except (TypeError, ValueError):
        return None
    return artifact


def _channel_of(request: Any) -> Mapping[str, Any] | None:
    state = request.state if isinstance(request.state, Mapping) else {}
    return state.get(LEDGER_KEY)


def _text_of(message: Any) -> str:
    content = getattr(message, "content", message)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in content)
    return str(content)


def _first_human_text(messages: Sequence[AnyMessage]) -> str:
    for m in messages:
        if isinstance(m, HumanMessage):
            return _text_of(m)
    return ""


def _reasoning_for(request: Any, call_id: str) -> str:
    state = request.state if isinstance(request.state, Mapping) else {}
    for m in reversed(state.get("messages", [])):
        if isinstance(m, AIMessage) and any(c.get("id") == call_id for c in m.tool_calls):
            return _text_of(m)
    return ""


def _oracle_name(oracle: Any) -> str:
    return str(getattr(oracle, "name", None) or type(oracle).__name__)


def _argument_problem(tool: Any, call: Mapping[str, Any]) -> str | None:
    """Validate the call's arguments against the tool's schema before any money moves."""
    parse = getattr(tool, "_parse_input", None)
    if parse is None:
        return None
    try:
        parse(dict(call.get("args") or {}), call.get("id"))
    except Exception as exc:  # pydantic ValidationError, TypeError...
        errors = getattr(exc, "errors", None)
        if callable(errors):
            try:
                return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'args'}: {e['msg']}" for e in errors())
            except Exception:  # noqa: BLE001 - fall back to the plain message
                pass
        return str(exc).strip() or type(exc).__name__
    return None


def _tool_message_of_command(command: Command, cid: str, name: str) -> tuple[ToolMessage, dict[str, Any]]:
    update = dict(command.update or {}) if isinstance(command.update, Mapping) else {}
    messages = list(update.pop("messages", []) or [])
    for m in messages:
        if isinstance(m, ToolMessage) and m.tool_call_id == cid:
            others = [x for x in messages if x is not m]
            if others:
                update["messages"] = others
            return m, update
    return ToolMessage("", tool_call_id=cid, name=name), update

