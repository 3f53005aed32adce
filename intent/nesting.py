"""Nested budgets: a sub-agent spends only what its parent has left.

A child guard built with ``budget=FromParent(limit)`` gets, for each of its episodes, a
**carve** of the parent's budget: when the child's episode starts (inside a tool call of the
parent's guarded agent, or inside ``with parent_guard.scope(config):`` in a subgraph node),
``min(limit, what the parent has left)`` is reserved in the parent's ledger as one
``kind="sub_agent"`` entry, and the child's ledger gets exactly that much. When the child's
episode ends (its ``after_agent``), or at the latest when the parent's tool call or scope
ends, the carve is committed at what the child spent and the rest goes back to the parent.

Carves are ordinary ledger reservations, so parallel sub-agents can never together take
more than the parent has left, and a grandchild carves from its child the same way. A
top-up inside the child must first be covered by the parent (the carve grows). Nesting
lives in process: the child runs inside the parent's call.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from intent.budget import Budget
from intent.errors import GuardConfigError
from intent.ledger import BudgetExceededError, BudgetLedger, LedgerEntry, merge_ledger_states
from intent.lineage import Reader, checkpoint_here
from intent.market import check_amount
from intent.state import LEDGER_KEY

if TYPE_CHECKING:
    from intent.episodes import Episode
    from intent.guard import BudgetGuard

_TASK_ID = "__pregel_task_id"  # LangGraph's CONFIG_KEY_TASK_ID: the running task's id
_INTERRUPT = "__interrupt__"  # the channel of a paused task's pending write (LangGraph's INTERRUPT)

__all__ = ["CarvedLedger", "FromParent", "ParentCall", "carves_from_store", "close_carves", "current_parent",
           "draws_on_store", "spending_scope"]


@dataclass(frozen=True)
class ParentCall:
    """Where money for a sub-agent comes from: a guard's episode and the call (or scope) key."""

    guard: BudgetGuard
    episode: Episode
    key: str
    config: Mapping[str, Any] | None = None  # the parent step's (its checkpoint, see FromParent.carve)


_CURRENT: ContextVar[ParentCall | None] = ContextVar("intent_parent_call", default=None)


def current_parent() -> ParentCall | None:
    return _CURRENT.get()


def enter_spending(guard: BudgetGuard, episode: Episode, key: str, config: Mapping[str, Any] | None = None) -> Any:
    """What ``with spending_scope(guard, episode, key, config):`` does on entering, for a caller on the hot path
    (every sync tool run) that resets the returned token itself (``_CURRENT.reset`` in a ``finally``): a
    ``with`` on a Python-level context manager costs two Python method calls and an instance."""
    parent = object.__new__(ParentCall)
    parent.__dict__.update(guard=guard, episode=episode, key=key, config=config)
    return _CURRENT.set(parent)


class spending_scope:  # noqa: N801 - used as a function: ``with spending_scope(guard, episode, key):``
    """Sub-agents started inside carve from ``episode`` under ``key``. (A class, not a
    ``contextmanager`` generator: it is entered around every tool run.)"""

    __slots__ = ("_parent", "_token")

    def __init__(self, guard: BudgetGuard, episode: Episode, key: str,
                 config: Mapping[str, Any] | None = None) -> None:
        # ParentCall(guard, episode, key, config) without the frozen dataclass __init__'s object.__setattr__ per
        # field (a scope is opened around every tool run): its fields set in its __dict__ at once, the same object.
        parent = object.__new__(ParentCall)
        parent.__dict__.update(guard=guard, episode=episode, key=key, config=config)
        self._parent = parent
        self._token: Any = None

    def __enter__(self) -> ParentCall:
        self._token = _CURRENT.set(self._parent)
        return self._parent

    def __exit__(self, *exc: object) -> None:
        _CURRENT.reset(self._token)


class CarvedLedger(BudgetLedger):
    """A child episode's ledger: its budget is a reservation in the parent's ledger."""

    def __init__(self, amount: float, *, parent: ParentCall, carve_id: str, caps: dict[str, float] | None = None,
                 allow_overspend: bool = False, episode_id: str = "") -> None:
        super().__init__(amount, caps=caps, allow_overspend=allow_overspend)
        self.parent = parent
        self.carve_id = carve_id
        self.episode_id = episode_id  # the child's episode, for the parent's log record
        self._prepaid = 0.0  # reservations taken over from an earlier, already paid carve (take_over)
        self.closed = False
        self._close_lock = threading.Lock()

    def absorb(self, state: Mapping[str, Any]) -> None:
        """Merge a serialised copy of the child's ledger, but keep the carve as the budget: the
        parent reserved that much, whatever an earlier carve's copy says."""
        super().absorb({k: v for k, v in state.items() if k != "budget"})

    def take_in_state(self, state: Mapping[str, Any]) -> None:
        # The child's channel keeps the charges of every carve it ran under (entries merge by id), and
        # what an earlier carve's charges mean for this one is take_over's to decide: only the statuses of
        # charges this carve holds move on (a call that finished in another process is committed here).
        with self._lock:
            held = {cid: raw for cid, raw in (state.get("entries") or {}).items() if cid in self._entries}
        if held:
            self.absorb({"entries": held})

    def take_over(self, state: Mapping[str, Any]) -> None:
        """What a new carve takes from the child's ledger in state when the child starts again inside
        a parent's call: everything, when the carve that held the child's earlier charges was never
        paid (a call re-run after an interrupt in another process: that carve's writes were lost with
        the task), else only the reservations still held (what a committed carve paid is not paid
        again)."""
        earlier = state.get("carved_by")
        settled = self.parent.episode.ledger.get(earlier) if isinstance(earlier, str) else None
        if isinstance(earlier, str) and (settled is None or settled.status != "committed"):
            self._take_all(state)
            return
        held = {cid: e for cid, e in (state.get("entries") or {}).items() if e.get("status") == "reserved"}
        self.absorb({"entries": held})
        # The earlier carve was committed with these reservations in it (CarvedLedger.close): the parent
        # has paid them. They stay the child's to run or release, but neither take this carve's room
        # nor are paid again when it closes.
        prepaid = sum(float(e["amount"]) for e in held.values())
        with self._lock:
            self._budget += prepaid
            self._prepaid += prepaid

    def _take_all(self, state: Mapping[str, Any]) -> None:
        """Take the whole of the child's ledger; the top-ups approved for it grow this carve in the
        parent first (as :meth:`top_up` does), or are dropped when the parent cannot cover them now."""
        before = set(self.top_ups)
        self.absorb(state)
        added = {k: v for k, v in self.top_ups.items() if k not in before}
        if not added:
            return
        parent_ledger = self.parent.episode.ledger
        with self.parent.episode.lock:
            carve = parent_ledger.get(self.carve_id)
            assert carve is not None
            try:
                parent_ledger.reprice(self.carve_id, carve.amount + sum(added.values()))
            except BudgetExceededError:
                for top_up_id in added:
                    BudgetLedger.revoke_top_up(self, top_up_id)  # not this carve's: the parent never grew it

    def _fits_here(self, amount: float, kind: str) -> bool:
        # Reserve and fits both ask this: a closed carve takes nothing more.
        return not self.closed and super()._fits_here(amount, kind)

    def top_up(self, top_up_id: str, amount: float, *, approved_by: str = "") -> float:
        """A child's top-up grows its carve first: refused (BudgetExceededError) if the parent cannot cover it."""
        amount = check_amount(amount, "top-up amount", allow_zero=False)
        if top_up_id not in self.top_ups:
            parent_ledger = self.parent.episode.ledger
            with self.parent.episode.lock:
                carve = parent_ledger.get(self.carve_id)
                assert carve is not None
                parent_ledger.reprice(self.carve_id, carve.amount + amount)
        return super().top_up(top_up_id, amount, approved_by=approved_by)

    def revoke_top_up(self, top_up_id: str) -> None:
        amount = self.top_ups.get(top_up_id)
        super().revoke_top_up(top_up_id)
        if amount:
            with self.parent.episode.lock:
                carve = self.parent.episode.ledger.get(self.carve_id)
                if carve is not None and carve.status == "reserved":
                    self.parent.episode.ledger.reprice(self.carve_id, max(0.0, carve.amount - amount))

    def close(self) -> LedgerEntry | None:
        """Commit the carve at what the child spent (and still holds); the rest returns to the parent."""
        with self._close_lock:
            if self.closed:
                return None
            self.closed = True
        snap = self.snapshot()
        parent_ledger = self.parent.episode.ledger
        with self.parent.episode.lock:
            entry = parent_ledger.commit(self.carve_id, max(0.0, snap["spent"] + snap["reserved"] - self._prepaid))
            self.parent.episode.carves.pop(self.carve_id, None)
        self.parent.guard.records.sub_budget(parent_ledger, entry, episode_id=self.parent.episode.episode_id,
                                             child_episode=self.episode_id or self.carve_id)
        return entry


@dataclass(frozen=True)
class FromParent:
    """A child guard's budget: carved, per episode, from the guarded call it runs inside.

    ``limit``: the most one carve may take (``None``: all the parent has left). A carve is made per
    parent call a child episode runs in: a child with a thread of its own started again from a later
    call (or paused and resumed from one) draws a new carve there, with its own ``limit`` and sub-caps.
    ``tools`` / ``llm``: sub-caps inside the child, as in :class:`~intent.budget.Budget`.
    """

    limit: float | None = None
    tools: float | None = None
    llm: float | None = None

    def __post_init__(self) -> None:
        if self.limit is not None:
            object.__setattr__(self, "limit", check_amount(self.limit, "FromParent.limit"))
        for name in ("tools", "llm"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_amount(getattr(self, name), f"FromParent.{name}"))

    @property
    def total(self) -> float:
        """The nominal budget (the limit) before any carve; 0 when unbounded."""
        return self.limit or 0.0

    def caps(self) -> dict[str, float]:
        return Budget(self.total, self.tools, self.llm).caps()

    def carve(self, episode_id: str, *, allow_overspend: bool = False, currency: str | None = None) -> CarvedLedger:
        """The child episode's carve; ``currency``: the child guard's (its prices'), which must be the parent's."""
        parent = _CURRENT.get()
        if parent is None:
            raise GuardConfigError(
                "budget=FromParent(...) carves from a guarded agent's running tool call, but none is running here; "
                "start the sub-agent from inside a tool of the guarded agent, or inside "
                "`with parent_guard.scope(config):`")
        theirs = getattr(parent.guard, "currency", None)
        if currency and theirs and currency.upper() != theirs.upper():
            raise GuardConfigError(f"the sub-agent's guard prices in {currency} but the guard it spends from counts "
                                   f"in {theirs}; one budget has one currency: price the sub-agent's tools and models "
                                   f"in {theirs}")
        carve_id = f"{parent.key}#sub:{episode_id}"
        finished, paused = _siblings(parent)
        with parent.episode.lock:
            if finished:
                parent.episode.ledger.take_in_state({"entries": finished})
            existing = parent.episode.carves.get(carve_id)
            if existing is not None:
                return existing
            ledger = parent.episode.ledger
            n = 1
            while (settled := ledger.get(carve_id)) is not None and settled.status != "reserved":
                # This call's carve for the episode was closed already (another sub-agent sharing the
                # episode ended): a new carve, so that what is spent from here is committed too.
                n += 1
                carve_id = f"{parent.key}#sub:{episode_id}~{n}"
            # A paused sibling's sub-agent that has not carved again here spent money no ledger here holds.
            hidden = sum(amount for carve, amount in paused.items() if ledger.get(carve) is None and carve != carve_id)
            left = max(0.0, ledger.remaining_for("sub_agent") - hidden)
            amount = left if self.limit is None else min(self.limit, left)
            ledger.reserve(carve_id, f"sub-agent:{episode_id}", amount, kind="sub_agent")
            child = CarvedLedger(amount, parent=parent, carve_id=carve_id, caps=self.caps() or None,
                                 allow_overspend=allow_overspend, episode_id=episode_id)
            parent.episode.carves[carve_id] = child
            return child


def _siblings(parent: ParentCall) -> tuple[dict[str, Any], dict[str, float]]:
    """What the other calls of the parent's step spent before it was paused, as a resumed task cannot see
    it in its own state (read only when a carve is made, from the parent step's checkpointer):

    * the ledger entries the calls that **finished** saved with the step's checkpoint (pending writes): a
      guard in another process would otherwise carve from a parent ledger without a finished sibling's
      carve and let its sub-agent spend that again;
    * for each call that was **paused** too, what its sub-agent's own state (its latest checkpoint, in the
      call's namespace) shows it spent and holds, by the carve it spent under: that carve's writes were lost
      with the task, so until the sibling carves again in this process, its spending is in no ledger here.

    Nothing when it cannot be read (no checkpointer, a subgraph's step, an async saver on its own event loop)."""
    config = parent.config or {}
    here = checkpoint_here(config)
    if here is None:
        return {}, {}
    reader = Reader(config)
    finished: dict[str, Any] | None = None
    paused: set[str] = set()
    configurable = config.get("configurable") or {}
    own = configurable.get(_TASK_ID)
    for task, channel, value in reader.pending_writes(here):
        if channel == LEDGER_KEY and isinstance(value, Mapping) and isinstance(value.get("entries"), Mapping):
            finished = merge_ledger_states(finished, {"entries": value["entries"]})  # statuses move forward only
        elif channel == _INTERRUPT and task != own:
            paused.add(str(task))
    node = str(configurable.get("checkpoint_ns") or "").partition(":")[0]
    hidden: dict[str, float] = {}
    for task in sorted(paused) if node else ():
        child = reader.latest_ledger(f"{node}:{task}", LEDGER_KEY)
        if isinstance(child, Mapping) and isinstance(child.get("carved_by"), str):
            held = sum(float(e["amount"]) for e in (child.get("entries") or {}).values()
                       if e.get("status") in ("reserved", "committed"))
            hidden[child["carved_by"]] = hidden.get(child["carved_by"], 0.0) + held
    return (finished or {}).get("entries") or {}, hidden


def draws_on_store(ledger: BudgetLedger) -> bool:
    """Whether ``ledger``'s money is in a shared budget store: its own (``ledger.shared``), or, for a carve,
    that of the ledger it is carved from, up the chain of carves (a carve, its close and a top-up that grows
    it are reservations and commits there)."""
    while ledger.shared is None:
        if not isinstance(ledger, CarvedLedger):
            return False
        ledger = ledger.parent.episode.ledger
    return True


def carves_from_store(parent: ParentCall | None) -> bool:
    """Whether a sub-agent carving from ``parent`` (:func:`current_parent`) reaches a shared budget store."""
    return parent is not None and draws_on_store(parent.episode.ledger)


def close_carves(episode: Episode, key_prefix: str) -> list[LedgerEntry]:
    """Close every open carve of ``episode`` made under ``key_prefix`` (a call's key, a scope)."""
    if not episode.carves:  # no sub-agent ever ran here: the usual case, on every tool call
        return []
    with episode.lock:
        open_carves = [c for cid, c in episode.carves.items() if cid.startswith(key_prefix + "#sub:")]
    closed = [c.close() for c in open_carves]
    return [e for e in closed if e is not None]
