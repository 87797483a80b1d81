"""Watches the dump area: the daemon sees dumps arrive itself, by inotify, on one thread.

Producers write ``.<rid>.e3dump.tmp`` and rename it to ``<rid>.e3dump``; only the final name
is reported. A periodic :meth:`DumpWatcher.scan` is the safety net for an event lost to an
overflowing inotify queue; the dump area holds only uncommitted dumps, so it stays small.

The watch asks the kernel for arrivals only: a file created (a hard link, a producer
writing under the final name), moved in (``IN_MOVED_TO``, never ``IN_MOVED_FROM``, which
would have to wait for a pair) or closed after writing. One thread (``dump-inotify``) reads
the events and hands each arrival to the daemon's inbox: on a GPU node thousands of dumps a
minute arrive, and each hop between threads is a wakeup and a hand-over of the interpreter
taken from the commit threads.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
import threading
from collections.abc import Callable, Iterator

from eagle3d.remote.dumpfile import rid_of

# <sys/inotify.h>
_IN_CLOSE_WRITE = 0x00000008
_IN_MOVED_TO = 0x00000080
_IN_CREATE = 0x00000100
_IN_Q_OVERFLOW = 0x00004000
_IN_IGNORED = 0x00008000  # the watch ended (its directory deleted, or removed)
_IN_ONLYDIR = 0x01000000
_IN_EXCL_UNLINK = 0x04000000
_IN_ISDIR = 0x40000000
_ARRIVALS = _IN_CREATE | _IN_MOVED_TO | _IN_CLOSE_WRITE | _IN_ONLYDIR | _IN_EXCL_UNLINK
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of NUL-padded name


def events(data: bytes) -> Iterator[tuple[int, int, str]]:
    """(watch, mask, name) of each ``struct inotify_event`` in what one read returned."""
    pos = 0
    while pos + _EVENT.size <= len(data):
        wd, mask, _cookie, size = _EVENT.unpack_from(data, pos)
        pos += _EVENT.size
        name = data[pos : pos + size].split(b"\0", 1)[0]
        pos += size
        yield wd, mask, os.fsdecode(name)


class _Inotify:
    """An inotify instance (non-blocking, closed on exec) and its calls."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._check(self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC), "")

    def _check(self, r: int, path: str) -> int:
        if r < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e), *([path] if path else []))
        return r

    def add(self, path: str, mask: int) -> int:
        return self._check(self._libc.inotify_add_watch(self.fd, os.fsencode(path), mask), path)

    def remove(self, wd: int) -> None:
        self._libc.inotify_rm_watch(self.fd, wd)  # a watch already ended: nothing to do

    def close(self) -> None:
        os.close(self.fd)


class DumpWatcher:
    """Calls ``arrived(path)`` (on its own thread: the daemon's inbox) for every complete
    dump in ``dump_dir``."""

    def __init__(self, dump_dir: str, arrived: Callable[[str], None]) -> None:
        self.dump_dir = dump_dir
        self.arrived = arrived
        self._inotify: _Inotify | None = None
        self._lock = threading.Lock()  # the watch: set here, ended on the reader's thread
        self._wd = -1
        self._alive = False
        self._ino = 0
        self._stop_r, self._stop_w = -1, -1
        self._thread: threading.Thread | None = None

    def _notify(self, path: str) -> None:
        if rid_of(path) is not None:  # a dump's final name, not a temp or stray file
            self.arrived(path)

    def start(self) -> None:
        os.makedirs(self.dump_dir, exist_ok=True)
        self._inotify = _Inotify()
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._schedule()
        self._thread = threading.Thread(target=self._run, name="dump-inotify", daemon=True)
        self._thread.start()

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
        # whether the watch is still alive (the kernel ends it when the directory goes).
        with self._lock:
            if same and self._alive:
                return False
        self._schedule()
        return True

    def _schedule(self) -> None:
        assert self._inotify is not None, "start() first"
        self._ino = os.stat(self.dump_dir).st_ino
        with self._lock:
            if self._alive:
                self._inotify.remove(self._wd)
            # Only the events that can complete a dump: not every write of a dump
            # (IN_MODIFY), nor the daemon's own reads and deletes.
            self._wd = self._inotify.add(self.dump_dir, _ARRIVALS)
            self._alive = True

    def _run(self) -> None:
        assert self._inotify is not None
        poll = select.poll()
        poll.register(self._inotify.fd, select.POLLIN)
        poll.register(self._stop_r, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poll.poll()}
            if self._stop_r in ready:
                return
            try:
                data = os.read(self._inotify.fd, 1 << 16)
            except BlockingIOError:  # read by nobody else: a spurious wakeup
                continue
            self._handle(data)

    def _handle(self, data: bytes) -> None:
        for wd, mask, name in events(data):
            if mask & _IN_Q_OVERFLOW:  # events were lost: what is there now stands for them
                for path in self.scan():
                    self._notify(path)
                continue
            with self._lock:
                current = wd == self._wd
                if current and mask & _IN_IGNORED:
                    self._alive = False
            # An ended watch's events are of a directory no longer at dump_dir.
            if current and name and not mask & (_IN_ISDIR | _IN_IGNORED):
                self._notify(os.path.join(self.dump_dir, name))

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
        if self._thread is not None:
            os.write(self._stop_w, b"x")
            self._thread.join(timeout=5)
            self._thread = None
        for fd in (self._stop_r, self._stop_w):
            if fd >= 0:
                os.close(fd)
        self._stop_r = self._stop_w = -1
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None
