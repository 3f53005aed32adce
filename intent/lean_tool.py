"""The lean tool run: the common sync run of a gated call written for itself, the general code as the fallback.

Most tool steps of a guarded agent are alike: a guard with no log sink and no oracle hook that reads a run's
outcome (``observe``, ``result_note``), a plain ledger (no shared store, no sub-caps, not a sub-agent's carve),
and one run of the call the gate accepted, as it was accepted (the same tool and arguments, at the price the
gate reserved), by a tool that does not turn its errors into answers (``handle_tool_error``) and answers with
a ToolMessage that carries no bill. For that run :class:`~intent.metering.CallRun` prices the call again,
looks for an edit, reserves through its general checks, charges through its general reading of the answer,
and closes the call through its general reading of the ledger: dozens of checks that each find nothing to do
(issue #11: the guard must cost under 0.2 ms per tool call; ``README.md``, "## Performance").

:class:`LeanRun` is a ``CallRun`` that tells, with cheap checks and before anything changes, whether a run is
such a run, and then does what the general code does there, and only that: the arguments validated against
the schema the model sees (a bad call refused free, with the general refusal), the gate's reservation marked
as the call's first run, the tool run inside the call's spending scope (a sub-agent inside carves from it),
the reservation committed at its amount, and the call closed with its charges written to state. Whenever a
check fails it hands the run to ``CallRun``'s own method, from the start (nothing was changed), and so for
everything that is not the usual run: an edited call, a retry (reserved again under ``key#n`` by the general
reservation), a bill, a Command, an exception (charged, re-raised or answered as the general code does), an
interrupt, an async run. The answer, the ledger and the state update are the same: ``tests/test_lean_tool.py``
drives the same scenarios with :data:`ENABLED` on and off and compares them.

:func:`call_run` makes the run the tool step uses (:func:`intent.lean_path.open_call`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.messages import AIMessage, AnyMessage, ToolMessage
from langgraph.types import Command
from pydantic import ValidationError

from intent import feedback as fb
from intent.ledger import _EPS, BudgetLedger, _entry
from intent.market import UnpricedToolError
from intent.messages import _problem, tool_schema
from intent.metering import CallRun
from intent.oracle import BAD_ARGUMENTS
from intent.state import LEDGER_KEY

if TYPE_CHECKING:
    from langgraph.prebuilt.tool_node import ToolCallRequest

    from intent.episodes import Episode
    from intent.guard import BudgetGuard

__all__ = ["ENABLED", "LeanRun", "call_run"]

# Off: every tool run takes the general code (the differential test drives both ways with it).
ENABLED = True


def call_run(guard: BudgetGuard, episode: Episode, key: str, request: ToolCallRequest, meta: dict[str, Any],
             messages: Sequence[AnyMessage], ai: AIMessage, channel: Mapping[str, Any] | None) -> CallRun:
    """``CallRun(guard, episode, key, request, meta, messages, ai, channel)``, as a :class:`LeanRun` when the
    guard and the episode's ledger allow one: no log sink, no ``observe`` or ``result_note`` hook (the general
    charge would build the run's outcome for them), a plain :class:`BudgetLedger` (no shared store, no
    sub-caps: not a carve), a channel that holds the fixed keys (so the call's close writes its charges only),
    and the gate's decision with the tool and arguments it accepted."""
    ledger = episode.ledger
    if (not ENABLED or guard.records.sink is not None or type(ledger) is not BudgetLedger or ledger._shared is not None
            or ledger._caps or type(channel) is not dict or "allow_overspend" not in channel or "budget" not in channel
            or "episode_id" not in channel or "tool" not in meta or type(meta.get("args")) is not dict):
        return CallRun(guard, episode, key, request, meta, messages, ai, channel)
    hooks = guard._hooks  # (guard._has_hook's answers, once known: False for both on nearly every guard)
    if ((hooks.get("observe") is not False and guard._has_hook("observe"))
            or (hooks.get("result_note") is not False and guard._has_hook("result_note"))):
        return CallRun(guard, episode, key, request, meta, messages, ai, channel)
    run = object.__new__(LeanRun)
    call = request.tool_call
    # CallRun.__init__'s attributes, set at once
    run.__dict__ = {"guard": guard, "episode": episode, "key": key, "request": request, "meta": meta,
                    "channel": channel, "tool_call_id": call["id"], "name": call["name"], "messages": messages,
                    "_ai": ai, "last_outcome": None, "regated": None, "refused": False, "raised": []}
    return run


class LeanRun(CallRun):
    """A :class:`CallRun` (see :func:`call_run` for when one is made) whose usual sync run and close are written
    for themselves; anything else is ``CallRun``'s."""

    def execute(self, tool: Any, tool_input: Any, config: Any, kwargs: dict[str, Any]) -> Any:
        """:meth:`CallRun.execute` of an unedited call's run: ``_args_of``, ``_admit`` (``_price``, ``_edited``,
        ``_reserve``) and ``_charge`` as they go for it."""
        meta = self.meta
        if self.regated or type(tool_input) is not dict or getattr(tool, "handle_tool_error", False):
            return CallRun.execute(self, tool, tool_input, config, kwargs)
        args = tool_input.get("args") or {}
        if tool_input.get("type") != "tool_call" or type(args) is not dict:
            return CallRun.execute(self, tool, tool_input, config, kwargs)
        name = tool.name
        if name != meta["tool"] or args != meta["args"]:
            return CallRun.execute(self, tool, tool_input, config, kwargs)  # an edited call (re-gated), or a redirect
        found = tool_schema(tool)
        if found.injected or found.full is not None:  # arguments LangGraph fills in; a stricter args_schema
            return CallRun.execute(self, tool, tool_input, config, kwargs)
        guard, episode = self.guard, self.episode
        # guard.market_for(episode_id): the episode's market as the registry has it, else the guard's
        live = guard.episodes._episodes.get(episode.episode_id)  # (EpisodeRegistry.peek)
        market = live.market if live is not None and live.market is not None else guard._market
        if name in market.banned:
            return CallRun.execute(self, tool, tool_input, config, kwargs)
        priced = market._by_name.get(name)  # market.price(name), read directly for a listed tool
        if priced is not None:
            price = priced.price
        else:
            try:
                price = market.price(name)
            except UnpricedToolError:
                return CallRun.execute(self, tool, tool_input, config, kwargs)
        # argument_problem(tool, args) for a tool without injected arguments or a stricter args_schema (checked above)
        validate = getattr(found.schema, "model_validate", None)
        if validate is not None:
            try:
                validate(args.copy())  # (a copy: a validator may change it)
            except ValidationError as exc:
                problem = _problem(exc)
                if problem is not None:
                    return self._refuse(name, dict(args), None, "invalid", BAD_ARGUMENTS,
                                        fb.invalid_call(name, problem))
            except Exception:  # noqa: BLE001 - a validator's own exception: the general run releases and raises it
                return CallRun.execute(self, tool, tool_input, config, kwargs)
        ledger, key = episode.ledger, self.key
        charge_id = None
        with episode.lock, ledger._lock:
            gated = ledger._entries.get(key)
            if (gated is not None and gated.status == "reserved" and gated.execution == 0 and ledger._shared is None
                    and len(ledger._by_call.get(key, ())) == 1 and abs(price - gated.amount) <= 1e-12
                    and name == gated.tool and not (ledger._blocking_overrun > _EPS and not ledger._allow_overspend)):
                # _reserve's first run of the call as the gate reserved it: ledger.mark_run(key, 1), whose entry
                # moves no total (BudgetLedger._put's first branch)
                ledger._entries[key] = _entry(gated.call_id, gated.tool, gated.amount, gated.status, gated.seq,
                                              gated.market_version, gated.tool_call_id, 1, gated.overrun, gated.kind,
                                              gated.store_id)
                ledger._dicts.pop(key, None)
                charge_id = key
        if charge_id is None:  # a retry (key#n), a repriced call, a halted ledger: the general reservation
            charge_id = self._reserve(name, args, price, market.version)
            if type(charge_id) is not str:
                return charge_id  # its refusal
        started = guard._clock()
        out = self._invoke(tool, tool_input, config, kwargs, charge_id, args, started)  # (what raised, charged)
        if type(out) is not ToolMessage or out.artifact is not None:
            self._charge(charge_id, args, out, started)  # a bill, a payment request, a Command, a list...
            return out
        # _charge of an answer with no bill, for a guard with no log and no outcome hook: committed at the
        # reservation. (The clock read as _charge reads it, for tool_ms: a guard's clock may count its reads.)
        guard._clock()
        ledger.commit(charge_id)
        return out

    def finish(self, result: Any) -> Any:
        """:meth:`CallRun.finish` of a ToolMessage answer once nothing of the call is held unrun: its charges
        written to state with the answer (no carve to close, no note to add, the channel's fixed keys there)."""
        episode = self.episode
        if type(result) is not ToolMessage or episode.carves or self.last_outcome is not None:
            return CallRun.finish(self, result)
        ledger, key = episode.ledger, self.key
        charges: dict[str, Any] = {}
        with episode.lock, ledger._lock:  # (CallRun.finish's, and charges_of's)
            gated = ledger._entries.get(key)
            general = gated is None or gated.status == "reserved" and gated.execution == 0  # a reservation to release
            if not general:
                # {e.call_id: ledger.serialized(e) for e in ledger.charges_of(key)}
                entries, dicts = ledger._entries, ledger._dicts
                for cid in ledger._by_call.get(key, ()):
                    d = dicts.get(cid)
                    if d is None:
                        d = dicts[cid] = entries[cid].to_dict()
                    charges[cid] = d
        if general:
            return CallRun.finish(self, result)
        # with_update(result, ...) of a ToolMessage, the channel's fixed keys there (call_run checked)
        return Command(update={"messages": [result], LEDGER_KEY: {"entries": charges}})
