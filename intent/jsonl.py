"""Reading a JSON Lines file that one writer appends to, one record and its newline per write: the one reader
of the project's JSONL files (guard logs, :mod:`intent.logs`; bench results, ``eval.results``).

Records end in ``"\\n"`` only (``str.splitlines`` would also cut at U+2028, ``\\x1c``, ... that a record's
strings may hold unescaped). Because each record is written with its newline in one write, only a last line
*without* its newline can be a torn write (a crash, or a writer mid-line, possibly in the middle of a UTF-8
character); a complete bad line anywhere, the last included, is corruption, and the caller's ``bad_line``
error is raised for it.

:func:`iter_jsonl` reads lazily, a line at a time (a guard's log may be larger than memory: training reads
it record by record); :func:`parse_jsonl` reads a text already in memory.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["JsonlText", "iter_jsonl", "parse_jsonl"]


@dataclass
class JsonlText:
    """What :func:`parse_jsonl` read (and what :func:`iter_jsonl` notes in ``status``): ``rows`` as
    ``(line number, value)``; ``torn`` the torn last line (its number and text) when there is one;
    ``unterminated`` when the text ends in a complete record without its newline (kept in ``rows``; an
    appender must write a newline before its next record)."""

    rows: list[tuple[int, Any]] = field(default_factory=list)
    torn: tuple[int, str] | None = None
    unterminated: bool = False


def iter_jsonl(lines: Iterable[bytes | str], *, bad_line: Callable[[int, json.JSONDecodeError], Exception],
               not_utf8: Callable[[int, UnicodeDecodeError], Exception] | None = None,
               allow_torn_tail: bool = True, status: JsonlText | None = None) -> Iterator[tuple[int, Any]]:
    """Yield ``(line number, value)`` for each non-blank line of ``lines``: a file opened in binary mode (its
    lines end in ``b"\\n"`` only; each is decoded as UTF-8), or text lines that keep their ``"\\n"``.

    A torn last line (no newline, and not JSON or cut inside a UTF-8 character) ends the iteration and is
    noted in ``status.torn`` (``allow_torn_tail``), else it is a bad line. ``bad_line(line_number, error)``
    makes the exception raised for a line that is not JSON, ``not_utf8(line_number, error)`` for bytes that
    are not UTF-8 text (default: the ``UnicodeDecodeError`` itself)."""
    for i, raw in enumerate(lines, start=1):
        last_open = not raw.endswith(b"\n" if isinstance(raw, bytes) else "\n")  # only the last line can be
        if isinstance(raw, bytes):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                cut = last_open and exc.reason == "unexpected end of data" and exc.end == len(raw)
                if allow_torn_tail and cut:  # a write torn in the middle of a character
                    if status is not None:
                        status.torn = (i, raw.decode("utf-8", "replace"))
                    return
                raise (not_utf8(i, exc) if not_utf8 is not None else exc) from exc
        else:
            line = raw
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            if allow_torn_tail and last_open:
                if status is not None:
                    status.torn = (i, line)
                return
            raise bad_line(i, exc) from exc
        if status is not None and last_open:
            status.unterminated = True
        yield i, value


def parse_jsonl(text: str, *, bad_line: Callable[[int, json.JSONDecodeError], Exception],
                allow_torn_tail: bool = True) -> JsonlText:
    """Parse ``text`` (see :func:`iter_jsonl`)."""
    out = JsonlText()
    # (newline="\n": lines cut at "\n" only, and kept whole)
    out.rows = list(iter_jsonl(io.StringIO(text, newline="\n"), bad_line=bad_line, allow_torn_tail=allow_torn_tail,
                               status=out))
    return out
