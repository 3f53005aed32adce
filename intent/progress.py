"""Progress for long jobs: a bar on a TTY, otherwise a plain line at least every 10 s with an ETA.

``with progress(total, desc, enabled=True) as p: ... p.update(1)``. CI logs and ``make demo``
redirected to a file get lines like ``intent  120/300 (40%) 12.3 s elapsed, ETA 18.4 s``.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO

__all__ = ["Progress", "progress"]

LINE_EVERY_S = 10.0


class Progress:
    def __init__(self, total: int, desc: str, *, enabled: bool = True, stream: TextIO | None = None,
                 every_s: float = LINE_EVERY_S) -> None:
        self.total, self.desc, self.every_s = total, desc, every_s
        self.stream = stream or sys.stderr
        self.done = 0
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._bar: Any = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if not enabled:
            return
        if self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, leave=False, file=self.stream)
        else:
            # A separate ticker, so that a line appears every ``every_s`` even while one slow
            # item is running.
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()

    def line(self) -> str:
        with self._lock:
            done, total = self.done, self.total
        elapsed = time.monotonic() - self._started
        eta = f"ETA {elapsed / done * (total - done):.1f} s" if done else "ETA unknown"
        pct = 100.0 * done / total if total else 100.0
        return f"{self.desc} {done}/{total} ({pct:.0f}%) {elapsed:.1f} s elapsed, {eta}"

    def _tick(self) -> None:
        while not self._stop.wait(self.every_s):
            print(self.line(), file=self.stream, flush=True)

    def update(self, n: int = 1) -> None:
        with self._lock:
            self.done += n
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        self._stop.set()
        if self._bar is not None:
            self._bar.close()
        elif self._ticker is not None:
            print(self.line(), file=self.stream, flush=True)  # the final count, once

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(total: int, desc: str, *, enabled: bool = True, stream: TextIO | None = None,
             every_s: float = LINE_EVERY_S) -> Progress:
    return Progress(total, desc, enabled=enabled, stream=stream, every_s=every_s)
