"""Watches the dump area: the daemon sees dumps arrive itself (inotify via watchdog).

Producers write ``.<rid>.e3dump.tmp`` and rename it to ``<rid>.e3dump``; only the final name
is reported. A periodic :meth:`DumpWatcher.scan` is the safety net for an event lost to an
overflowing inotify queue; the dump area holds only uncommitted dumps, so it stays small.

The watch asks inotify for arrivals only (``IN_MOVED_TO``, never ``IN_MOVED_FROM``): watchdog
holds every ``IN_MOVED_FROM`` for half a second to pair it with its ``IN_MOVED_TO``, and while
it is held at the head of its queue, every event behind it waits. A rename's ``IN_MOVED_FROM``
that watchdog's reader handed on before its pair, or a file moved out of the dump area, then
delayed every dump arriving in the next 0.5 s.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from watchdog.events import (
    FileClosedEvent,
    FileCreatedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver, EventEmitter

from eagle3d.remote.dumpfile import rid_of


class _Handler(FileSystemEventHandler):
    def __init__(self, notify: Callable[[str], None]) -> None:
        self.notify = notify

    def on_created(self, event: FileSystemEvent) -> None:
        if not event.is_directory:
            self.notify(str(event.src_path))

    def on_moved(self, event: FileSystemEvent) -> None:
        if not event.is_directory:
            self.notify(str(event.dest_path))

    def on_closed(self, event: FileSystemEvent) -> None:
        if not event.is_directory:
            self.notify(str(event.src_path))


def _arrivals_only(emitter: type[EventEmitter]) -> type[EventEmitter]:
    """``emitter`` (watchdog's inotify emitter) with ``IN_MOVED_FROM`` left out of its mask;
    a rename into the dump area still reports ``IN_MOVED_TO``, alone, as a created file."""
    from watchdog.observers.inotify_c import InotifyConstants

    base: Any = emitter

    class Arrivals(base):  # type: ignore[misc]  # watchdog ships no types
        def get_event_mask_from_filter(self) -> Any:
            return super().get_event_mask_from_filter() & ~InotifyConstants.IN_MOVED_FROM

    return Arrivals


def _observer() -> BaseObserver:
    """watchdog's observer for this platform; on Linux, one that reports arrivals only."""
    observer = Observer()
    try:
        from watchdog.observers.inotify import InotifyEmitter
    except ImportError:  # pragma: no cover - not Linux: the platform's observer as is
        return observer
    cls = getattr(observer, "_emitter_class", None)
    if isinstance(cls, type) and issubclass(cls, InotifyEmitter):
        observer._emitter_class = _arrivals_only(cls)
    return observer


class DumpWatcher:
    """Calls ``arrived(path)`` (on watchdog's thread: the daemon's inbox) for every complete
    dump in ``dump_dir``."""

    def __init__(self, dump_dir: str, arrived: Callable[[str], None]) -> None:
        self.dump_dir = dump_dir
        self.arrived = arrived
        self._observer = _observer()
        self._ino = 0

    def _notify(self, path: str) -> None:
        if rid_of(path) is not None and os.path.dirname(path) == self.dump_dir:
            self.arrived(path)

    def start(self) -> None:
        os.makedirs(self.dump_dir, exist_ok=True)
        self._schedule()
        self._observer.start()
        self._name_threads()

    def _name_threads(self) -> None:
        """Python names for watchdog's threads (its own are ``Thread-N``), which
        :mod:`eagle3d.remote.threadnames` passes on to ``top -H`` and ``ps -L``."""
        self._observer.name = "dump-observer"
        for emitter in self._observer.emitters:
            emitter.name = "dump-emitter"
        reader = getattr(self._observer, "_inotify_fd", None)  # watchdog >= 7's inotify reader
        if isinstance(reader, threading.Thread):
            reader.name = "dump-inotify"

    def rearm(self) -> bool:
        """Watch the dump area again if it was removed (and recreate it) or replaced.

        An inotify watch follows the directory it was placed on: once that is deleted (a
        /dev/shm cleanup), dumps land in a new directory nobody watches, and only the
        periodic scan would find them. Returns whether the watch had to be renewed.
        """
        try:
            same = os.stat(self.dump_dir).st_ino == self._ino
        except FileNotFoundError:
            os.makedirs(self.dump_dir, exist_ok=True)
            same = False
        # A deleted directory's inode number can come back with its successor, so also ask
        # whether the watch is still alive (watchdog ends it when the directory goes).
        if same and all(e.is_alive() for e in self._observer.emitters):
            return False
        self._observer.unschedule_all()
        self._schedule()
        self._name_threads()
        return True

    def _schedule(self) -> None:
        self._ino = os.stat(self.dump_dir).st_ino
        # Only the events that can complete a dump: without a filter inotify also reports
        # every write of a dump (IN_MODIFY), and the daemon's own opens, reads and deletes,
        # each turned into Python objects on two threads - CPU taken from the producer.
        self._observer.schedule(
            _Handler(self._notify),
            self.dump_dir,
            recursive=False,
            event_filter=[FileCreatedEvent, FileMovedEvent, FileClosedEvent],
        )

    def scan(self) -> list[str]:
        """Complete dumps present now (the safety net, and orphans at start)."""
        try:
            names = os.listdir(self.dump_dir)
        except FileNotFoundError:
            return []
        return [os.path.join(self.dump_dir, n) for n in names if rid_of(n) is not None]

    def stale_temp_files(self) -> list[str]:
        try:
            names = os.listdir(self.dump_dir)
        except FileNotFoundError:
            return []
        return [
            os.path.join(self.dump_dir, n)
            for n in names
            if n.startswith(".") and n.endswith(".tmp")
        ]

    def stop(self) -> None:
        self._observer.stop()
        self._observer.join(timeout=5)
