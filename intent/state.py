"""The guard's graph-state channel: its name, its typed shape and the state schemas.

The gate writes its reservations *and its decisions* here; the tool step reads them back
from ``request.state`` (as HumanInTheLoopMiddleware passes its edits), so nothing the tool
step needs travels through process memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from langchain_core.messages import AnyMessage
from langgraph.channels.binop import BinaryOperatorAggregate
from langgraph.graph.message import add_messages
from typing_extensions import NotRequired, TypedDict

from intent.errors import GuardConfigError
from intent.ledger import merge_ledger_states

__all__ = ["LEDGER_KEY", "DecisionDict", "EntryDict", "GuardState", "LedgerChannel", "TurnCount", "channel_of",
           "current_config", "read_ledger_channel", "runs_of", "write_ledger_update"]

LEDGER_KEY = "intent_ledger"


class EntryDict(TypedDict):
    """One charge, as :class:`~intent.ledger.LedgerEntry` serialises it."""

    call_id: str  # the ledger key: "<message id>:<tool call id>", "...#n" for the n-th run
    tool: str
    amount: float
    status: str  # reserved -> released | committed
    seq: int
    market_version: int
    tool_call_id: str
    execution: int
    overrun: float
    kind: NotRequired[str]  # tool | model | oracle | sub_agent (absent in states written before v3)
    store_id: NotRequired[str]  # its charge id in a shared budget store, after a reprice


class DecisionDict(TypedDict, total=False):
    """What the gate decided about one proposed call (read by the tool step: whether to run it,
    or the refusal to answer with, and what to log)."""

    accept: bool
    kind: str  # "reject" (oracle or budget) | "invalid" (malformed) | "answered" (by another middleware first)
    tool: str
    args: dict[str, Any]
    price: float
    step: int
    reason: str
    feedback: str
    trace: list[dict[str, Any]]
    decision_ms: float
    usage: dict[str, float]


class TurnCount(TypedDict):
    """The episode's model turns so far (``total``), and the last message the gate decided: the
    first ``count`` turns end with it; its id and its place in the history."""

    total: int
    count: NotRequired[int]
    last_id: NotRequired[str]
    at: NotRequired[int]
    pending: NotRequired[dict[str, int]]  # a reply counted for its step's after_model gate: at, step


class LedgerChannel(TypedDict, total=False):
    episode_id: str
    budget: float  # the base budget; top-ups are added on top
    allow_overspend: bool
    entries: dict[str, EntryDict]
    decisions: dict[str, DecisionDict]
    top_ups: dict[str, float]
    top_up_by: dict[str, str]  # who approved each top-up
    caps: dict[str, float]  # sub-caps of Budget(tools=..., llm=...)
    market_version: int
    market: dict[str, Any]
    market_scope: str
    query: str  # the task of run ``query_run``: its starting human message, fixed at its first step (intent.messages.query_of)
    query_run: int  # the thread's run ``query`` belongs to (absent: 1, a channel written before runs had tasks)
    turns: TurnCount  # how the gate numbers the next model turn (intent.messages.turns_before)
    carved_by: str  # a sub-agent's: the carve (its id in the parent's ledger) holding its charges (intent.nesting)
    runs_started: int  # the thread's runs the guard has started (its turns); runs_of
    runs_ended: int  # ... and ended: a run that starts with the two equal calls the oracle's start again


class LedgerAggregate(BinaryOperatorAggregate):
    """The ledger channel's LangGraph channel: a ``BinaryOperatorAggregate`` with
    :func:`~intent.ledger.merge_ledger_states` (equal to the one LangGraph makes from the reducer
    alone), made cheaper for what LangGraph does with it on every step. (The last merge is reused by
    the identity of the value and the write: a node that edited the channel's value in place, which
    LangGraph's state contract forbids, could be given the merge of the unedited one.)

    LangGraph copies every channel of the graph for each conditional edge's fresh read of state
    (twice per tool call in ``create_agent``) and applies the step's write to the copy; at the
    step's end it applies the same write to the channel itself. So:

    * a copy skips ``__init__``, which for this annotation (a union, not instantiable) raises and
      catches a ``TypeError`` on every copy;
    * the channel and its copies remember the last single write they applied, with the value it
      was applied to and the result; the same write applied to the same value (the same objects)
      takes that result instead of merging again. The merge is a function of its two inputs, so
      the result is the one a second merge would make.

    Named in the annotation after the reducer (``Annotated[..., reducer, LedgerAggregate]``),
    which LangGraph picks before the reducer.
    """

    __slots__ = ("_last",)

    def __init__(self, typ: Any, operator: Any = merge_ledger_states) -> None:
        super().__init__(typ, operator)
        # (value, write, result) of the last single write, shared with the copies; replaced whole, never
        # changed in place (a copy may be updated in another thread).
        self._last: list[tuple[Any, Any, Any] | None] = [None]

    def copy(self) -> LedgerAggregate:
        new = object.__new__(type(self))
        new.typ, new.key, new.operator, new.value, new._last = self.typ, self.key, self.operator, self.value, self._last
        return new

    def update(self, values: Sequence[Any]) -> bool:
        if len(values) != 1:
            if not values:  # (LangGraph's fresh read updates every channel, most with no write: no call for it)
                return False
            return _aggregate_update(self, values)
        before, write = self.value, values[0]
        last = self._last[0]
        if last is not None and last[0] is before and last[1] is write:
            self.value = last[2]
            return True
        if (_OVERWRITE is not None and type(write) is dict and _OVERWRITE not in write and "type" not in write
                and before is not _MISSING):
            # What BinaryOperatorAggregate.update does with one write that is not an Overwrite in any of its forms
            # (langgraph.channels.binop._get_overwrite: an Overwrite, {OVERWRITE: v}, {"type": OVERWRITE, "value": v})
            # to a channel with a value: the merge, without the generic loop and its per-write checks.
            self.value = self.operator(before, write)
        else:
            _aggregate_update(self, values)
        self._last[0] = (before, write, self.value)
        return True


_aggregate_update = BinaryOperatorAggregate.update
try:  # LangGraph's private markers, for LedgerAggregate.update's direct merge
    from langgraph._internal._constants import OVERWRITE as _OVERWRITE
    from langgraph._internal._typing import MISSING as _MISSING
except ImportError:  # another LangGraph layout: every write goes through BinaryOperatorAggregate.update
    _OVERWRITE = _MISSING = None


class GuardState(TypedDict):
    """Graph state for hand-built graphs: messages plus the guard's ledger channel.

    Extend it like ``MessagesState``: ``class MyState(GuardState): ...``.
    """

    messages: Annotated[list[AnyMessage], add_messages]
    intent_ledger: NotRequired[Annotated[LedgerChannel | None, merge_ledger_states, LedgerAggregate]]


_get_config: Any = None  # langgraph.config.get_config, imported on first use (import intent stays light)


def current_config() -> dict[str, Any] | None:
    """The running graph step's config (thread id...), or ``None`` outside a runnable context."""
    global _get_config
    if _get_config is None:
        from langgraph.config import get_config

        _get_config = get_config
    try:
        return _get_config()
    except RuntimeError:
        return None


def branch_of(config: Mapping[str, Any] | None) -> str:
    """The part of a graph run a step belongs to: its checkpoint namespace without the step's own
    node (``"sub:<task>"`` for a step of a subgraph run as the parent's node ``sub``; ``""`` at the
    top). Parallel branches of one thread (a ``Send`` fan-out of the guarded agent) differ in it."""
    ns = str(((config or {}).get("configurable") or {}).get("checkpoint_ns") or "")
    return ns.rsplit("|", 1)[0] if "|" in ns else ""


def task_of(config: Mapping[str, Any] | None) -> str:
    """The graph task a step runs in: its whole checkpoint namespace (``"helper:<task>"`` for a node
    at the top, ``"sub:<task>|model:<task>"`` inside a subgraph; ``""`` outside a graph). A reservation
    is tagged with it (:attr:`intent.ledger.BudgetLedger.owner`): it lies inside its branch
    (:func:`branch_of`) and names a node run beside the agent (a ``Send`` to a plain node) too."""
    return str(((config or {}).get("configurable") or {}).get("checkpoint_ns") or "")


def task_free_ns(ns: str) -> str:
    """A checkpoint namespace without its task ids (``"sub|tools"`` for ``"sub:<task>|tools:<task>"``), as
    LangGraph names a graph a ``Command`` is for once it is sent to a parent (``recast_checkpoint_ns``)."""
    return "|".join(part.split(":")[0] for part in ns.split("|") if not part.isdigit())


def current_task() -> str:
    """:func:`task_of` the running graph step (``""`` outside a graph)."""
    return task_of(current_config())


def current_branch() -> str:
    """:func:`branch_of` the running graph step (``""`` outside a graph)."""
    return branch_of(current_config())


def branch_stamp(config: Mapping[str, Any] | None, branch: str) -> str | None:
    """The checkpoint of the top graph's step that ``branch`` runs in (from the step's
    ``checkpoint_map``): the same for sibling branches of one ``Send`` fan-out at any depth, another
    one once the top graph has moved on (a new turn; a paused step that was abandoned). ``None`` at
    the top of the graph."""
    if not branch:
        return None
    stamps = ((config or {}).get("configurable") or {}).get("checkpoint_map") or {}
    stamp = stamps.get("") if isinstance(stamps, Mapping) else None
    return str(stamp) if stamp is not None else None


def read_ledger_channel(config: Mapping[str, Any] | None) -> tuple[bool, LedgerChannel | None]:
    """The ledger channel as the running graph task reads it, from anywhere inside the task (a
    callback of a model another middleware calls has no ``state`` argument to read it from).

    Returns ``(readable, channel)``: ``(False, None)`` outside a LangGraph task or in a graph whose
    state has no ledger channel (one without the guard), ``(True, None)`` when the state has no
    ledger yet. This uses LangGraph's task-local reader
    (``config["configurable"]["__pregel_read"]``, what LangGraph's own ToolNode reads state
    with): not a public API, so a LangGraph that drops it makes this ``(False, None)`` and the
    caller falls back to what it can see without state.
    """
    readable, value = _read_channel(config, LEDGER_KEY)
    return readable, (value if isinstance(value, Mapping) and value else None)


def read_state_messages(config: Mapping[str, Any] | None) -> list[AnyMessage] | None:
    """The running graph task's ``messages``, as :func:`read_ledger_channel` reads the ledger (``None``
    outside a task or without such a channel): for code inside the task that sees other messages (a
    model another middleware calls sees its own prompt)."""
    readable, value = _read_channel(config, "messages")
    return list(value) if readable and isinstance(value, list) else None


def _read_channel(config: Mapping[str, Any] | None, key: str) -> tuple[bool, Any]:
    read = ((config or {}).get("configurable") or {}).get(_CONFIG_KEY_READ)
    if not callable(read):
        return False, None
    try:
        return True, read(key, False)  # fresh=False: the task's input, what every hook of the step sees
    except KeyError:  # the graph has no such channel: its state schema is not the guard's
        return False, None


def write_ledger_update(config: Mapping[str, Any] | None, update: Mapping[str, Any]) -> bool:
    """Add a ledger update to the running graph task's writes (merged by the channel's reducer when
    the task completes), from anywhere inside the task: LangGraph's task-local writer, the one its
    ``push_message`` uses (``config["configurable"]["__pregel_send"]``). ``False`` when there is
    none (outside a task, or a LangGraph without it): the guard's next hook writes it then."""
    send = ((config or {}).get("configurable") or {}).get(_CONFIG_KEY_SEND)
    if not callable(send):
        return False
    send([(LEDGER_KEY, dict(update))])
    return True


_CONFIG_KEY_READ = "__pregel_read"  # langgraph._internal._constants.CONFIG_KEY_READ
_CONFIG_KEY_SEND = "__pregel_send"  # langgraph._internal._constants.CONFIG_KEY_SEND


def runs_of(channel: Mapping[str, Any] | None) -> tuple[int, int]:
    """How many runs of the thread the guard started and ended (``runs_started``, ``runs_ended``).
    A channel written before these were kept counts as one run started and none ended: a run
    resumed from it goes on without starting the oracle again, as it did then."""
    if not channel:
        return 0, 0
    return channel.get("runs_started", 1), channel.get("runs_ended", 0)


def run_of(channel: Mapping[str, Any] | None) -> tuple[int, bool]:
    """Which run of the thread a step with this state belongs to, and whether it is a new one: the next
    run when the last one ended (a new thread, the user's next turn), else the one under way (a run
    resumed after an interrupt or a crash, maybe in another process: never started again)."""
    started, ended = runs_of(channel)
    new_run = not channel or ended >= started
    return (ended + 1 if new_run else max(started, 1)), new_run


def channel_of(state: Any) -> LedgerChannel | None:
    """The ledger channel of a state (a dict, or an object with the attribute)."""
    # ``type(...) is dict`` first: graph state is a plain dict, and an ABC isinstance check runs
    # Python code (ABCMeta.__instancecheck__) on every call.
    if type(state) is dict or isinstance(state, Mapping):
        return state.get(LEDGER_KEY)
    return getattr(state, LEDGER_KEY, None)


def missing_channel_error() -> GuardConfigError:
    """A graph whose state schema lacks the ledger channel (LangGraph drops the keys a schema lacks)."""
    return GuardConfigError(
        f"the graph's state has no {LEDGER_KEY!r} channel, so the gate's decisions cannot reach the tools: build "
        "the graph on intent.GuardState (StateGraph(GuardState)), or add the channel to your state schema "
        "(class State(MessagesState, GuardState))")
