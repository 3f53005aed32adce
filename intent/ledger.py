"""The budget ledger: the only place in the project that knows money.

Money moves in three steps keyed by the tool-call id:

``reserve(call_id, tool, amount)``
    before the tool runs; refused (``BudgetExceededError``) unless
    ``spent + reserved + amount <= budget``.
``commit(call_id)``
    after the tool ran, whether it succeeded or raised (money spent is spent).
``release(call_id)``
    when an accepted call never ran (another middleware answered it, the run moved on).
``reprice(call_id, amount)``
    when the price changed between the gate and the run (or a reviewer edited the call):
    a rise must fit what is left, a fall gives the difference back.
``top_up(top_up_id, amount, approved_by=...)``
    an explicit, logged raise of the budget (a human approved more money).

One ledger holds every kind of spending of an episode: ``kind="tool"`` (a priced tool's
run), ``"model"`` (one execution of the agent's chat model, priced per token),
``"oracle"`` (the oracle's own model calls, with ``charge_oracle=True``) and
``"sub_agent"`` (a child budget carved for a sub-agent). They share the budget; a
:class:`~intent.budget.Budget` may add sub-caps (``tools=``, ``llm=``) that a call must fit too.

Keys are *charge ids*: the guard reserves the first run of a proposed call under the call's
key and every further run (a retry) under ``key#n``, so each execution is paid.
A commit may name the amount the provider actually billed. A bill above the reservation
is an **overrun**: it is recorded (the money was spent). A tool billed above its quote is a
provider that cannot be trusted, so an enforcing ledger then accepts no further
reservation; a model call whose prompt was larger than its estimate is recorded the same
way but only stops what no longer fits.

Every operation is idempotent by call id, so a replayed or retried call is charged at
most once, and the invariant ``spent + reserved <= budget`` holds after every operation
(unless the ledger was built with ``allow_overspend=True``, which only the soft
benchmark baselines use: then overspending is *recorded* in :attr:`overspent`).

The ledger serialises to a plain dict (:meth:`to_state`) that lives in LangGraph state;
:func:`merge_ledger_states` is the channel reducer, so parallel tool nodes that each
commit their own call merge without losing a charge.
"""

from __future__ import annotations

import math
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from intent._build import builder
from intent.budget import CAP_OF_KIND, ENTRY_KINDS, Budget, EntryKind
from intent.errors import IntentError
from intent.market import InvalidPriceError, check_amount

__all__ = [
    "BUDGET_EPS",
    "BudgetExceededError",
    "BudgetLedger",
    "LedgerEntry",
    "LedgerError",
    "merge_ledger_states",
]

EntryStatus = Literal["reserved", "committed", "released"]
# A later status never goes back to an earlier one: committed is final.
_RANK: dict[str, int] = {"reserved": 0, "released": 1, "committed": 2}
# Float sums of prices: tolerate rounding noise, never a real cent.
# The one tolerance for "fits the budget", used by the ledger and by every metric that
# compares a spend with a budget (float sums of prices).
BUDGET_EPS = 1e-9
_EPS = BUDGET_EPS


class LedgerError(IntentError, RuntimeError):
    """An operation that the ledger cannot perform (unknown call id, released call committed...)."""


class BudgetExceededError(LedgerError):
    """A reservation would make ``spent + reserved`` exceed the budget."""


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One charge: ``call_id`` is the ledger key (a proposed call's key, ``key#n`` for its n-th run)."""

    call_id: str
    tool: str
    amount: float
    status: EntryStatus
    seq: int
    market_version: int = 0
    tool_call_id: str = ""  # the model's tool-call id (several charges may share it)
    execution: int = 0  # 1-based run number of the proposed call; 0 while only reserved by the gate
    overrun: float = 0.0  # billed above the reservation
    kind: EntryKind = "tool"  # tool | model | oracle | sub_agent; ``tool`` then names the tool or model
    # Its charge id in a shared budget store when not the default "<run>/<call_id>" (after a
    # reprice); kept in the entry so that a run resumed in another process commits the right one.
    store_id: str = ""

    @property
    def call_key(self) -> str:
        """The proposed call this charge belongs to (the ledger key without its ``#n``)."""
        return self.call_id.split("#", 1)[0]

    def to_dict(self) -> dict[str, Any]:
        d = {
            "call_id": self.call_id, "tool": self.tool, "amount": self.amount, "status": self.status,
            "seq": self.seq, "market_version": self.market_version, "tool_call_id": self.tool_call_id,
            "execution": self.execution, "overrun": self.overrun, "kind": self.kind,
        }
        if self.store_id:  # (set after the others, in the same order; no empty dict made and unpacked per entry)
            d["store_id"] = self.store_id
        return d


# LedgerEntry(...) for the ledger's own operations, made the cheap way (intent._build): two or three
# entries are made on every tool call.
_entry = builder(LedgerEntry)


class BudgetLedger:
    """Thread-safe reserve/commit/release ledger for one episode (one graph thread)."""

    def __init__(
        self,
        budget: float | Budget,
        *,
        allow_overspend: bool = False,
        entries: Mapping[str, LedgerEntry] | None = None,
        top_ups: Mapping[str, float] | None = None,
        approved_by: Mapping[str, str] | None = None,
        caps: Mapping[str, float] | None = None,
    ) -> None:
        if isinstance(budget, Budget):
            caps = {**budget.caps(), **(caps or {})}
            budget = budget.total
        self._budget = check_amount(budget, "budget")
        self._caps: dict[str, float] = {}
        for group, cap in (caps or {}).items():
            if group not in set(CAP_OF_KIND.values()):
                raise LedgerError(f"unknown sub-cap {group!r}; the sub-caps are 'tools' and 'llm'")
            self._caps[group] = check_amount(cap, f"sub-cap {group!r}")
        self._top_ups: dict[str, float] = {k: check_amount(v, f"top-up {k!r}") for k, v in (top_ups or {}).items()}
        self._approved_by: dict[str, str] = dict(approved_by or {})
        self._allow_overspend = bool(allow_overspend)
        self._entries: dict[str, LedgerEntry] = {}
        # Charge ids of each proposed call, in the order they were made (the gate's, then retries).
        self._by_call: dict[str, list[str]] = {}
        # Reservations not yet settled, in the order made (a dict as an ordered set): the guard
        # looks for them at every model boundary.
        self._held_ids: dict[str, None] = {}
        # Running totals per status, so that spent/remaining are O(1) on the hot path.
        self._totals: dict[str, float] = {"reserved": 0.0, "committed": 0.0, "released": 0.0}
        # Held or spent per sub-cap group ("tools", "llm"), for Budget(tools=..., llm=...).
        self._held_by_group: dict[str, float] = {}
        self._overrun = 0.0
        self._blocking_overrun = 0.0  # overruns of tools (not of model token estimates)
        self._lock = threading.RLock()
        # A budget shared with other runs (intent.stores): every reservation must fit it too.
        self._shared: tuple[Any, str, str] | None = None  # (store, budget key, run id)
        # Who made each reservation (the guard sets it to intent.state.current_task for an agent run as
        # a subgraph, or an episode something visits: parallel branches of one thread share this ledger, and
        # a branch settles only what is not a running sibling's or a visitor's).
        self.owner: Callable[[], str] | None = None
        self._owners: dict[str, str] = {}
        # Each entry's serialised form, made once per version of the entry and written to graph state as is
        # (serialized): while state holds what this ledger holds, "what does state lack?" (behind, ahead_of,
        # unseen_in, at every model step) is one dict comparison in C, not a Python loop over the episode.
        self._dicts: dict[str, dict[str, Any]] = {}
        for entry in (entries or {}).values():
            self._put(entry)

    def _put(self, entry: LedgerEntry) -> None:
        # (Runs two or three times per tool call: attributes read once, the sub-cap groups' sums kept inline.)
        cid, status, amount, kind = entry.call_id, entry.status, entry.amount, entry.kind
        old = self._entries.get(cid)
        if (old is not None and old.status == status and old.amount == amount
                and old.overrun == entry.overrun and old.kind == kind):
            self._entries[cid] = entry  # no total moves (a run number, a store id): every tool call
            self._dicts.pop(cid, None)
            return
        totals, by_group = self._totals, self._held_by_group
        if old is not None:
            totals[old.status] -= old.amount
            self._overrun -= old.overrun
            if old.kind not in _ESTIMATED_KINDS:
                self._blocking_overrun -= old.overrun
            if old.status != "released":
                group = CAP_OF_KIND.get(old.kind)
                if group is not None:
                    by_group[group] = by_group.get(group, 0.0) + -old.amount
        else:
            self._by_call.setdefault(cid.split("#", 1)[0], []).append(cid)  # (entry.call_key, without the call)
        self._entries[cid] = entry
        self._dicts.pop(cid, None)
        if status == "reserved":
            self._held_ids[cid] = None
        else:
            self._held_ids.pop(cid, None)
        totals[status] += amount
        self._overrun += entry.overrun
        if kind not in _ESTIMATED_KINDS:
            self._blocking_overrun += entry.overrun
        if status != "released":
            group = CAP_OF_KIND.get(kind)
            if group is not None:
                by_group[group] = by_group.get(group, 0.0) + amount

    # ------------------------------------------------------------------ totals
    @property
    def budget(self) -> float:
        """The budget in force: the base budget plus every top-up."""
        return self._budget + sum(self._top_ups.values())

    @property
    def base_budget(self) -> float:
        return self._budget

    @property
    def caps(self) -> dict[str, float]:
        """Sub-caps by group (``"tools"``, ``"llm"``); empty when only the total binds."""
        return dict(self._caps)

    @property
    def approved_by(self) -> dict[str, str]:
        """Who approved each top-up (by top-up id)."""
        with self._lock:
            return dict(self._approved_by)

    def spent_by_kind(self) -> dict[str, float]:
        """Committed money per entry kind (tool, model, oracle, sub_agent)."""
        with self._lock:
            out: dict[str, float] = {}
            for e in self._entries.values():
                if e.status == "committed":
                    out[e.kind] = out.get(e.kind, 0.0) + e.amount
            return out

    def share(self, store: Any, key: str, run_id: str) -> None:
        """Draw on the shared budget ``key`` of ``store`` too: a call must fit both (intent.stores)."""
        self._shared = (store, key, run_id)

    @property
    def shared(self) -> tuple[Any, str, str] | None:
        return self._shared

    def _shared_left(self) -> float | None:
        if self._shared is None:
            return None
        store, key, _ = self._shared
        return store.left(key)

    def remaining_for(self, kind: str = "tool") -> float:
        """What a call of ``kind`` may still reserve: the total left, its sub-cap's left, and the
        shared budget's left."""
        # (_sum and budget inlined, the same arithmetic: the gate asks this for every call)
        with self._lock:
            committed, reserved = self._totals["committed"], self._totals["reserved"]
            committed = 0.0 if -1e-12 < committed < 1e-12 else committed
            reserved = 0.0 if -1e-12 < reserved < 1e-12 else reserved
            budget = self._budget + sum(self._top_ups.values()) if self._top_ups else self._budget
            left = max(0.0, budget - committed - reserved)
            if self._caps:
                group = CAP_OF_KIND.get(kind)
                if group in self._caps:
                    left = min(left, max(0.0, self._caps[group] - self._held_by_group.get(group, 0.0)))
        if self._shared is None:
            return left
        shared = self._shared_left()
        return left if shared is None else min(left, shared)

    @property
    def top_ups(self) -> dict[str, float]:
        with self._lock:
            return dict(self._top_ups)

    @property
    def overrun(self) -> float:
        """Money billed above reservations (a provider charged more than the quoted price)."""
        with self._lock:
            return self._overrun

    @property
    def blocking_overrun(self) -> float:
        """Overruns that stop all further spending (a tool billed above its quote)."""
        with self._lock:
            return self._blocking_overrun

    @property
    def halted(self) -> bool:
        """Whether a tool's overrun stopped all further spending (enforcing ledgers only): then even
        a reservation made before the overrun may not start its run."""
        # One float, assigned whole (no lock needed to read it); the flag never changes.
        return self._blocking_overrun > _EPS and not self._allow_overspend

    @property
    def allow_overspend(self) -> bool:
        return self._allow_overspend

    def _sum(self, status: str) -> float:
        # Running totals of float amounts: after adds and removals an empty status can be left
        # with 1e-16 of rounding; that is zero, not a held cent.
        value = self._totals[status]
        return 0.0 if abs(value) < 1e-12 else value

    @property
    def spent(self) -> float:
        with self._lock:
            return self._sum("committed")

    @property
    def reserved(self) -> float:
        with self._lock:
            return self._sum("reserved")

    @property
    def remaining(self) -> float:
        """Money not yet spent or held by a reservation (never negative)."""
        with self._lock:
            return max(0.0, self.budget - self._sum("committed") - self._sum("reserved"))

    @property
    def overspent(self) -> float:
        """How far ``spent + reserved`` exceeds the budget (only > 0 with allow_overspend)."""
        with self._lock:
            return max(0.0, self._sum("committed") + self._sum("reserved") - self.budget)

    def _fits_here(self, amount: float, kind: str) -> bool:
        """The local part of :meth:`fits` (the shared store checks its own part atomically)."""
        # (_sum and budget inlined, the same arithmetic: asked twice for every call gated)
        with self._lock:
            if self._blocking_overrun > _EPS and not self._allow_overspend:  # halted
                return False
            if self._caps:
                group = CAP_OF_KIND.get(kind)
                if group in self._caps and self._held_by_group.get(group, 0.0) + amount > self._caps[group] + _EPS:
                    return False
            committed, reserved = self._totals["committed"], self._totals["reserved"]
            committed = 0.0 if -1e-12 < committed < 1e-12 else committed
            reserved = 0.0 if -1e-12 < reserved < 1e-12 else reserved
            budget = self._budget + sum(self._top_ups.values()) if self._top_ups else self._budget
            return committed + reserved + amount <= budget + _EPS

    def fits(self, amount: float, kind: str = "tool") -> bool:
        """Whether ``amount`` more of ``kind`` can be reserved: within the total, the kind's
        sub-cap and the shared budget. After a tool's overrun nothing fits (enforcing ledgers)."""
        if not self._fits_here(amount, kind):
            return False
        if self._shared is None:
            return True
        shared = self._shared_left()
        return shared is None or amount <= shared + _EPS

    # ------------------------------------------------------------- operations
    def get(self, call_id: str) -> LedgerEntry | None:
        # No lock: one dict read is atomic, and an entry is immutable (replaced whole, never changed), so the
        # lock would add nothing but its cost (this is read twice per tool call).
        return self._entries.get(call_id)

    def entries(self) -> list[LedgerEntry]:
        """Every entry, in the order made (cheaper than iterating, which sorts by ``seq``)."""
        with self._lock:
            return list(self._entries.values())

    def serialized(self, entry: LedgerEntry) -> dict[str, Any]:
        """``entry.to_dict()``: while ``entry`` is this ledger's current version of its charge, the same dict
        each time. Written to graph state as is; never change it."""
        with self._lock:
            cid = entry.call_id
            if self._entries.get(cid) is not entry:
                return entry.to_dict()
            d = self._dicts.get(cid)
            if d is None:
                d = self._dicts[cid] = entry.to_dict()
            return d

    def _same_as(self, known: Mapping[str, Any]) -> bool:
        """Whether serialised entries ``known`` (a channel's) are exactly this ledger's, every field of
        every entry; the caller holds the lock. One comparison in C (the values are mostly the very dicts
        :meth:`serialized` gave), after serialising the entries never serialised yet."""
        dicts = self._dicts
        if len(dicts) != len(self._entries):
            for cid, entry in self._entries.items():
                if cid not in dicts:
                    dicts[cid] = entry.to_dict()
        return dicts == known

    def unseen_in(self, known: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """The serialised entries that ``known`` (a channel's entries) lacks or holds at another status."""
        with self._lock:
            if self._same_as(known):
                return {}
            changed = {}
            for cid, entry in self._entries.items():
                raw = known.get(cid)
                if raw is None or raw["status"] != entry.status:
                    changed[cid] = self.serialized(entry)
            return changed

    def held(self) -> list[LedgerEntry]:
        """Reservations not yet committed or released."""
        with self._lock:  # (map, not a list comprehension: no function made on every model step)
            return list(map(self._entries.__getitem__, self._held_ids))

    def charges_of(self, call_key: str) -> list[LedgerEntry]:
        """Every charge of one proposed call: its gate reservation, then one per further run."""
        with self._lock:  # (map, not a list comprehension: no function made twice per tool call)
            return list(map(self._entries.__getitem__, self._by_call.get(call_key, ())))

    def __contains__(self, call_id: object) -> bool:
        return call_id in self._entries

    def __iter__(self) -> Iterator[LedgerEntry]:
        with self._lock:
            return iter(sorted(self._entries.values(), key=lambda e: e.seq))

    def __len__(self) -> int:
        return len(self._entries)

    def reserve(
        self, call_id: str, tool: str, amount: float, *, market_version: int = 0, tool_call_id: str = "",
        execution: int = 0, kind: EntryKind = "tool",
    ) -> LedgerEntry:
        """Hold ``amount`` for ``call_id``. Idempotent: a known id returns its entry unchanged."""
        if not isinstance(call_id, str) or not call_id:
            raise LedgerError(f"call_id must be a non-empty string, got {call_id!r}")
        if kind not in ENTRY_KINDS:
            raise LedgerError(f"kind must be one of {ENTRY_KINDS}, got {kind!r}")
        if not (type(amount) is float and 0.0 <= amount < math.inf):  # the usual case needs no message built
            amount = check_amount(amount, f"amount of call {call_id!r}")
        with self._lock:
            existing = self._entries.get(call_id)
            if existing is not None:
                return existing
            if not self._allow_overspend and not self._fits_here(amount, kind):
                raise BudgetExceededError(self._no_fit(call_id, tool, amount, kind))
            return self._hold(call_id, tool, amount, amount, market_version=market_version,
                              tool_call_id=tool_call_id, execution=execution, kind=kind)

    def _hold(self, call_id: str, tool: str, amount: float, store_amount: float, *, market_version: int = 0,
              tool_call_id: str = "", execution: int = 0, kind: EntryKind = "tool") -> LedgerEntry:
        """Record the reservation (the caller checked that it may be made), holding ``store_amount`` in
        the shared store: atomic there, which raises if another run took the money."""
        if self._shared is not None:
            store, key, run_id = self._shared
            store.reserve(key, f"{run_id}/{call_id}", store_amount, run_id=run_id, tool=tool, kind=kind)
        entry = _entry(call_id, tool, amount, "reserved", len(self._entries), market_version,
                       tool_call_id, execution, kind=kind)
        self._put(entry)
        if self.owner is not None:
            self._owners[call_id] = self.owner()
        return entry

    def owner_of(self, call_id: str) -> str | None:
        """Who made the reservation ``call_id`` (see :attr:`owner`); ``None`` when not known (a charge
        taken in from graph state)."""
        return self._owners.get(call_id)

    def _no_fit(self, call_id: str, tool: str, amount: float, kind: str = "tool") -> str:
        if self._blocking_overrun > _EPS:
            return (f"call {call_id!r} to {tool!r} refused: a provider billed {self._blocking_overrun:g} above its "
                    "reservation (overrun), so no further spending is allowed")
        group = CAP_OF_KIND.get(kind)
        if group in self._caps and self._held_by_group.get(group, 0.0) + amount > self._caps[group] + _EPS:
            return (f"call {call_id!r} to {tool!r} costs {amount:g} but only "
                    f"{max(0.0, self._caps[group] - self._held_by_group.get(group, 0.0)):g} of the {group} "
                    f"sub-cap {self._caps[group]:g} is left")
        return (f"call {call_id!r} to {tool!r} costs {amount:g} but only {self.remaining:g} "
                f"of the budget {self.budget:g} is left")

    def charge_now(self, call_id: str, tool: str, cost: float, *, kind: EntryKind) -> LedgerEntry:
        """Charge money already spent (a model response nobody metered, an oracle's decision):
        reserve what still fits, then commit the bill; any excess is recorded as an overrun."""
        cost = check_amount(cost, f"cost of call {call_id!r}")
        with self._lock:
            if call_id in self._entries:  # idempotent, as reserve + commit are
                return self.commit(call_id, cost)
            # No fit check: the money is spent, and refusing to record it (a halted ledger, a budget an
            # earlier overrun took, another run's hold in the shared store) would crash the run and forget
            # the charge. What still fitted is the reservation, the rest an overrun; the store holds 0 and
            # is then billed the whole cost (its left may have moved since remaining_for read it).
            self._hold(call_id, tool, min(cost, self.remaining_for(kind)), 0.0, kind=kind, execution=1)
            return self.commit(call_id, cost)

    def bill_late(self, call_id: str, billed: float) -> LedgerEntry | None:
        """A provider's bill for a run that arrived after the run was charged (a sync tool whose thread
        went on after its async run was cancelled, and the charge was then its reservation). What it
        billed above the charge is committed as ``<call_id>:late``, all of it an overrun (as a bill above
        the reservation is: no further spending). A bill at or below the charge changes nothing (the
        money was taken). Returns the new entry, or ``None``. Idempotent."""
        billed = check_amount(billed, f"late bill of call {call_id!r}")
        with self._lock:
            entry = self._entries.get(call_id)
            if entry is None or entry.status != "committed":
                raise LedgerError(f"cannot bill {call_id!r} late: it was never charged")
            late_id = f"{call_id}:late"
            if late_id in self._entries:
                return self._entries[late_id]
            extra = billed - entry.amount
            if extra <= _EPS:
                return None
            if self._shared is not None:  # the store holds nothing for it: held at 0, then billed
                store, key, run_id = self._shared
                store.reserve(key, f"{run_id}/{late_id}", 0.0, run_id=run_id, tool=entry.tool, kind=entry.kind)
                store.commit(key, f"{run_id}/{late_id}", extra)
            # Run 0: not a run of its own (a log record of it is not a gate decision, nor an execution).
            late = LedgerEntry(late_id, entry.tool, extra, "committed", len(self._entries), entry.market_version,
                               entry.tool_call_id, 0, extra, kind=entry.kind)
            self._put(late)
            return late

    def reprice(
        self, call_id: str, amount: float, *, tool: str | None = None, market_version: int | None = None
    ) -> LedgerEntry:
        """Change a reservation's amount (and tool). A rise must fit; a fall gives the rest back."""
        amount = check_amount(amount, f"amount of call {call_id!r}")
        with self._lock:
            entry = self._entries.get(call_id)
            if entry is None or entry.status != "reserved":
                raise LedgerError(f"cannot reprice {call_id!r}: it is not a held reservation")
            rise = amount - entry.amount
            if rise > _EPS and not self._allow_overspend and not self._fits_here(rise, entry.kind):
                raise BudgetExceededError(self._no_fit(call_id, tool or entry.tool, amount, entry.kind))
            if self._shared is not None and abs(rise) > _EPS:
                # The store has no reprice: the new amount is held under a new charge id (refused if it
                # does not fit) and the old hold given back, in one transaction when the store can.
                store, key, run_id = self._shared
                old = entry.store_id or f"{run_id}/{call_id}"
                new = f"{run_id}/{call_id}~{len(self._entries)}:{amount!r}"
                rekey = getattr(store, "rekey", None)
                if callable(rekey):  # the old hold given back in the same transaction: a rise that fits fits
                    rekey(key, old, new, amount, run_id=run_id, tool=tool or entry.tool, kind=entry.kind)
                else:
                    store.reserve(key, new, amount, run_id=run_id, tool=tool or entry.tool, kind=entry.kind)
                    store.release(key, old)
                entry = _evolve(entry, store_id=new)
            entry = _evolve(entry, amount=amount, tool=tool or entry.tool,
                            market_version=entry.market_version if market_version is None else market_version)
            self._put(entry)
            return entry

    def mark_run(self, call_id: str, execution: int) -> LedgerEntry:
        """Record which run of the proposed call a held reservation pays for. With a shared budget, a
        run (``execution`` >= 1) gets a store charge of its own (:meth:`_store_charge_for_run`): raises
        :class:`BudgetExceededError` when the store no longer has room for it."""
        with self._lock:
            entry = self._entries[call_id]
            if execution > 0 and self._shared is not None:
                # Always, even for a hold this object made: a thread paused before its tool step may have
                # been resumed (and the call run) in another process, then forked here.
                entry = _evolve(entry, execution=execution, store_id=self._store_charge_for_run(entry))
            else:
                if self._shared is not None and entry.execution > 0:
                    # The run stopped before it finished (an interrupt inside the tool): its store hold is
                    # given back while the call waits (a human may take days), and the re-run holds again.
                    # Held, it would sit beside the re-run's own hold until its lease ran out.
                    store, key, run_id = self._shared
                    store.release(key, entry.store_id or f"{run_id}/{call_id}")  # the re-run rekeys
                entry = _entry(entry.call_id, entry.tool, entry.amount, entry.status, entry.seq,
                               entry.market_version, entry.tool_call_id, execution, entry.overrun, entry.kind,
                               entry.store_id)  # _evolve(entry, execution=execution), on every tool call
            self._put(entry)
            return entry

    def _store_charge_for_run(self, entry: LedgerEntry) -> str:
        """Move the entry's hold in the shared store to a charge id of this run's own. A run repeated
        in another process after a crash (its first run committed, then the step's writes were lost)
        would otherwise commit the first run's charge again, which the store ignores (idempotent by id),
        and the store would count one run for two."""
        assert self._shared is not None
        store, key, run_id = self._shared
        old = entry.store_id or f"{run_id}/{entry.call_id}"
        new = f"{run_id}/{entry.call_id}@{uuid.uuid4().hex[:12]}"
        rekey = getattr(store, "rekey", None)
        if callable(rekey):
            rekey(key, old, new, entry.amount, run_id=run_id, tool=entry.tool, kind=entry.kind)
        else:  # a store without rekey: give the hold back, then hold again (refused if it no longer fits)
            store.release(key, old)
            store.reserve(key, new, entry.amount, run_id=run_id, tool=entry.tool, kind=entry.kind)
        return new

    def commit(self, call_id: str, amount: float | None = None) -> LedgerEntry:
        """Turn the reservation into a charge. Idempotent; a released call cannot be committed.

        ``amount``: what the provider actually billed, if the tool reported it. Below the
        reservation the rest is given back; above it the excess is recorded as an overrun.
        """
        with self._lock:
            entry = self._entries.get(call_id)
            if entry is None:
                raise LedgerError(f"cannot commit {call_id!r}: it was never reserved; reserve it before running the tool")
            if entry.status == "released":
                raise LedgerError(f"cannot commit {call_id!r}: its reservation was released, so the call must not run")
            if entry.status == "committed":
                return entry
            if amount is None:
                entry = _with_status(entry, "committed")
            else:
                billed = amount if type(amount) is float and 0.0 <= amount < math.inf else check_amount(
                    amount, f"billed amount of call {call_id!r}")
                over = max(0.0, billed - entry.amount)
                entry = _evolve(entry, status="committed", amount=billed, overrun=over if over > _EPS else 0.0)
            # Committed here first: the run happened, so its money is spent even when the shared store cannot
            # be told (an error out of the store must not leave the run reserved, to be released as unused).
            self._put(entry)
            if self._shared is not None:
                store, key, run_id = self._shared
                store.commit(key, entry.store_id or f"{run_id}/{call_id}", entry.amount)
            return entry

    def release(self, call_id: str) -> LedgerEntry | None:
        """Give back a reservation. Idempotent; a committed charge is never released."""
        with self._lock:
            entry = self._entries.get(call_id)
            if entry is None or entry.status != "reserved":
                return entry
            if self._shared is not None:
                store, key, run_id = self._shared
                store.release(key, entry.store_id or f"{run_id}/{call_id}")
            entry = _with_status(entry, "released")
            self._put(entry)
            return entry

    def release_held(self, call_id: str) -> LedgerEntry | None:
        """:meth:`release` a reservation still held; ``None`` when it is not (committed, or released
        already: by another settle that got there first, whose release is the one to log)."""
        with self._lock:
            entry = self._entries.get(call_id)
            if entry is None or entry.status != "reserved":
                return None
            return self.release(call_id)

    def top_up(self, top_up_id: str, amount: float, *, approved_by: str = "") -> float:
        """Raise the budget by ``amount`` (idempotent by id). Returns the new budget."""
        amount = check_amount(amount, "top-up amount", allow_zero=False)
        with self._lock:
            if top_up_id not in self._top_ups and math.isinf(self.budget + amount):
                raise InvalidPriceError(f"top-up amount {amount:g} on a budget of {self.budget:g} makes it infinite; "
                                        "top up by a smaller amount")
            self._top_ups.setdefault(top_up_id, amount)
            if approved_by:
                self._approved_by.setdefault(top_up_id, approved_by)
            return self.budget

    def revoke_top_up(self, top_up_id: str) -> None:
        """Take back a top-up applied by a node run that was then interrupted (it re-applies on
        resume, by the same id). Never used for a top-up that reached graph state."""
        with self._lock:
            self._top_ups.pop(top_up_id, None)
            self._approved_by.pop(top_up_id, None)

    def behind(self, entries: Mapping[str, Mapping[str, Any]]) -> bool:
        """Whether serialised ``entries`` hold a charge this ledger has not seen, or a status further on."""
        with self._lock:
            if self._same_as(entries):
                return False
            mine = self._entries
            for cid, raw in entries.items():
                old = mine.get(cid)
                if old is None or (old.status != raw["status"] and _RANK[raw["status"]] > _RANK[old.status]):
                    return True
            return False

    def ahead_of(self, state: Mapping[str, Any], pending: Mapping[str, Any] = {}) -> bool:  # noqa: B006 - read only
        """Whether this ledger holds what ``state`` (its channel) lacks: a charge it has not got, or has at
        an earlier status, or a top-up (other than the ``pending`` ones, written at the next step)."""
        with self._lock:
            known = state.get("entries") or {}
            if not self._same_as(known):
                for cid, entry in self._entries.items():
                    raw = known.get(cid)
                    if raw is None or (raw["status"] != entry.status and _RANK[entry.status] > _RANK[raw["status"]]):
                        return True
            if self._top_ups:
                written = state.get("top_ups") or {}
                return any(k not in written and k not in pending for k in self._top_ups)
            return False

    def catch_up(self, state: Mapping[str, Any] | None) -> None:
        """Take in ``state`` (this ledger's channel) when it holds charges this ledger has not seen, or
        statuses further on: another process spent on the thread since this copy was made."""
        if not state:
            return
        known = state.get("entries")
        if known and self.behind(known):
            self.take_in_state(state)

    def take_in_state(self, state: Mapping[str, Any]) -> None:
        """Take in what ``state`` (this ledger's channel) has and this ledger lacks: charges made by
        another process, statuses moved on (:meth:`absorb`)."""
        self.absorb(state)

    def absorb(self, state: Mapping[str, Any]) -> None:
        """Merge a serialised ledger; statuses only move forward. The state's budget wins."""
        with self._lock:
            if "budget" in state:
                self._budget = check_amount(state["budget"], "budget")
            for k, v in (state.get("top_ups") or {}).items():
                self._top_ups.setdefault(k, float(v))
            for k, v in (state.get("top_up_by") or {}).items():
                self._approved_by.setdefault(k, str(v))
            for group, cap in (state.get("caps") or {}).items():
                self._caps.setdefault(group, float(cap))
            entries = self._entries
            for cid, raw in (state.get("entries") or {}).items():
                old = entries.get(cid)
                if old is None or (old.status != raw["status"] and _RANK[raw["status"]] > _RANK[old.status]):
                    self._put(LedgerEntry(**raw))

    # ---------------------------------------------------------- serialisation
    def to_state(self) -> dict[str, Any]:
        with self._lock:
            return {
                "budget": self._budget,
                "allow_overspend": self._allow_overspend,
                "entries": {cid: e.to_dict() for cid, e in self._entries.items()},
                "top_ups": dict(self._top_ups),
                "top_up_by": dict(self._approved_by),
                "caps": dict(self._caps),
            }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> BudgetLedger:
        if not isinstance(state, Mapping):
            raise LedgerError(
                f"BudgetLedger.from_state takes the guard's ledger channel (state['intent_ledger']), got "
                f"{type(state).__name__} {state!r:.60}; a checkpoint from before the run's first model step has "
                "none (nothing was spent yet): read it with snapshot.values.get('intent_ledger')")
        try:
            entries = {cid: LedgerEntry(**e) for cid, e in (state.get("entries") or {}).items()}
            return cls(state["budget"], allow_overspend=bool(state.get("allow_overspend", False)), entries=entries,
                       top_ups=state.get("top_ups") or None, approved_by=state.get("top_up_by") or None,
                       caps=state.get("caps") or None)
        except (KeyError, TypeError) as exc:
            raise LedgerError(
                f"ledger state is malformed ({exc!r}); expected {{'budget': float, 'entries': {{call_id: entry}}}}"
            ) from exc

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            budget = self.budget
            return {
                "budget": budget,
                "spent": self._sum("committed"),
                "reserved": self._sum("reserved"),
                "remaining": max(0.0, budget - self._sum("committed") - self._sum("reserved")),
                "overrun": self._overrun,
            }

    def __repr__(self) -> str:
        s = self.snapshot()
        return f"BudgetLedger(budget={s['budget']:g}, spent={s['spent']:g}, reserved={s['reserved']:g})"


def _evolve(entry: LedgerEntry, **changes: Any) -> LedgerEntry:
    """``dataclasses.replace`` for an entry, without its per-call field introspection: the
    ledger makes two or three of these on every tool call."""
    if not changes.keys() <= _EVOLVABLE:
        raise TypeError(f"cannot change {sorted(changes.keys() - _EVOLVABLE)} of a ledger entry")
    return _entry(
        changes.get("call_id", entry.call_id), changes.get("tool", entry.tool), changes.get("amount", entry.amount),
        changes.get("status", entry.status), entry.seq, changes.get("market_version", entry.market_version),
        entry.tool_call_id, changes.get("execution", entry.execution), changes.get("overrun", entry.overrun),
        entry.kind, changes.get("store_id", entry.store_id),
    )


def _with_status(entry: LedgerEntry, status: EntryStatus) -> LedgerEntry:
    return _entry(entry.call_id, entry.tool, entry.amount, status, entry.seq, entry.market_version,
                  entry.tool_call_id, entry.execution, entry.overrun, entry.kind, entry.store_id)


def merge_ledger_states(left: Mapping[str, Any] | None, right: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """LangGraph reducer for the ledger channel.

    Entries merge by call id and a status only moves forward (reserved -> released ->
    committed is never undone, committed is final), so applying the same update twice,
    or parallel updates in any order, gives the same ledger: no charge is lost or doubled.
    The budget is fixed by the first state that sets it.
    """
    if not left:
        return dict(right) if right else None
    if not right:
        return dict(left)
    # Written for speed: LangGraph applies this to every write of the channel, twice (once to
    # read fresh state for the next edge, once to apply the step), two writes per tool call.
    merged = dict(left)
    for key, value in right.items():
        how = _MERGE.get(key)  # one lookup per key (not a test of each set in turn)
        if how is None:
            # Everything else (budget, episode id, overspend flag) is fixed by the first state that sets it.
            if key not in merged:
                merged[key] = value
        elif how == _LATEST:
            # The market snapshot and the turn count are the latest the gate wrote.
            merged[key] = value
        elif how == _ENTRIES:
            value = value or {}
            known = left.get("entries")
            if not known:
                merged["entries"] = dict(value)
                continue
            entries = dict(known)
            for cid, entry in value.items():
                old = entries.get(cid)
                if old is None or _RANK[entry["status"]] > _RANK[old["status"]]:
                    entries[cid] = entry
            merged["entries"] = entries
        elif how == _UNITE:
            # Top-ups and the gate's decisions are keyed by id and never change once written.
            known = left.get(key)
            merged[key] = {**known, **(value or {})} if known else dict(value or {})
        elif how == _RUN_TASK_KEY:
            # A run's task (intent.messages.query_of) and its run, written together: a later run's replaces
            # an earlier one's; within one run the first written stays (a run's task is fixed at its first step).
            if right.get("query_run", 1) > (left.get("query_run", 1) if "query" in left else 0):
                merged[key] = value
        else:  # _HIGHEST
            # Run counters (intent.state.runs_of): parallel branches may write them in any order.
            merged[key] = max(value, left.get(key) or 0)
    return merged


# Model calls are reserved at an estimate of their prompt: a bill above it is not a broken quote.
_ESTIMATED_KINDS = frozenset({"model", "oracle"})
_LATEST_WINS = frozenset({"market", "market_version", "market_scope", "turns", "carved_by"})
_RUN_TASK = frozenset({"query", "query_run"})
_UNION = frozenset({"top_ups", "top_up_by", "decisions", "caps"})
_HIGHEST_WINS = frozenset({"runs_started", "runs_ended"})
# How merge_ledger_states merges each key it knows (any other key: the first state that sets it wins).
_ENTRIES, _UNITE, _RUN_TASK_KEY, _HIGHEST, _LATEST = range(5)
_MERGE: dict[str, int] = {"entries": _ENTRIES, **dict.fromkeys(_UNION, _UNITE), **dict.fromkeys(_RUN_TASK, _RUN_TASK_KEY),
                          **dict.fromkeys(_HIGHEST_WINS, _HIGHEST), **dict.fromkeys(_LATEST_WINS, _LATEST)}
_EVOLVABLE = frozenset({"call_id", "tool", "amount", "status", "market_version", "execution", "overrun", "store_id"})
