"""A file that keeps a guard's unsent store commits across a crash (``BudgetGuard(outbox_journal=PATH)``).

When a call has run but the shared store could not take its commit, :class:`intent.stores.CommitOutbox`
keeps the commit in memory and sends it before the next operation. A process that dies before then lost
it: the store later expired the call's hold (``status="expired"``), and the shared budget showed less spent
than was spent. With a journal the kept commit is written (and fsynced) before the tool step ends; a guard
that opens the same journal later, in this process or the next, sends it before its first operation on the
store. Commits are idempotent by charge id, so one the store took before the crash is not charged twice,
and one sent after its lease ran out is charged and flagged ``late`` (the money was spent).

The format is JSON Lines, append-only: ``{"kept": [key, charge_id], "amount": a}`` when a commit is kept
and ``{"done": [key, charge_id]}`` when the store took it or refused it for good; what is kept and not done
is pending. A crash mid-write leaves at most a torn last line, which never counted: opening the journal skips
it (intent.logs reads the file) and cuts it, so the file stays readable. The
file is emptied once nothing is pending, so it does not grow.

One journal belongs to one guard at a time: it is locked (``flock``, where the platform has it) while open,
and a second opener gets a :class:`~intent.errors.GuardConfigError`. Give each process its own path.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from intent.errors import GuardConfigError

__all__ = ["OutboxJournal"]

try:  # (POSIX; elsewhere one process per journal is the user's to keep)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


class OutboxJournal:
    """The kept commits of one :class:`~intent.stores.CommitOutbox`, on disk."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from intent.arguments import is_path_arg

        if not is_path_arg(path) or not str(path):
            raise GuardConfigError(f"outbox_journal must be a file path (str or os.PathLike), got {path!r}; e.g. "
                                   "BudgetGuard(..., outbox_journal='budget-outbox.jsonl'), one per process")
        self.path = Path(path)
        if self.path.is_dir():
            raise GuardConfigError(f"outbox_journal {self.path} is a directory; pass a file path in it, e.g. "
                                   f"{self.path / 'budget-outbox.jsonl'}")
        # Opened for appending and kept open: each write is one line, flushed and fsynced before it returns.
        try:
            self._file = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 - closed in close()
        except OSError as exc:
            fix = (f"its directory {self.path.parent} does not exist; create it first, or pass a path in an existing "
                   "directory") if not self.path.parent.is_dir() else "pass a file path this process may write"
            raise GuardConfigError(f"outbox_journal {self.path} cannot be opened for writing ({exc.strerror}): "
                                   f"{fix}") from exc
        if fcntl is not None:
            try:
                fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self._file.close()
                raise GuardConfigError(
                    f"outbox_journal {self.path} is open in another guard (locked); give each process its own "
                    "journal path, and open it again only after the guard that had it has ended") from None
        self.pending = self._read()
        self._cut_torn_tail()

    def _read(self) -> dict[tuple[str, str], float | None]:
        from intent.logs import read_log_rows

        pending: dict[tuple[str, str], float | None] = {}
        if self.path.stat().st_size == 0:
            return pending
        for row in read_log_rows(self.path, skip_torn_tail=True, require_version=False):
            if "kept" in row:
                key, charge_id = row["kept"]
                pending[(str(key), str(charge_id))] = row.get("amount")
            elif "done" in row:
                key, charge_id = row["done"]
                pending.pop((str(key), str(charge_id)), None)
        if pending:
            logging.getLogger("intent.stores").warning(
                "outbox journal %s holds %d commit(s) a guard could not send before it ended: sent before this "
                "guard's first operation on the store", self.path, len(pending))
        return pending

    def _write_line(self, text: str) -> None:
        self._file.write(text + "\n")  # (mode "a": always at the end)
        self._file.flush()
        os.fsync(self._file.fileno())

    def _cut_torn_tail(self) -> None:
        """Cut a torn last line (a crash mid-write; :meth:`_read` skipped it, as it never counted), so that the
        next record starts on a line of its own and the file stays readable."""
        self._file.seek(0)
        text = self._file.read()
        if text and not text.endswith("\n"):
            self._file.truncate(len(text[: text.rfind("\n") + 1].encode("utf-8")))
            self._file.flush()
            os.fsync(self._file.fileno())

    def kept(self, key: str, charge_id: str, amount: float | None) -> None:
        self._write_line(json.dumps({"kept": [key, charge_id], "amount": amount}))

    def done(self, key: str, charge_id: str, *, nothing_pending: bool) -> None:
        if nothing_pending:  # the whole file is settled: start it afresh rather than grow it
            self._file.seek(0)
            self._file.truncate()
            self._file.flush()
            os.fsync(self._file.fileno())
        else:
            self._write_line(json.dumps({"done": [key, charge_id]}))

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()  # (closing the file releases the lock)
