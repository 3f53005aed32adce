"""The budget ledger: the only place in the project that knows money.

Money moves in three steps keyed by the tool-call id:

``reserve(call_id, tool, amount)``
    before the tool runs; refused (``BudgetExceededError``) unless
    ``spent + reserved + amount <= budget``.
``commit(call_id)``
    after the tool ran, whether it succeeded or raised (money spent is spent).
``release(call_id)``
    when an accepted call never ran (another middleware answered it, the run moved on).

Every operation is idempotent by call id, so a replayed or retried call is charged at
most once, and the invariant ``spent + reserved <= budget`` holds after every operation
(unless the ledger was built with ``allow_overspend=True``, which only the soft
benchmark baselines use: then overspending is *recorded* in :attr:`overspent`).

The ledger serialises to a plain dict (:meth:`to_state`) that lives in LangGraph state;
:func:`merge_ledger_states` is the channel reducer, so parallel tool nodes that each
commit their own call merge without losing a charge.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from intent.market import check_amount

__all__ = [
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
_EPS = 1e-9


class LedgerError(RuntimeError):
    """An operation that the ledger cannot perform (unknown call id, released call committed...)."""


class BudgetExceededError(LedgerError):
    """A reservation would make ``spent + reserved`` exceed the budget."""


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    call_id: str
    tool: str
    amount: float
    status: EntryStatus
    seq: int
    market_version: int = 0


class BudgetLedger:
    """Thread-safe reserve/commit/release ledger for one episode (one graph thread)."""

    def __init__(
        self,
        budget: float,
        *,
        allow_overspend: bool = False,
        entries: Mapping[str, LedgerEntry] | None = None,
    ) -> None:
        self._budget = check_amount(budget, "budget")
        self._allow_overspend = bool(allow_overspend)
        self._entries: dict[str, LedgerEntry] = {}
        # Running totals per status, so that spent/remaining are O(1) on the hot path.
        self._totals: dict[str, float] = {"reserved": 0.0, "committed": 0.0, "released": 0.0}
        self._lock = threading.RLock()
        for entry in (entries or {}).values():
            self._put(entry)

    def _put(self, entry: LedgerEntry) -> None:
        old = self._entries.get(entry.call_id)
        if old is not None:
            self._totals[old.status] -= old.amount
        self._entries[entry.call_id] = entry
        self._totals[entry.status] += entry.amount

    # ------------------------------------------------------------------ totals
    @property
    def budget(self) -> float:
        return self._budget

    @property
    def allow_overspend(self) -> bool:
        return self._allow_overspend

    def _sum(self, status: str) -> float:
        return self._totals[status]

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
            return max(0.0, self._budget - self._sum("committed") - self._sum("reserved"))

    @property
    def overspent(self) -> float:
        """How far ``spent + reserved`` exceeds the budget (only > 0 with allow_overspend)."""
        with self._lock:
            return max(0.0, self._sum("committed") + self._sum("reserved") - self._budget)

    def fits(self, amount: float) -> bool:
        with self._lock:
            return self._sum("committed") + self._sum("reserved") + amount <= self._budget + _EPS

    # ------------------------------------------------------------- operations
    def get(self, call_id: str) -> LedgerEntry | None:
        with self._lock:
            return self._entries.get(call_id)

    def __contains__(self, call_id: object) -> bool:
        return call_id in self._entries

    def __iter__(self) -> Iterator[LedgerEntry]:
        with self._lock:
            return iter(sorted(self._entries.values(), key=lambda e: e.seq))

    def __len__(self) -> int:
        return len(self._entries)

    def reserve(self, call_id: str, tool: str, amount: float, *, market_version: int = 0) -> LedgerEntry:
        """Hold ``amount`` for ``call_id``. Idempotent: a known id returns its entry unchanged."""
        if not isinstance(call_id, str) or not call_id:
            raise LedgerError(f"call_id must be a non-empty string, got {call_id!r}")
        amount = check_amount(amount, f"amount of call {call_id!r}")
        with self._lock:
            existing = self._entries.get(call_id)
            if existing is not None:
                return existing
            if not self._allow_overspend and not self.fits(amount):
                raise BudgetExceededError(
                    f"call {call_id!r} to {tool!r} costs {amount:g} but only {self.remaining:g} "
                    f"of the budget {self._budget:g} is left"
                )
            entry = LedgerEntry(call_id, tool, amount, "reserved", len(self._entries), market_version)
            self._put(entry)
            return entry

    def commit(self, call_id: str) -> LedgerEntry:
        """Turn the reservation into a charge. Idempotent; a released call cannot be committed."""
        with self._lock:
            entry = self._entries.get(call_id)
            if entry is None:
                raise LedgerError(f"cannot commit {call_id!r}: it was never reserved; reserve it before running the tool")
            if entry.status == "released":
                raise LedgerError(f"cannot commit {call_id!r}: its reservation was released, so the call must not run")
            if entry.status == "committed":
                return entry
            entry = _with_status(entry, "committed")
            self._put(entry)
            return entry

    def release(self, call_id: str) -> LedgerEntry | None:
        """Give back a reservation. Idempotent; a committed charge is never released."""
        with self._lock:
            entry = self._entries.get(call_id)
            if entry is None or entry.status != "reserved":
                return entry
            entry = _with_status(entry, "released")
            self._put(entry)
            return entry

    def absorb(self, state: Mapping[str, Any]) -> None:
        """Merge entries from a serialised ledger; statuses only move forward."""
        with self._lock:
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
                "entries": {cid: asdict(e) for cid, e in self._entries.items()},
            }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> BudgetLedger:
        try:
            entries = {cid: LedgerEntry(**e) for cid, e in (state.get("entries") or {}).items()}
            return cls(state["budget"], allow_overspend=bool(state.get("allow_overspend", False)), entries=entries)
        except (KeyError, TypeError) as exc:
            raise LedgerError(
                f"ledger state is malformed ({exc!r}); expected {{'budget': float, 'entries': {{call_id: entry}}}}"
            ) from exc

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {
                "budget": self._budget,
                "spent": self._sum("committed"),
                "reserved": self._sum("reserved"),
                "remaining": max(0.0, self._budget - self._sum("committed") - self._sum("reserved")),
            }

    def __repr__(self) -> str:
        s = self.snapshot()
        return f"BudgetLedger(budget={s['budget']:g}, spent={s['spent']:g}, reserved={s['reserved']:g})"


def _with_status(entry: LedgerEntry, status: EntryStatus) -> LedgerEntry:
    return LedgerEntry(entry.call_id, entry.tool, entry.amount, status, entry.seq, entry.market_version)


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
    entries: dict[str, dict[str, Any]] = dict(left.get("entries") or {})
    for cid, entry in (right.get("entries") or {}).items():
        old = entries.get(cid)
        if old is None or _RANK[entry["status"]] > _RANK[old["status"]]:
            entries[cid] = entry
    # Everything but the entries (budget, episode id, overspend flag) is fixed by the first
    # state that sets it; the market snapshot is the latest one the gate used.
    merged = dict(left)
    for key, value in right.items():
        if key in _LATEST_WINS or key not in merged:
            merged[key] = value
    merged["entries"] = entries
    return merged


_LATEST_WINS = ("market", "market_version", "market_scope")
