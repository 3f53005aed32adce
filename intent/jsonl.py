"""Reading a JSON Lines file that one writer appends to, one record and its newline per write: the one reader
of the project's JSONL files (guard logs, :mod:`intent.logs`; bench results, ``eval.results``).

Records end in ``"\\n"`` only (``str.splitlines`` would also cut at U+2028, ``\\x1c``, ... that a record's
strings may hold unescaped). Because each record is written with its newline in one write, only a last line
*without* its newline can be a torn write (a crash, or a writer mid-line); a complete bad line anywhere,
the last included, is corruption, and the caller's ``bad_line`` error is raised for it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["JsonlText", "parse_jsonl"]


@dataclass
class JsonlText:
    """What :func:`parse_jsonl` read: ``rows`` as ``(line number, value)``; ``torn`` the torn last line
    (its number and text) when there is one; ``unterminated`` when the text ends in a complete record without
    its newline (kept in ``rows``; an appender must write a newline before its next record)."""

    rows: list[tuple[int, Any]] = field(default_factory=list)
    torn: tuple[int, str] | None = None
    unterminated: bool = False


def parse_jsonl(text: str, *, bad_line: Callable[[int, json.JSONDecodeError], Exception],
                allow_torn_tail: bool = True) -> JsonlText:
    """Parse ``text``. A torn last line is skipped and reported (``allow_torn_tail``), else it is a bad line;
    ``bad_line(line_number, error)`` makes the exception raised for a line that is not JSON."""
    out = JsonlText()
    lines = text.split("\n")
    last_open = bool(text) and not text.endswith("\n")  # the last line has no newline
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.rows.append((i, json.loads(line)))
        except json.JSONDecodeError as exc:
            if allow_torn_tail and last_open and i == len(lines):
                out.torn = (i, line)
                return out
            raise bad_line(i, exc) from exc
    out.unterminated = last_open and bool(lines[-1].strip())
    return out
