"""Interaction logs: one JSON line per guarded proposal.

This is the data that training consumes (intention predictor triples, world-model pairs)
and that BTP turns into experience, so the schema is explicit and versioned:
:data:`SCHEMA_VERSION` changes whenever a field changes meaning. Readers check it.

Each proposal produces exactly one record:

* rejected by the oracle or the guard: ``decision="reject"``, ``charged=0``;
* invalid (unknown tool, bad arguments): ``decision="invalid"``, ``charged=0``;
* accepted and run: ``decision="accept"``, ``charged=price`` and the observation;
* accepted and run: one record **per execution** (a retried call has several),
  ``decision="accept"``, ``execution`` = 1, 2, ..., ``charged`` = what was billed;
* accepted and never run (reservation released, e.g. another middleware answered it):
  ``decision="accept"``, ``status="released"``, ``charged=0``, ``execution=0``;
* answered before the guard's gate saw it (by another middleware's ``after_model``, or by the
  model's own response, a structured-output answer): ``decision="answered"``,
  ``reason="answered_elsewhere"``, ``status="released"``, ``charged=0``, ``execution=0``; not a
  gate decision;
* a budget top-up: ``decision="top_up"``, ``price`` = the amount, ``charged=0``,
  ``approved_by`` = who approved it;
* one execution of the agent's chat model (``kind="model"``, ``tool`` = the model name,
  ``tokens`` = its usage): ``decision="accept"``, ``charged`` = its cost; a model call the
  budget could not cover: ``decision="reject"``, ``charged=0``; a model call that failed
  before any usage came back: ``status="error"``, ``charged=0``;
* an execution of a model another middleware called through ``guard.metered_model`` (a
  summariser's): as the agent's model, with ``reason="metered_model:<lc_source>"``;
* the oracle's own model calls (``kind="oracle"``, with ``charge_oracle=True``) and a
  sub-agent's carve (``kind="sub_agent"``: ``charged`` = what the sub-agent spent).

So the sum of ``charged`` over a task's records equals what the ledger spent, and the
records with ``execution > 0`` are exactly the tool's runs.

Reading: :func:`read_log` (validated :class:`StepRecord` objects) and :func:`read_log_rows`
(the checked JSON objects, for readers that also take hand-made records, like BTP's
experience) are the project's only readers of these files; :func:`label_of` is its only
extraction of a record's label z.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from intent.arguments import is_path_arg
from intent.errors import LogFormatError, UsageError
from intent.jsonl import iter_jsonl

__all__ = [
    "SCHEMA_VERSION",
    "JsonlLogSink",
    "LogFormatError",
    "LogSink",
    "MemoryLogSink",
    "StepRecord",
    "label_of",
    "read_log",
    "read_log_rows",
]

SCHEMA_VERSION = 4
# Versions read_log still accepts: 2 added execution / overrun / the top_up decision;
# 3 added kind / tokens / approved_by (model, oracle and sub-agent charges in the same log);
# 4 added the answered decision (a call another middleware answered before the gate).
READABLE_VERSIONS = (1, 2, 3, 4)


class StepRecord(BaseModel):
    """One guarded proposal and what became of it."""

    model_config = ConfigDict(extra="allow", frozen=True)

    schema_version: int = SCHEMA_VERSION
    task_id: str
    step: int = Field(description="index of the model turn within the episode (0-based)")
    call_id: str
    query: str = ""
    reasoning: str = Field("", description="the agent's text in the message that proposed the call")
    tool: str
    args: dict[str, Any] | str = Field(default_factory=dict)
    price: float | None = None
    decision: Literal["accept", "reject", "invalid", "top_up", "answered"]
    reason: str = ""
    oracle: str = ""
    feedback: str = ""
    trace: list[dict[str, Any]] = Field(default_factory=list)
    observation: str = ""
    status: Literal["ok", "error", "rejected", "invalid", "released"]
    charged: float = 0.0
    execution: int = Field(0, description="1-based run of the proposed call this record charges; 0: no run")
    overrun: float = Field(0.0, description="billed above the reservation (the provider charged more)")
    spent: float = Field(description="ledger spend after this record")
    remaining: float
    budget: float
    market_version: int = 0
    decision_ms: float = 0.0
    tool_ms: float = 0.0
    oracle_usage: dict[str, float] = Field(default_factory=dict)
    enforce: bool = True
    kind: Literal["tool", "model", "oracle", "sub_agent"] = Field(
        "tool", description="what was paid: a tool run, a model call, the oracle's model, a sub-agent")
    tokens: dict[str, int] = Field(default_factory=dict, description=(
        "a model call's usage: input/output/cached, and cache_write when the prompt was written to a cache"))
    approved_by: str = Field("", description="who approved a top-up")
    artifact: dict[str, Any] | None = Field(
        None, description="the tool's JSON artifact, e.g. a simulated environment's ground-truth label z")
    timestamp: float = Field(default_factory=time.time)

    @property
    def is_gate_decision(self) -> bool:
        """Whether this record stands for one gate decision on a proposed tool call: its refusal,
        its first run, or its reservation released unused. A retry's run, a model's or the
        oracle's charge, a top-up and a call too malformed to decide on are not decisions."""
        if self.kind != "tool":
            return False
        if self.decision == "reject":
            return True
        return self.decision == "accept" and (self.execution == 1 or self.status == "released")


@runtime_checkable
class LogSink(Protocol):
    def write(self, record: StepRecord) -> None: ...


class MemoryLogSink:
    """Keeps records in a list (tests, the benchmark's in-process metrics)."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self._lock = threading.Lock()

    def write(self, record: StepRecord) -> None:
        with self._lock:
            self.records.append(record)


class JsonlLogSink:
    """Appends one JSON line per record; thread-safe; each line is flushed whole.

    A crash can at worst leave a torn last line, which :func:`read_log` reports with its
    line number (``skip_torn_tail=True`` ignores only a torn *final* line: one without its newline).
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        if not is_path_arg(path):
            raise UsageError(f"JsonlLogSink needs the path of a log file, got {type(path).__name__} {path!r}; "
                             "write JsonlLogSink('runs/guard.jsonl')")
        if Path(path).is_dir():
            raise UsageError(f"JsonlLogSink path {str(path)!r} is a directory; pass a file in it, e.g. "
                             f"{str(Path(path) / 'guard.jsonl')!r}")
        if not isinstance(fsync, bool):
            raise UsageError(f"JsonlLogSink fsync must be True or False, got {fsync!r}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._lock = threading.Lock()

    def write(self, record: StepRecord) -> None:
        line = record.model_dump_json() + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()
            if self._fsync:
                os.fsync(fh.fileno())


class FanoutLogSink:
    """Writes each record to several sinks."""

    def __init__(self, sinks: Iterable[LogSink]) -> None:
        self.sinks = list(sinks)

    def write(self, record: StepRecord) -> None:
        for sink in self.sinks:
            sink.write(record)


def read_log(path: str | os.PathLike[str], *, skip_torn_tail: bool = True) -> Iterator[StepRecord]:
    """Yield the records of a JSONL log, raising :class:`LogFormatError` with the line number."""
    for where, data in _rows(path, skip_torn_tail=skip_torn_tail, require_version=True):
        try:
            yield StepRecord.model_validate(data)
        except ValidationError as exc:  # the message names the fields
            raise LogFormatError(f"{where}: not a StepRecord: {exc}") from exc


def read_log_rows(path: str | os.PathLike[str], *, skip_torn_tail: bool = True,
                  require_version: bool = True) -> Iterator[dict[str, Any]]:
    """Yield the JSON objects of a JSONL log, checked but not validated as :class:`StepRecord`.

    Each non-blank line must be a JSON object whose ``schema_version`` is one this version of
    intent reads. ``require_version=False`` also accepts an object with no ``schema_version``
    at all (a hand-made record); one that names a version still has it checked, so a guard
    log written by another version of intent is refused, never misread. Errors are
    :class:`LogFormatError` (a ``ValueError``) naming ``file:line``.
    """
    for _, data in _rows(path, skip_torn_tail=skip_torn_tail, require_version=require_version):
        yield data


def _rows(path: str | os.PathLike[str], *, skip_torn_tail: bool, require_version: bool
          ) -> Iterator[tuple[str, dict[str, Any]]]:
    if not is_path_arg(path):
        raise LogFormatError(f"the log path must be a file path (str or os.PathLike), got {type(path).__name__} "
                             f"{path!r}; pass the JSONL written by intent.logs.JsonlLogSink")
    p = Path(path)
    if not p.exists():
        raise LogFormatError(f"log file {p} does not exist; pass the JSONL written by intent.logs.JsonlLogSink")
    if p.is_dir():
        raise LogFormatError(f"{p} is a directory; pass its log file (the JSONL written by intent.logs.JsonlLogSink, "
                             f"e.g. {p / 'logs.jsonl'})")

    def bad_line(i: int, exc: json.JSONDecodeError) -> LogFormatError:
        return LogFormatError(f"{p}:{i}: not valid JSON ({exc.msg} at column {exc.colno}); expected one "
                              "interaction-log record (a JSON object) per line")

    def not_utf8(i: int, exc: UnicodeDecodeError) -> LogFormatError:
        return LogFormatError(f"{p}:{i}: {p} is not a text log (byte {exc.start} of the line is not UTF-8); pass "
                              "the JSONL written by intent.logs.JsonlLogSink")

    # Lazily, a line at a time: a production log may not fit in memory, and a consumer may stop early.
    with open(p, "rb") as fh:
        for i, data in iter_jsonl(fh, allow_torn_tail=skip_torn_tail, bad_line=bad_line, not_utf8=not_utf8):
            if not isinstance(data, dict):
                raise LogFormatError(f"{p}:{i}: expected a JSON object (an interaction-log record), got "
                                     f"{type(data).__name__}")
            version = data.get("schema_version")
            if (require_version or version is not None) and version not in READABLE_VERSIONS:
                if version is None:
                    raise LogFormatError(
                        f"{p}:{i}: not a guard log record (no schema_version; keys {sorted(data)[:6]}); pass a log "
                        "a BudgetGuard wrote (JsonlLogSink), or a run directory holding one")
                raise LogFormatError(
                    f"{p}:{i}: schema_version {version!r} is not one of {READABLE_VERSIONS}; "
                    "the log was written by another version of intent"
                )
            yield f"{p}:{i}", data


# Where a record's label z is read, in order: a hand annotation (``useful``, BTP's name for it;
# ``z``, what ``intent train annotate`` adds), then the environment's ground truth in the tool's
# artifact (``artifact["z"]``, e.g. the synthetic market's).
_LABEL_KEYS = ("useful", "z")
_TRUE = ("1", "true", "yes", "useful")
_FALSE = ("0", "false", "no", "useless")


def label_of(record: Any, *, ground_truth_only: bool = False) -> int | None:
    """The label z of a logged call (did it satisfy the need?): 1, 0, or ``None`` if unlabelled.

    ``record`` is a :class:`StepRecord` (annotations live in its extra fields), a dict, or any
    object with those attributes. The label is read from ``useful``, else ``z``, else
    ``artifact["z"]`` (only the artifact with ``ground_truth_only=True``). A value may be
    0/1, a bool, or ``"0"``/``"1"``/``"true"``/``"false"``/``"yes"``/``"no"``; ``None`` and
    NaN (an empty cell of an exported table) mean unlabelled. Anything else raises
    :class:`LogFormatError` naming the field: a label that cannot be read must not silently
    become a 1 or drop the call from the data.
    """
    if isinstance(record, Mapping):
        get = record.get
    else:
        extra = getattr(record, "model_extra", None) or {}

        def get(key: str) -> Any:
            value = getattr(record, key, None)
            return extra.get(key) if value is None else value

    if not ground_truth_only:
        for key in _LABEL_KEYS:
            z = _label_value(get(key), key)
            if z is not None:
                return z
    artifact = get("artifact")
    if artifact is None:
        return None
    if not isinstance(artifact, Mapping):
        raise LogFormatError(f"artifact={artifact!r} is not a JSON object; the label z is read from artifact['z']")
    return _label_value(artifact.get("z"), "artifact['z']")


def _label_value(value: Any, field: str) -> int | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)) and value in (0, 1):
        return int(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return int(value.strip().lower() in _TRUE)
    raise LogFormatError(f"label {field}={value!r} is not 0/1, a bool or '0'/'1'; fix the annotation "
                         "(z = 1: the call satisfied the need, 0: it did not)")
