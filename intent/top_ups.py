"""Top-ups and spending scopes: the ways a thread's budget changes, or is lent out, after it is set.

One job: move money into a thread's ledger from outside its model and tool steps. :func:`top_up` /
:func:`atop_up` raise a thread's budget (written to its state now with ``graph=``, else at its next model
step); :func:`scope` lets sub-agents run from a graph node carve from the thread's budget; and
:func:`unseen_by` / :func:`channel_base` build the ledger-channel update through which such changes (and
charges state has not seen) reach the graph's state. Kept apart from :mod:`intent.guard` because it is
driven by the application (a human approving more money, a subgraph node), not by the agent's steps, and
has its own hazards (a paused thread's ``update_state``, a top-up with no run going on here);
:class:`~intent.guard.BudgetGuard`'s ``top_up``, ``atop_up`` and ``scope`` are thin delegates to it. It sits
below :mod:`intent.lifecycle` (which writes its channel updates) and never imports :mod:`intent.guard`.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Generator, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from intent.errors import GuardConfigError
from intent.market import check_amount
from intent.lineage import _CHECKPOINTER
from intent.nesting import CarvedLedger, close_carves, spending_scope
from intent.state import LEDGER_KEY, branch_stamp, channel_of, read_ledger_channel, write_ledger_update

if TYPE_CHECKING:
    from intent.episodes import Episode
    from intent.guard import BudgetGuard

__all__ = ["apply_top_up", "atop_up", "channel_base", "check_graph", "scope", "thread_id_of", "top_up",
           "top_up_steps", "unseen_by"]


def thread_id_of(config: Any, method: str, *, required: bool = True) -> str | None:
    """The thread id of a run's config (or of a bare id), or a GuardConfigError naming ``method``'s fix."""
    if isinstance(config, str):
        return config
    if isinstance(config, Mapping):
        configurable = config.get("configurable") or {}
        thread_id = configurable.get("thread_id") if isinstance(configurable, Mapping) else None
        if thread_id is not None or not required:
            return None if thread_id is None else str(thread_id)
    raise GuardConfigError(f"{method} needs the thread's config ({{'configurable': {{'thread_id': ...}}}}) or its id "
                           f"(a str), got {type(config).__name__} {config!r}")


def top_up(guard: BudgetGuard, config: Mapping[str, Any] | str, amount: float, *, graph: Any = None, reason: str = "",
           approved_by: str = "") -> float:
    """:meth:`BudgetGuard.top_up <intent.guard.BudgetGuard.top_up>`: :func:`top_up_steps` driven with the
    graph's sync ``get_state`` / ``update_state``."""
    check_graph(graph, "top_up", ("get_state", "update_state"))
    steps = top_up_steps(guard, config, amount, graph=graph, reason=reason, approved_by=approved_by)
    try:
        step = next(steps)
        while True:
            step = steps.send(graph.get_state(*step[1]) if step[0] == "get" else graph.update_state(*step[1]))
    except StopIteration as done:
        return float(done.value)


async def atop_up(guard: BudgetGuard, config: Mapping[str, Any] | str, amount: float, *, graph: Any = None,
                  reason: str = "", approved_by: str = "") -> float:
    """:meth:`BudgetGuard.atop_up <intent.guard.BudgetGuard.atop_up>`: :func:`top_up_steps` driven with the
    graph's async ``aget_state`` / ``aupdate_state`` (an ``AsyncSqliteSaver`` or ``AsyncPostgresSaver`` has no
    sync ones)."""
    check_graph(graph, "atop_up", ("aget_state", "aupdate_state"))
    steps = top_up_steps(guard, config, amount, graph=graph, reason=reason, approved_by=approved_by)
    try:
        step = next(steps)
        while True:
            step = steps.send(await graph.aget_state(*step[1]) if step[0] == "get"
                              else await graph.aupdate_state(*step[1]))
    except StopIteration as done:
        return float(done.value)


def top_up_steps(guard: BudgetGuard, config: Mapping[str, Any] | str, amount: float, *, graph: Any, reason: str,
                 approved_by: str) -> Generator[tuple[str, tuple[Any, ...]], Any, float]:
    """A top-up, one graph call at a time (``("get", args)``: the state; ``("update", args)``: write it),
    driven by :func:`top_up` and :func:`atop_up`. Returns the new budget."""
    amount = check_amount(amount, "top-up amount", allow_zero=False)
    for name, text in (("reason", reason), ("approved_by", approved_by)):
        if not isinstance(text, str):
            raise GuardConfigError(f"top_up {name} must be a str (logged with the top-up), got "
                                   f"{type(text).__name__} {text!r}")
    thread_id = thread_id_of(config, "top_up")
    cfg = {"configurable": {"thread_id": thread_id}} if isinstance(config, str) else config
    channel = None
    if graph is not None:
        configurable = cfg.get("configurable") or {}
        if not configurable.get(_CHECKPOINTER, getattr(graph, "checkpointer", True)):  # as get_state looks it up
            raise GuardConfigError(
                "top_up graph= has no checkpointer, so the thread's budget is not saved anywhere to top up: compile "
                "the agent with one (create_agent(..., checkpointer=InMemorySaver())), or leave graph= out for a "
                "run going on in this process")
        channel = channel_of((yield ("get", (cfg,))).values)
    episode_id = guard.episode_of(channel, cfg) or str(thread_id)
    if graph is None and guard.episodes.peek(episode_id) is None:
        # No run of the thread is going on here, so its ledger (budget, earlier top-ups) is only in its
        # state: a top-up on a fresh one would return and log a budget the thread does not have.
        raise GuardConfigError(
            f"top_up: thread {thread_id!r} has no run going on in this guard, so its budget is in the graph's "
            "state; pass the compiled agent: guard.top_up(config, amount, graph=agent)")
    episode = guard.episodes.get(episode_id, channel)
    top_up_id = f"top-up-{uuid.uuid4().hex[:12]}"
    new_budget = apply_top_up(guard, episode, top_up_id, amount, approved_by=approved_by, reason=reason)
    if graph is not None:
        # The charges as the thread's state shows them are written back with the top-up: on a paused
        # thread, LangGraph's update_state drops the paused step's saved writes (a call that finished
        # in it runs again on resume), and the charge of that finished call was only there.
        written = yield ("update", (cfg, {LEDGER_KEY: channel_base(episode) | {
            "entries": dict((channel or {}).get("entries") or {}),
            "top_ups": {top_up_id: amount}, "top_up_by": {top_up_id: approved_by} if approved_by else {}}}))
        landed = ((written or {}).get("configurable") or {})
        if landed.get("checkpoint_id") and not landed.get("checkpoint_ns"):
            episode.lineage.landed(str(landed["checkpoint_id"]))  # a fork from before it goes without it
    else:
        with episode.lock:
            episode.pending_top_ups[top_up_id] = amount
    return new_budget


@contextlib.contextmanager


def scope(guard: BudgetGuard, config: Mapping[str, Any] | str) -> Iterator[None]:
    """:meth:`BudgetGuard.scope <intent.guard.BudgetGuard.scope>`: sub-agents with ``budget=FromParent(...)``
    started inside carve from this thread's budget; carves still open when the scope ends are closed."""
    cfg = None if isinstance(config, str) else config
    thread_id = thread_id_of(config, "scope")
    # Given the node's config: its state's ledger (the thread's budget, when the episode has ended here);
    # its task, a visitor of the episode while the scope is open (a parallel branch settling leaves its
    # carves alone); the top graph's step, to take up an episode that a sibling branch of the same step
    # ended (not a fresh budget).
    readable, channel = read_ledger_channel(cfg)
    task = str(((cfg or {}).get("configurable") or {}).get("checkpoint_ns") or "")
    episode_id = guard.episode_of(channel, cfg or {"configurable": {"thread_id": thread_id}}) or str(thread_id)
    stamp = branch_stamp(cfg, task) if task else None
    if not readable and episode_id not in guard.episodes and not guard.episodes.can_revive(episode_id, stamp):
        # Neither the thread's state nor a live episode says what the thread has left: a fresh budget
        # here would spend the thread's money twice. (A node whose state has the channel, still empty, is
        # the thread's first spending: the guard's budget.)
        raise GuardConfigError(
            f"guard.scope: thread {thread_id!r} has no run of this guard going in this process, and "
            + ("this node's state has no ledger channel" if cfg is not None and task else
               "a thread id (or a config from outside a graph node) does not say what its budget has left")
            + ": call scope(config) with the config of a graph node whose state carries the guard's channel "
              "(intent_ledger: extend intent.GuardState or intent.BudgetState), or while the run goes on")
    episode = guard.episodes.get(episode_id, channel, stamp=stamp)
    episode.ledger.catch_up(channel)  # kept here from an earlier run while another process spent
    if task:
        episode.visit(task)
    key = f"scope-{uuid.uuid4().hex[:12]}"
    try:
        with spending_scope(guard, episode, key, cfg):
            yield
    finally:
        close_carves(episode, key)
        if task:
            episode.unvisit(task)
        # What the node's state has not seen, in the node's writes (the thread's channel): its sub-agents'
        # carves, a metered model called in the scope, a sibling branch's charges as this process has them
        # (statuses only move forward when the branches' writes meet), a top-up made without a graph.
        update = unseen_by(episode, channel)
        if update is not None:
            if cfg is not None:
                write_ledger_update(cfg, update)
            elif update.get("top_ups"):
                with episode.lock:  # no node to write from: the thread's next step writes them
                    episode.pending_top_ups = update["top_ups"] | episode.pending_top_ups
        # No run of the thread going here: not kept (a later scope or run reads the thread's state).
        guard.episodes.done_visiting(episode, stamp)


def apply_top_up(guard: BudgetGuard, episode: Episode, top_up_id: str, amount: float, *, approved_by: str,
                 reason: str) -> float:
    """Raise the episode's budget once per id, and log it once."""
    ledger = episode.ledger
    with episode.lock:
        known = top_up_id in ledger.top_ups
        new_budget = ledger.top_up(top_up_id, amount, approved_by=approved_by)
    if not known:
        guard.records.top_up(ledger, episode_id=episode.episode_id, top_up_id=top_up_id, amount=amount,
                             reason=reason, approved_by=approved_by)
    return new_budget


def channel_base(episode: Episode) -> dict[str, Any]:
    """The ledger channel's fixed keys for ``episode`` (its id, base budget, overspend flag, sub-caps, carve),
    written with every update that may be a thread's first."""
    ledger = episode.ledger
    base = {"episode_id": episode.episode_id, "budget": ledger.base_budget,
            "allow_overspend": ledger.allow_overspend}
    caps = ledger.caps  # (a copy each time it is read)
    if caps:
        base["caps"] = caps
    if isinstance(ledger, CarvedLedger):
        base["carved_by"] = ledger.carve_id  # the carve holding these charges (CarvedLedger.take_over)
    return base


def unseen_by(episode: Episode, channel: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The channel update with what ``channel`` (a task's state) has not seen: charges it lacks or holds
    at an earlier status, and top-ups made without a graph (taken from the episode: written once).
    ``None`` when there is nothing."""
    known = (channel or {}).get("entries") or {}
    changed = episode.ledger.unseen_in(known)
    top_ups: dict[str, float] = {}
    if episode.pending_top_ups:  # (none, mostly: no lock taken and no dict made on every model step)
        with episode.lock:
            top_ups, episode.pending_top_ups = episode.pending_top_ups, {}
    held_top_ups = episode.ledger.top_ups
    if held_top_ups:
        # A top-up the working copy counts and this state lacks (written to another branch's checkpoint,
        # kept here because this branch also carries what that one's crashed step spent: intent.lineage):
        # written to this branch too, so that its state and the working copy agree on its budget.
        written = (channel or {}).get("top_ups") or {}
        top_ups = {**{k: v for k, v in held_top_ups.items() if k not in written}, **top_ups}
    if not changed and not top_ups:
        return None
    update = channel_base(episode) | {"entries": changed}
    if top_ups:
        by = episode.ledger.approved_by
        update |= {"top_ups": top_ups, "top_up_by": {k: by[k] for k in top_ups if k in by}}
    return update


def check_graph(graph: Any, method: str, needs: tuple[str, ...]) -> None:
    """``graph=`` of :meth:`BudgetGuard.top_up` / ``atop_up``: ``None`` or a compiled graph with ``needs``."""
    if graph is not None and not all(callable(getattr(graph, name, None)) for name in needs):
        raise GuardConfigError(f"{method} graph= must be the compiled agent (with {' and '.join(needs)}), got "
                               f"{type(graph).__name__} {graph!r:.80}; pass graph=agent, or leave it out for a run "
                               "going on in this process")
