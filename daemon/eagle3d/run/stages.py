"""The stages of a daemon's start, said from its first second: each stage one log line (and
sd_notify's STATUS) when it begins, a progress line about every :attr:`StartStages.EVERY_S`
while a long one reads (the dataset, the space check's sample), and what the start beacon
(:mod:`eagle3d.serve.beacon`) shows monitors. A signal during the start is seen here: the
next progress step of a long read raises :class:`StartStopped`, so a stop never waits for a
read to end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from eagle3proto import wire

from eagle3d.store.sizing import size

log = logging.getLogger("eagle3d")


class StartStopped(Exception):
    """A signal (SIGINT, SIGTERM) came during the start: the start ends here."""

    def __init__(self, signame: str, stage: str) -> None:
        super().__init__(f"stopped by {signame} while {stage or 'starting'}")
        self.signame = signame
        self.stage = stage


class StartStages:
    """Where the start stands; updated from the loop thread and the reading threads alike."""

    EVERY_S = 2.0

    def __init__(
        self,
        status: Callable[[str], object],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._status = status  # sd_notify's STATUS
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self.stage = ""
        self.detail = ""
        self._t0 = clock()
        self._last = self._t0
        self.rows = self.done = self.total = 0
        self.signame = ""  # the signal that stops the start ('' while none came)

    def begin(self, stage: str) -> None:
        """A stage begins: one log line and STATUS (a stop already asked for ends it here)."""
        self.check()
        with self._lock:
            self.stage, self.detail = stage, ""
            self._t0 = self._last = self._clock()
            self.rows = self.done = self.total = 0
        log.info("start: %s", stage)
        self._status(stage)

    def progress(
        self, rows: int = 0, done: int = 0, total: int = 0, what: str = "", of: int = 0
    ) -> None:
        """The stage's progress (any thread): rows read, bytes read of ``total`` (0: unknown);
        a line every :attr:`EVERY_S`. Raises :class:`StartStopped` once a signal came."""
        self.check()
        now = self._clock()
        with self._lock:
            self.rows, self.done, self.total = rows, done, total
            self.detail = _words(rows, done, total, what, of)
            due = now - self._last >= self.EVERY_S
            if due:
                self._last = now
            line = f"{self.stage}: {self.detail}, {now - self._t0:.0f} s"
        if due:
            log.info("start: %s", line)
            self._status(line)

    def stop(self, signame: str) -> None:
        """A signal came (the loop's signal handler): the next step of the start ends it."""
        self.signame = self.signame or signame

    def check(self) -> None:
        if self.signame:
            raise StartStopped(self.signame, self.stage)

    def info(self, pid: int) -> wire.StartInfo:
        """The start as a beacon's snapshot carries it (since: wall time of the stage's
        beginning, measured on the monotonic clock so that a clock step does not move it)."""
        with self._lock:
            ago = self._clock() - self._t0
            return wire.StartInfo(
                stage=self.stage or "starting",
                detail=self.detail,
                since=self._wall() - ago,
                rows=self.rows,
                bytes_read=self.done,
                bytes_total=self.total,
                pid=pid,
            )


def _words(rows: int, done: int, total: int, what: str, of: int) -> str:
    """``counting rows: 120,000 rows, 107.00 MB of 188.29 MB (57 %)``; with ``of``:
    ``sampling: 20,000 of 210,000 rows (9 %)``"""
    if not (rows or done or total or of):
        return what
    if of > 0:
        parts = [f"{rows:,} of {of:,} rows ({100 * rows // of} %)"]
    else:
        parts = [f"{rows:,} rows"] if rows else []
    if total > 0:
        parts.append(f"{size(done)} of {size(total)} ({100 * done // total} %)")
    elif done:
        parts.append(f"{size(done)} read")
    text = ", ".join(parts) or "0 rows"
    return f"{what}: {text}" if what else text


__all__ = ["StartStages", "StartStopped"]
