"""The dump reaper: removes committed dumps on a thread of its own, off the commit threads.

A dump is handed over only once its sample's ``sample_saved`` record is durable in the
journal (:func:`eagle3d.run.commits.commit_batch`), so a crash at any instant either left
the dump (the next start removes it as an orphan "left by an earlier run"; the journal says
the sample is saved, so it is never sent again) or removed it after the record: no sample
is lost or committed twice because of the order.

Why a thread: removing a dump from a tmpfs frees its pages, about 5 ms of CPU for a 34 MB
dump here (``bench/commit_breakdown.py``), which a commit thread spent between writing one
batch and reading the next, with the disk idle for its share. The reaper runs at the lowest
CPU priority, so it takes the time the commit threads leave while they wait for the disk.

Bounded: at most ``limit`` bytes of dumps wait for removal. Past that a commit thread
removes its own dumps at once, as before, so the dump area never holds more than ``limit``
bytes of committed dumps beyond what the window already counts (and the window reads the
dump area's free space, which those dumps still take, so nothing is sent into room they
hold). :meth:`Reaper.close` removes whatever is still queued before it returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

log = logging.getLogger("eagle3d")

#: The most bytes of committed dumps waiting for removal, and the share of the dump area's
#: size they may take (the smaller of the two applies).
LIMIT_BYTES = 1 << 30
AREA_SHARE = 8


def limit_for(dump_dir: str) -> int:
    """The reaper's bound for a dump area: :data:`LIMIT_BYTES`, or an :data:`AREA_SHARE`-th
    of the filesystem's size if that is less."""
    try:
        st = os.statvfs(dump_dir)
    except OSError:
        return LIMIT_BYTES
    return min(LIMIT_BYTES, st.f_blocks * st.f_frsize // AREA_SHARE)


class Reaper:
    """Removes dumps handed to :meth:`remove`, in the order given, on the ``dump-reaper``
    thread; thread-safe."""

    def __init__(self, limit: int = LIMIT_BYTES, nice: int = 19) -> None:
        self.limit = limit
        self.nice = nice
        self.removed = 0  # by the reaper's thread
        self.inline = 0  # by the caller, the queue being full (or the reaper closed)
        self._cond = threading.Condition()
        self._queue: list[tuple[str, int]] = []
        self._pending = 0  # bytes queued or being removed
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="dump-reaper", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Bytes of dumps waiting for removal."""
        with self._cond:
            return self._pending

    def remove(self, dumps: list[tuple[str, int]]) -> None:
        """Remove these (path, bytes) dumps: queued while the bound allows, else at once on
        the caller's thread. A dump already gone is no error."""
        now: list[str] = []
        with self._cond:
            for path, size in dumps:
                if self._closed or self._pending + size > self.limit:
                    now.append(path)
                else:
                    self._queue.append((path, size))
                    self._pending += size
            if self._queue:
                self._cond.notify()
        for path in now:
            _unlink(path)
        if now:
            with self._cond:
                self.inline += len(now)

    def close(self) -> None:
        """Remove what is queued, then stop the thread; later dumps are removed at once."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # a nicety where the OS has it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                batch, self._queue = self._queue, []
            for path, size in batch:
                try:
                    _unlink(path)
                except Exception:  # never let one dump stop the removal of the others
                    log.exception("removing the committed dump %s failed", path)
                with self._cond:
                    self._pending -= size
                    self.removed += 1


def _unlink(path: str) -> None:
    # Gone already is fine; one that cannot be removed is left as an orphan, removed at the
    # next start (its sample is journaled: nothing is redone).
    with contextlib.suppress(OSError):
        os.unlink(path)
