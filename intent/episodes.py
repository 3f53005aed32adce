"""Per-episode state kept in process: the live ledger, the episode's market, run counters.

Graph state is the truth (the ledger channel); this is the working copy that parallel tool
calls of one episode share, so that they see each other's reservations before their state
updates merge. It is rebuilt from state when missing (a resume in another process) and
dropped when the episode ends, so memory stays flat however many episodes a guard serves.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any


from intent.ledger import BudgetLedger
from intent.lineage import Lineage
from intent.market import Market
from intent.messages import query_of, query_run, tool_name
from intent.nesting import CarvedLedger, current_parent
from intent.state import current_task, run_of

__all__ = ["RUNNING_EPISODE", "Episode", "EpisodeRegistry"]

# (guard, episode id) of the guard's model step running in this context, for code inside it that
# has no state to read the episode from: a model that a middleware listed after the guard calls
# (intent.metered_models) on a run's first step, when state does not name the episode yet (a tool
# step always follows a model step, so its state does). Set by the step, reset when it returns.
RUNNING_EPISODE: ContextVar[tuple[Any, str] | None] = ContextVar("intent_running_episode", default=None)


@dataclass
class Episode:
    episode_id: str
    ledger: BudgetLedger
    # The episode id the state's ledger channel carries when it is not ``episode_id``: a thread made by copying
    # another thread's state keeps the source's (intent.guard.BudgetGuard.episode_of). A sub-agent given a copy
    # of this episode's state is told by it (BudgetGuard.inherits_parent_ledger).
    source: str = ""
    market: Market | None = None  # an episode-scoped market (CostBench events); None: the guard's
    started: bool = False
    # The run of the thread this episode is (1 for a thread's first run; a later turn on the same thread
    # is the next): written to state as ``runs_started`` at its first step and ``runs_ended`` when it
    # ends, so that the next run, maybe in another process, calls the oracle's start again (0: not known
    # yet).
    run: int = 0
    # A bug an oracle hook raised at a tool step (observe, result_note, the re-gate of an edited call), kept to
    # be raised at the episode's next model step or its end: raised inside the tool's run, a retry middleware
    # would take it for the tool's failure and run (and pay) the tool again.
    oracle_bug: BaseException | None = None
    # The id of the human message that started the episode's current run (when it had one): a new message
    # after a run whose first step's writes were lost starts the next run (intent.lifecycle.start).
    run_input: str | None = None
    run_checkpoint: str | None = None  # the checkpoint that run's first step ran from
    # Top-ups asked for without a graph: written to state at the episode's next hook.
    pending_top_ups: dict[str, float] = field(default_factory=dict)
    # Set when the episode may make no further model call (a response without usage under
    # missing_usage="refuse"); the reason is the refusal's text.
    stopped_reason: str = ""
    # Open carves for sub-agents (intent.nesting), by carve id: the child's ledger.
    carves: dict[str, Any] = field(default_factory=dict)
    # Calls of a message rebuilt outside the guard, by (message id, call id): the gated call's key
    # each one took over (intent.metering), so that an outer retry of the same call finds it again.
    rebuilt: dict[tuple[str, str], str] = field(default_factory=dict)
    # Calls whose one log record is written outside a gate decision in state, by (reason, call key): refused at
    # the tool step as never gated (intent.metering), so a re-run of the step (a resume after an interrupt in a
    # sibling call of the same task) does not write it again; answered by another middleware before any gate
    # saw them (intent.lifecycle.log_answered_before_gate), so a step whose update was lost (a model
    # call that raised, retried or invoked again) does not either.
    logged_once: set[tuple[str, str]] = field(default_factory=set)
    # The gate's decisions, by call key, as written to state: a gate run again on the same message because its
    # step's update was lost (cancelled or crashed after the gate) writes them again (intent.gate).
    decided: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The calls guard.route last sent to the tool node, by the id of their message: what a tool node not made by
    # the guard answered is told by them (intent.lifecycle.check_tool_runner, which drops the message's entry).
    routed: dict[str, frozenset[str]] = field(default_factory=dict)
    # The tools the model was offered at its last call (the request's list, as given): a call to
    # one the market does not price is refused as unpriced, not as a tool that does not exist.
    offered: Any = None
    # The names of ``offered``, read once per request list: (the list they were read from, the names).
    _offered_names: tuple[Any, frozenset[str]] = (None, frozenset())
    # The parts of graph runs (intent.state.branch_of) running this episode now, with the parent step
    # that started each (intent.state.branch_stamp): one, unless the guarded agent runs as parallel
    # branches of one thread (a Send fan-out of it as a subgraph). A branch leaves its running siblings'
    # reservations alone, and the episode ends when the last one finishes. A branch of an earlier parent
    # step (paused and abandoned, or crashed) is not running: the next branch's step forgets it.
    branches: dict[str, str | None] = field(default_factory=dict)
    revived: bool = False  # brought back for a late fan-out branch (EpisodeRegistry.revive): started again
    # Graph tasks spending from the episode outside its model steps (a node's guard.scope around sub-agents,
    # a metered model's execution), by checkpoint namespace (intent.state.task_of), with how many of those each
    # has open: a branch settling leaves what they hold,
    # as it leaves a running sibling branch's. They do not keep the episode from ending.
    visitors: dict[str, int] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    start_lock: threading.RLock = field(default_factory=threading.RLock)  # held while the oracle's start runs
    # Whether graph state was merged in. After that the working copy is ahead of state by
    # construction (every money move of the episode goes through it), so it is merged once.
    synced: bool = False
    # The checkpoints this process's steps of the episode ran from, to tell a resume of the same branch
    # from a fork or a replay of an older checkpoint (intent.lineage).
    lineage: Lineage = field(default_factory=Lineage)

    def visit(self, task: str) -> None:
        """``task`` (a checkpoint namespace) spends from the episode outside its model steps until
        :meth:`unvisit`: a metered model's execution, a node's ``guard.scope``. Its reservations are
        tagged with the task that made them (as a joined branch's are), so that no branch settling releases them."""
        with self.lock:
            self.visitors[task] = self.visitors.get(task, 0) + 1
            if self.ledger.owner is None:
                self.ledger.owner = current_task

    def unvisit(self, task: str) -> None:
        with self.lock:
            left = self.visitors.get(task, 0) - 1
            if left > 0:
                self.visitors[task] = left
            else:
                self.visitors.pop(task, None)

    def task(self, channel: Mapping[str, Any] | None, messages: Any) -> str:
        """The task of the run under way (intent.messages.query_of): what the step's state kept for it, else
        the last human message of ``messages`` (the state's: read from the step's own state, since parallel
        fan-out branches of one episode each have a task of their own)."""
        return query_of(channel, messages, self.run or run_of(channel)[0])

    def query_update(self, channel: Mapping[str, Any] | None, messages: Any) -> dict[str, Any]:
        """The channel fields that keep the run's task in state, when ``channel`` does not have them yet."""
        run = self.run or run_of(channel)[0]
        if query_run(channel) == run:
            return {}
        return {"query": query_of(channel, messages, run), "query_run": run}

    def first_record(self, reason: str, key: str) -> bool:
        """Whether the call ``key``'s record for ``reason`` is to be written here (not written before)."""
        with self.lock:
            if (reason, key) in self.logged_once:
                return False
            self.logged_once.add((reason, key))
            return True

    def offered_names(self) -> frozenset[str] | None:
        """The names of the tools the model was offered at its last call; ``None`` when the guard
        has not seen a model request (a hand-built graph)."""
        tools = self.offered
        if tools is None:
            return None
        seen, names = self._offered_names
        if seen is not tools:  # the gate asks once per call: a new request list is read once
            names = frozenset(n for n in map(tool_name, tools) if n)
            self._offered_names = (tools, names)
        return names


class EpisodeRegistry:
    """Episodes by id, least recently used dropped beyond ``max_episodes``."""

    def __init__(self, default_budget: Any, *, allow_overspend: bool, max_episodes: int = 1024,
                 new_ledger: Callable[[str], BudgetLedger] | None = None,
                 on_new: Callable[[BudgetLedger, str], None] | None = None, carves: bool = False) -> None:
        self._on_new = on_new  # e.g. attach the shared budget store to every episode's ledger
        # A sub-agent's guard (FromParent): inside a parent's tool call an episode always draws its
        # ledger as a carve from that call, even when its state already has one (a child started again,
        # or resumed), and the carve takes over what it should of that state (CarvedLedger.take_over).
        self._carves = carves
        self.default_budget = default_budget  # a float or an intent.Budget
        self._new_ledger = new_ledger or (lambda _id: BudgetLedger(default_budget, allow_overspend=allow_overspend))
        self.allow_overspend = allow_overspend
        self.max_episodes = max_episodes
        self._episodes: OrderedDict[str, Episode] = OrderedDict()
        # Episodes that ended in a branch of a Send fan-out, by id: (the parent step's stamp, the episode).
        self._ended: OrderedDict[str, tuple[str, Episode]] = OrderedDict()
        # Charges that reached an episode after it ended here (a cancelled sync tool's late bill), by episode
        # id: taken into the episode when the thread's next run makes it again (see :meth:`post_late`).
        self._late: OrderedDict[str, dict[str, Any]] = OrderedDict()
        # The last ledger of episodes that ended as a subgraph's run, by episode id: (the top graph's step it
        # ran in, the ledger's state). The subgraph's result reaches the thread's state only as the parent
        # step's write, which LangGraph drops when that step never completes (a sync stream closed by its
        # reader: the node's thread runs the agent to its end regardless) and the thread then gets new input.
        # The thread's next run here takes it back when the lineage shows just that (see
        # intent.lifecycle.take_back_dropped_run): otherwise its spending was forgotten and it ran on a fresh budget.
        self._tails: OrderedDict[str, tuple[str, dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._episodes)

    def __contains__(self, episode_id: object) -> bool:
        return episode_id in self._episodes

    def ids(self) -> list[str]:
        """The ids of the episodes live here (a run of their thread going on, or a market set for them), least
        recently used first."""
        return list(self._episodes)

    def peek(self, episode_id: str) -> Episode | None:
        # One read of the (C) OrderedDict, atomic under the GIL like __contains__ above: no lock taken
        # (the market is looked up this way three times per tool call).
        return self._episodes.get(episode_id)

    def get(self, episode_id: str, channel: Mapping[str, Any] | None = None, *, branch: str | None = None,
            stamp: str | None = None) -> Episode:
        """The episode, created (from ``channel`` when given) or brought up to date with it.

        Entries only move forward, so a stale ``channel`` never undoes a charge; the budget
        in state wins over this guard's default (a resumed thread keeps its own budget).
        State is merged the first time an episode sees it (an episode made before its state
        existed, by a market update, say); later calls skip the merge.
        """
        with self._lock:
            episode = self._episodes.get(episode_id)
            carve = self._carves and current_parent() is not None
            if episode is None and stamp is not None:
                episode = self._revive(episode_id, stamp)
            if episode is None:
                ledger = (BudgetLedger.from_state(channel) if channel and "budget" in channel and not carve
                          else self._new_ledger(episode_id))
                if self._on_new is not None:
                    self._on_new(ledger, episode_id)
                if carve and channel and isinstance(ledger, CarvedLedger):
                    ledger.take_over(channel)  # started again: see CarvedLedger.take_over
                episode = Episode(episode_id, ledger, synced=bool(channel))
                if channel:
                    _note_source(episode, channel)
                self._episodes[episode_id] = episode
                while len(self._episodes) > self.max_episodes:
                    self._episodes.popitem(last=False)
            else:
                self._episodes.move_to_end(episode_id)
                old = episode.ledger
                if carve and isinstance(old, CarvedLedger) and old.closed:
                    # Still here from a call that has ended (it paused inside, then a later call resumed
                    # it): a new carve from the running call, with the reservations still held.
                    ledger = self._new_ledger(episode_id)
                    if self._on_new is not None:
                        self._on_new(ledger, episode_id)
                    if isinstance(ledger, CarvedLedger):
                        ledger.take_over({"carved_by": old.carve_id, "entries": {
                            e.call_id: e.to_dict() for e in old.entries()}})
                    episode.ledger = ledger
            if branch is not None:  # a model step of the episode: its branch joins (see Episode.branches)
                for other, other_stamp in list(episode.branches.items()):
                    if other_stamp != stamp:
                        del episode.branches[other]  # of an earlier top-level step: abandoned, or crashed
                episode.branches[branch] = stamp
                if branch and episode.ledger.owner is None:
                    # A subgraph's episode (maybe a fan-out branch): reservations say which branch made them,
                    # for the guard's settling; set before this branch reserves anything. An agent at the top
                    # of its graph has no siblings and skips this on every call.
                    episode.ledger.owner = current_task
        if channel and not episode.synced:
            episode.ledger.absorb(channel)
            episode.synced = True
            _note_source(episode, channel)  # (made before its first step: a market set for it with create=True)
        if self._late:
            with self._lock:
                late = self._late.pop(episode_id, None) if self._episodes.get(episode_id) is episode else None
            if late:
                episode.ledger.absorb({"entries": late})  # entries only move forward: a copy already in state is a no-op
        return episode

    def reload(self, episode_id: str, channel: Mapping[str, Any], **get: Any) -> Episode:
        """The episode made again from ``channel`` alone, as a guard in another process makes it: a fork or
        replay of the thread runs on its checkpoint's ledger, not on the working copy of the branch it left
        (:mod:`intent.lineage`). What this process knows of the thread beyond state is kept: top-ups asked
        for without a graph, an episode-scoped market. ``get``: :meth:`get`'s keywords (the step's branch)."""
        with self._lock:
            old = self._episodes.pop(episode_id, None)
        episode = self.get(episode_id, channel, **get)
        if old is not None:
            with old.lock:
                pending, market, by = dict(old.pending_top_ups), old.market, old.ledger.approved_by
            for top_up_id, amount in pending.items():
                episode.ledger.top_up(top_up_id, amount, approved_by=by.get(top_up_id, ""))
            episode.pending_top_ups.update(pending)
            episode.market = market
        return episode

    def can_revive(self, episode_id: str, stamp: str | None) -> bool:
        """Whether :meth:`get` with ``stamp`` would take up an episode a sibling branch ended."""
        with self._lock:
            ended = self._ended.get(episode_id)
            return stamp is not None and ended is not None and ended[0] == stamp

    def post_late(self, episode: Episode, entry: Any) -> None:
        """A charge made after the run that owed it may have ended (a cancelled sync tool's thread billing
        above its quote): kept for the thread's next run in this process, which writes it to state, in case
        the episode has ended or ends before its next settle."""
        with self._lock:
            self._late.setdefault(episode.episode_id, {})[entry.call_id] = entry.to_dict()
            self._late.move_to_end(episode.episode_id)
            while len(self._late) > self.max_episodes:
                self._late.popitem(last=False)

    def keep_tail(self, episode_id: str, stamp: str, ledger_state: dict[str, Any]) -> None:
        """An episode that ended in a subgraph run in the top graph's step ``stamp``: its ledger, kept for
        the thread's next run in this process in case the parent step's write of it is dropped."""
        with self._lock:
            self._tails[episode_id] = (stamp, ledger_state)
            self._tails.move_to_end(episode_id)
            while len(self._tails) > self.max_episodes:
                self._tails.popitem(last=False)

    def take_tail(self, episode_id: str) -> tuple[str, dict[str, Any]] | None:
        """What :meth:`keep_tail` kept for ``episode_id``, removed; ``None`` when nothing was (no lock
        taken when nothing is kept for any episode: the common case, on every model step)."""
        if not self._tails:
            return None
        with self._lock:
            return self._tails.pop(episode_id, None)

    def leave(self, episode: Episode, branch: str, *, keep: bool = True) -> bool:
        """``branch`` has finished the episode. Returns whether it was the last one, and if so ends the
        episode (in the same step, so no branch joins an episode that is ending): one that ended in a
        fan-out branch is kept aside for a sibling of the same top-level step that starts later."""
        with self._lock:
            stamp = episode.branches.pop(branch, None)
            if episode.branches:
                return False
            if self._episodes.get(episode.episode_id) is episode:
                del self._episodes[episode.episode_id]
            if stamp is not None and keep:
                self._ended[episode.episode_id] = (stamp, episode)
                while len(self._ended) > self.max_episodes:
                    self._ended.popitem(last=False)
            return True

    def done_visiting(self, episode: Episode, stamp: str | None) -> None:
        """A visitor that took up ``episode`` outside the guard's steps (``guard.scope``) has finished. With
        no branch running it and no other visitor, the episode is not kept here: a later run reads its
        spending from graph state (a copy kept here would go stale while another process spends). One
        taken up in a fan-out step (``stamp``) is kept aside again for a sibling of that step. One with a
        market of its own (``update_episode_market``) or top-ups not in state yet is kept."""
        with self._lock:  # (not the episode's lock: code holding it may ask the registry for episodes)
            if (episode.branches or episode.visitors or episode.market is not None or episode.pending_top_ups
                    or self._episodes.get(episode.episode_id) is not episode):
                return  # still running, or holding what only this process knows (a market set for the episode)
            del self._episodes[episode.episode_id]
            if stamp is not None:
                self._ended[episode.episode_id] = (stamp, episode)
                while len(self._ended) > self.max_episodes:
                    self._ended.popitem(last=False)

    def _revive(self, episode_id: str, stamp: str | None) -> Episode | None:
        """The episode a sibling branch of the same top-level step ended (:meth:`leave`), back in the
        registry: a branch that starts after its siblings finished spends from their budget, not a new one.
        Called with the lock held."""
        ended = self._ended.get(episode_id) if stamp is not None else None
        if ended is None or ended[0] != stamp:
            return None
        del self._ended[episode_id]
        episode = self._episodes[episode_id] = ended[1]
        episode.revived = True
        return episode


def _note_source(episode: Episode, channel: Mapping[str, Any]) -> None:
    """A copied thread's channel names its source's episode (intent.guard.BudgetGuard.episode_of): kept, read
    from the first channel the episode sees."""
    named = channel.get("episode_id")
    if named and named != episode.episode_id:
        episode.source = str(named)
