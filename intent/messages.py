"""Message helpers: reading the agent's history and shaping the guard's answers.

Nothing here knows money. The guard facade, the gate and the metered execution use these
to find which proposed call a request belongs to and to build the messages they return.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, ToolMessage, convert_to_messages
from langgraph.types import Command
from pydantic import ValidationError

from intent.errors import InvalidBillError
from intent.market import check_amount

__all__ = [
    "BILLED_KEY",
    "ToolSchema",
    "answered_after",
    "argument_problem",
    "billed_amount",
    "call_key",
    "call_signature",
    "checked_bill",
    "find_call",
    "last_human_text",
    "json_artifact",
    "last_ai",
    "merge_identical",
    "messages_of",
    "query_of",
    "query_run",
    "model_args",
    "tool_schema",
    "raised_bill",
    "is_result_list",
    "result_message",
    "text_of",
    "tool_name",
    "provider_run",
    "turns_before",
    "with_update",
]

# A tool reports what its provider actually billed in its ToolMessage artifact under this key
# (0 for a failed call the provider does not bill). Without it the quoted price is charged.
BILLED_KEY = "intent_billed"


def text_of(message: Any) -> str:
    content = getattr(message, "content", message)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in content)
    return str(content)


def tool_name(tool: Any) -> str | None:
    """A tool's name: a tool object's ``name``, or a dict schema's (at the top, or under
    ``"function"`` in OpenAI's form); ``None`` for a dict without one (a provider's built-in tool)."""
    if isinstance(tool, dict):
        return tool.get("name") or (tool.get("function") or {}).get("name")
    return getattr(tool, "name", None)


def provider_run(tool: Any) -> bool:
    """Whether ``tool`` is a provider's server-side tool: a dict whose ``type`` is neither absent nor
    ``"function"`` and which has no ``input_schema`` (OpenAI's ``{"type": "web_search"}`` and
    ``{"type": "tool_search"}``, Anthropic's ``{"type": "web_search_20250305", "name": "web_search"}``).
    The provider runs it inside the model call: no tool call for it reaches the tool step, so the
    gate never prices it, and hiding priced tools must leave it bound."""
    return isinstance(tool, dict) and tool.get("type") not in (None, "function") and "input_schema" not in tool


def last_human_text(messages: Sequence[AnyMessage]) -> str:
    for m in reversed(messages):
        if isinstance(m, HumanMessage):
            return text_of(m)
    return ""


def query_run(channel: Mapping[str, Any] | None) -> int | None:
    """The run of the thread whose task the ledger channel keeps (``None``: none kept). A channel
    written before runs had tasks of their own kept its first run's."""
    if not channel or not isinstance(channel.get("query"), str):
        return None
    return int(channel.get("query_run") or 1)


def query_of(channel: Mapping[str, Any] | None, messages: Sequence[AnyMessage], run: int) -> str:
    """The task of the thread's run ``run`` (1: its first; each later turn on the thread is the next run):
    what graph state's ledger channel kept for that run, else the last human message of ``messages`` (at
    a run's first step, the message the user started the run with). Each run's task is fixed at its first
    step and kept in state: a summariser that later replaces the history does not change it, and the
    user's next turn on the thread is a task of its own."""
    if query_run(channel) == run:
        return channel["query"]  # type: ignore[index]
    return last_human_text(messages)


def last_ai(messages: Sequence[AnyMessage]) -> tuple[int, AIMessage | None]:
    for i in range(len(messages) - 1, -1, -1):
        if isinstance(messages[i], AIMessage):
            return i, messages[i]  # type: ignore[return-value]
    return -1, None


def turns_before(messages: Sequence[AnyMessage], index: int, counted: Mapping[str, Any] | None = None, *,
                 gate: bool = False) -> int:
    """The model turn of the message at ``index`` (the ``step`` of log records and of the oracle's
    context): how many model turns the episode had before it.

    ``counted`` is what the guard wrote last: ``total``, the turns counted so far (every reply is
    counted as it is made: by the gate, or by the middleware's model step for a reply without
    calls), the last message counted: the episode's first ``count`` turns end with the AIMessage
    ``last_id``, at ``at`` in the history, and ``pending``: the reply a model step counted for its
    own after_model gate (its place and number). Turns are numbered on from the last message counted
    when it is in the history (a message added without the guard seeing it still gets a number of
    its own), and never below ``total``, so a history another middleware rewrote
    (SummarizationMiddleware replaces old turns with a summary) or a message a middleware rebuilt
    with another id never numbers a turn twice. ``gate``: the caller is a gate, the only reader of
    ``pending`` (a model step reads a ``pending`` left by an earlier step, whose gate never ran
    because another middleware ended the run first, as a turn already counted in ``total``).
    """
    counted = counted or {}
    total = int(counted.get("total") or 0)
    last_id = counted.get("last_id")
    before = None
    pending = counted.get("pending") if gate else None  # a model step's own count is never pending
    if pending and pending.get("at") == index and index < len(messages):
        # The reply its model step counted and left for this step's after_model gate, which sees
        # it where it was made (rebuilt with another id by a middleware outside, perhaps).
        return int(pending["step"])
    if last_id:
        if index < len(messages) and getattr(messages[index], "id", None) == last_id:
            return int(counted["count"]) - 1  # that message itself, gated again (a resumed gate)
        for j in range(min(index, len(messages)) - 1, -1, -1):
            m = messages[j]
            if isinstance(m, AIMessage) and m.id == last_id:
                later = 0  # AIMessages between it and this one (a loop, not sum(<genexpr>): mostly none)
                for x in messages[j + 1:index]:
                    if isinstance(x, AIMessage):
                        later += 1
                return max(total, int(counted["count"]) + later)
        if "total" not in counted:  # written before totals were kept: count on from it, with a gap
            before = int(counted["count"])
    # Not in the history (removed by a summariser, rebuilt outside the guard): the AIMessages left
    # before ``index`` were counted as they were made, so the next number is the total.
    return max(total, (before or 0) + sum(1 for m in messages[:index] if isinstance(m, AIMessage)))


def messages_of(state: Any) -> Sequence[AnyMessage]:
    """The messages of a state (a dict, or an object with the attribute); empty when none."""
    if type(state) is dict or isinstance(state, Mapping):  # a plain dict skips the ABC check
        return state.get("messages") or []
    return getattr(state, "messages", None) or []


def answered_after(messages: Sequence[AnyMessage], index: int) -> set[str]:
    """Tool-call ids answered by a ToolMessage after the message at ``index`` (LangChain's own rule)."""
    answered = set()
    for m in messages[index + 1:]:  # (a loop, not a set comprehension: no function made per gate; mostly none)
        if isinstance(m, ToolMessage):
            answered.add(m.tool_call_id)
    return answered


def call_key(ai: AIMessage, index: int, tool_call_id: str) -> str:
    """The ledger key of one proposed call: the proposing message and the call's id.

    A model may reuse an id in a later message; that is a new call with a new key. An
    AIMessage without an id (hand-driven histories) is named by its position.
    """
    return f"{ai.id if ai.id else f'm{index}'}:{tool_call_id}"


def call_signature(name: str, args: Any) -> str | None:
    """What makes two proposed calls identical: the tool and its arguments (key order ignored).
    ``None`` for arguments that do not serialise: such calls are never treated as identical.
    The guard merges identical calls of one message with it, and rollouts simulate them the same way."""
    try:
        return name + "\x00" + json.dumps(args or {}, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return None


def merge_identical(calls: Sequence[Mapping[str, Any]], keep: Callable[[Mapping[str, Any]], bool] = lambda c: False
                    ) -> tuple[list[Any], dict[Any, Any]]:
    """``calls`` with later copies of an identical call (:func:`call_signature`) left out, and
    ``{dropped id: kept id}``. A call ``keep`` says to keep, or one whose arguments do not
    serialise, is never merged. The guard's rule for one message, and the rollouts' for a turn."""
    first: dict[str, Any] = {}
    kept: list[Any] = []
    merged: dict[Any, Any] = {}
    for call in calls:
        sig = None if keep(call) else call_signature(call["name"], call.get("args"))
        if sig is None:
            kept.append(call)
        elif sig in first:
            merged[call.get("id")] = first[sig]
        else:
            first[sig] = call.get("id")
            kept.append(call)
    return kept, merged


def find_call(messages: Sequence[AnyMessage], tool_call_id: str) -> tuple[int, AIMessage | None]:
    """The latest AIMessage that proposed ``tool_call_id`` (the one whose call is running)."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if isinstance(m, AIMessage):
            for c in m.tool_calls:  # (a loop, not any(<genexpr>): no generator made on every tool call)
                if c.get("id") == tool_call_id:
                    return i, m
    return -1, None


class ToolSchema(NamedTuple):
    """What the guard checks a tool's arguments against, read once per tool."""

    schema: Any  # ``tool_call_schema``: what the model sees
    fields: frozenset[str] | None  # its field names (``None``: a JSON-schema dict tool)
    injected: frozenset[str]  # arguments LangGraph fills in (ToolRuntime, InjectedState...), never the model's
    full: Any  # ``args_schema`` when it has validators of its own (``tool_call_schema`` drops them), else None


# id(tool) -> (weak reference, its ToolSchema): LangChain rebuilds nothing here, but reading the
# properties costs more than the check they feed on every run.
_SCHEMAS: dict[int, tuple[weakref.ref[Any], ToolSchema]] = {}


def _validates_more(schema: Any) -> bool:
    """Whether a tool's ``args_schema`` rejects input its ``tool_call_schema`` (the schema the model sees,
    which LangChain derives without them) accepts: validators of its own, ``extra="forbid"``,
    ``strict=True``, or fields the tool reads under another name (an alias)."""
    decorators = getattr(schema, "__pydantic_decorators__", None)
    if decorators is not None and (decorators.field_validators or decorators.model_validators):
        return True
    config = getattr(schema, "model_config", None) or {}
    if config.get("extra") == "forbid" or config.get("strict"):
        return True
    return any(f.alias not in (None, name) or f.validation_alias not in (None, name)
               or any(getattr(m, "strict", False) for m in f.metadata)  # Field(strict=True)
               for name, f in (getattr(schema, "model_fields", None) or {}).items())


def tool_schema(tool: Any) -> ToolSchema:
    """The tool's :class:`ToolSchema`, cached per tool."""
    hit = _SCHEMAS.get(id(tool))
    if hit is not None and hit[0]() is tool:
        return hit[1]
    schema = getattr(tool, "tool_call_schema", None)
    fields = getattr(schema, "model_fields", None)
    full = getattr(tool, "args_schema", None)
    found = ToolSchema(schema, frozenset(fields) if isinstance(fields, Mapping) else None,
                       frozenset(getattr(tool, "_injected_args_keys", None) or ()),
                       full if isinstance(full, type) and full is not schema and _validates_more(full) else None)
    try:
        ref = weakref.ref(tool)
    except TypeError:
        return found
    if len(_SCHEMAS) >= 1024:
        for key in [k for k, v in _SCHEMAS.items() if v[0]() is None]:
            _SCHEMAS.pop(key, None)
    _SCHEMAS[id(tool)] = (ref, found)
    return found


def model_args(tool: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments the model gave: injected ones (state, runtime, store...) left out, also when the tool's
    schema declares them (LangChain's shell tool has ``runtime: Any`` in it). A key the schema does not
    know stays (the tool parses it too: a key under its alias, an extra one ``extra="forbid"`` rejects)."""
    injected = tool_schema(tool).injected
    return {k: v for k, v in args.items() if k not in injected}


def _problem(exc: Exception, ignore: Callable[[Any], bool] = lambda field: False) -> str | None:
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc).strip() or type(exc).__name__
    found = [e for e in errors() if not (e["loc"] and ignore(e["loc"][0]))]
    if not found:
        return None
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'args'}: {e['msg']}" for e in found)


def argument_problem(tool: Any, args: Mapping[str, Any]) -> str | None:
    """Validate the model's arguments before money moves, as the tool will parse them: against the tool's own
    ``args_schema`` when it rejects what the schema the model sees accepts (validators of its own,
    ``extra="forbid"``, ``strict``, aliases: :func:`_validates_more`), otherwise against the schema the model
    sees. A call the tool would reject before running is refused free: pydantic's ``ValidationError`` (which
    wraps a validator's ``ValueError`` and ``AssertionError``) is the model's mistake, and LangChain's ToolNode
    would show it to the model too. Anything else a validator raises (a ``KeyError``, a ``TypeError``) is the
    tool's own exception, which pydantic does not wrap: it is raised here unchanged, as the tool's run would raise
    it, so the caller can let it through without charging (see ``CallRun._price``).

    Injected arguments (``ToolRuntime``, ``InjectedState``, ``InjectedStore``,
    ``InjectedToolCallId``) are not the model's: LangGraph fills them in, so they are left out and
    errors about them are not the model's either.
    """
    found = tool_schema(tool)
    validate = getattr(found.schema, "model_validate", None)
    if validate is None:
        return None  # a JSON-schema dict tool: the tool validates its own input
    if type(args) is dict and not found.injected:
        given = args.copy()  # model_args(tool, args), without its comprehension (a copy: a validator may change it)
    else:
        given = model_args(tool, args) if type(args) is dict or isinstance(args, Mapping) else args
    if found.full is None or not isinstance(given, Mapping):
        try:
            validate(given)
        except ValidationError as exc:
            return _problem(exc)
    else:
        full_fields = found.full.model_fields
        by_alias = {f.alias or name: name for name, f in full_fields.items()}

        def not_the_models(field: Any) -> bool:
            # Fields the model does not fill (injected ones, also those declared only in args_schema, as
            # InjectedState): LangGraph fills them in. Errors name a field by its alias. A key args_schema does
            # not know at all is the model's (the tool's extra="forbid" rejects it).
            name = by_alias.get(field, field)
            return name in found.injected or (name in full_fields and found.fields is not None
                                              and name not in found.fields)

        try:
            found.full.model_validate(given)
        except ValidationError as exc:
            return _problem(exc, ignore=not_the_models)
        except Exception:  # noqa: BLE001 - a validator's own exception, not wrapped by pydantic
            if any(not_the_models(name) and name not in given for name in full_fields):
                return None  # it may need a value LangGraph injects: the tool judges its own input
            raise  # the tool's own exception (a bug in it, or its way of refusing): not the guard's to answer
    return None


def json_artifact(message: Any) -> dict[str, Any] | None:
    artifact = getattr(message, "artifact", None)
    if not isinstance(artifact, dict):
        return None
    try:
        json.dumps(artifact)
    except (TypeError, ValueError):
        return None
    return artifact


def result_message(result: Any, tool_call_id: str) -> ToolMessage | None:
    """The ToolMessage that answers ``tool_call_id`` in a tool's result (a message, a Command, or a list of
    them: ToolNode takes a list with one message answering the call). In a Command's update, whatever its
    form (a dict, ``(key, value)`` pairs, an annotated object), a message may be given as a dict."""
    if isinstance(result, ToolMessage):
        return result
    if isinstance(result, Command):
        for _, messages in _messages_of(result):
            for m in messages:
                if _answers(m, tool_call_id):
                    return m if isinstance(m, ToolMessage) else convert_to_messages([m])[0]  # type: ignore[return-value]
        return None
    if is_result_list(result):
        for item in result:
            found = item if isinstance(item, ToolMessage) and item.tool_call_id == tool_call_id else (
                result_message(item, tool_call_id) if isinstance(item, Command) else None)
            if found is not None:
                return found
    return None


def _answers(message: Any, tool_call_id: str) -> bool:
    """Whether ``message`` (a message, or one in dict form) is a ToolMessage answering ``tool_call_id``."""
    if isinstance(message, ToolMessage):
        return message.tool_call_id == tool_call_id
    return (type(message) is dict and message.get("tool_call_id") == tool_call_id
            and (message.get("role") or message.get("type")) == "tool")


def _messages_of(command: Command) -> list[tuple[int, list[Any]]]:
    """The messages a Command's update writes, by the index of their pair in ``_update_as_tuples()`` (LangGraph's
    reading of an update in any of its forms)."""
    found = []
    for i, (key, value) in enumerate(_update_pairs(command)):
        if key == "messages" and value is not None:
            found.append((i, list(value) if isinstance(value, (list, tuple)) else [value]))
    return found


def _update_pairs(command: Command) -> list[tuple[str, Any]]:
    update = command.update
    if type(update) is dict or isinstance(update, Mapping):
        return list(update.items())
    return list(command._update_as_tuples())


def is_result_list(result: Any) -> bool:
    """Whether a tool's result is a list of Commands and ToolMessages (which ToolNode applies in order)."""
    return type(result) is list and bool(result) and all(isinstance(r, (Command, ToolMessage)) for r in result)


def checked_bill(value: Any, where: str) -> float:
    """A reported bill, checked: a finite number >= 0 (``where`` names the field in the error)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidBillError(f"{where} must be a number, got {value!r}; "
                               "report the amount the provider billed, e.g. 0.0 for a failure it did not bill")
    try:
        return check_amount(value, where)
    except ValueError as exc:
        raise InvalidBillError(str(exc)) from None


def billed_amount(result: Any, tool_call_id: str) -> float | None:
    """What the tool says its provider billed (``artifact["intent_billed"]``), if it says."""
    message = result_message(result, tool_call_id)
    artifact = getattr(message, "artifact", None)
    # (``artifact`` is usually None: no ABC check for it)
    if artifact is not None and isinstance(artifact, Mapping) and BILLED_KEY in artifact:
        return checked_bill(artifact[BILLED_KEY], f"artifact[{BILLED_KEY!r}] of the tool's result")
    return None


def raised_bill(exc: BaseException) -> float | None:
    """What a tool that raised says its provider billed: the exception's ``intent_billed``
    attribute (e.g. 0.0 when the provider does not bill a failed call), if it has one."""
    value = getattr(exc, BILLED_KEY, None)
    return None if value is None else checked_bill(value, f"the exception's {BILLED_KEY!r} attribute")


def with_update(result: Any, tool_call_id: str, message: ToolMessage | None, update: dict[str, Any]) -> Any:
    """Return the tool's result with ``update`` merged into its state update.

    A ``Command`` keeps its ``goto``, ``graph`` and ``resume``, and its update in the form it has (a dict
    stays a dict; ``(key, value)`` pairs or an annotated object become pairs, as LangGraph reads them); its
    answering ToolMessage (the first, in any form) is replaced by ``message`` (the same message with a note
    appended, say).
    """
    if isinstance(result, Command):
        if result.graph == Command.PARENT:
            # The update goes to the parent graph, whose state has no ledger channel of ours.
            return result
        pairs = _update_pairs(result)
        if message is not None:
            for i, messages in _messages_of(result):
                at = next((j for j, m in enumerate(messages) if _answers(m, tool_call_id)), None)
                if at is not None:
                    messages[at] = message
                    pairs[i] = ("messages", messages)
                    break
        if type(result.update) is dict or isinstance(result.update, Mapping) or result.update is None:
            new_update: Any = {**dict(pairs), **update}
        else:
            new_update = [*pairs, *update.items()]
        return Command(graph=result.graph, update=new_update, resume=result.resume, goto=result.goto)
    if is_result_list(result):
        # Each item as the tool returned it (its answer with the note), then one more Command with the charges.
        items = []
        for item in result:
            if isinstance(item, Command) and item.graph is None:
                item = with_update(item, tool_call_id, message, {})
            elif message is not None and isinstance(item, ToolMessage) and item.tool_call_id == tool_call_id:
                item = message
            items.append(item)
        return [*items, Command(update=update)]
    return Command(update={"messages": [message if message is not None else result], **update})
