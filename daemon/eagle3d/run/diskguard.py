"""The disk and permission guard: the output's identity, the probe writes that end a pause,
free space, and the journal's reserve. The I/O of the pause rules (:mod:`eagle3d.core.pauses`).

:class:`OutputIdentity` remembers what the daemon opened (the output directory, this shard's
journal directory, the journal segment being appended to) and says what happened when the
path no longer leads there: removed, moved away, or replaced by another directory or file.
A daemon that went on would commit into a directory nobody sees, or recreate a fresh one
holding half a job. :func:`probe_write` is the test that a paused area takes writes again.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

from eagle3d.core.envfault import name
from eagle3d.core.pauses import Probe, ProbeResult
from eagle3d.store.rowdirs import RowDirs

_PROBE_BYTES = 4096
#: The journal's reserve: a small file beside it, given back on a full disk so that the
#: paused state can always be journaled (and so seen by monitors); made again on resume.
RESERVE_BYTES = 64 << 10


class OutputIdentity:
    """The identity (device, inode) of the output directory, the shard's journal directory,
    the journal's current segment and every row folder a committed file lives in
    (:attr:`rows`), as opened; :meth:`check` compares them with what is at their paths now.
    Thread-safe (commit threads check before each batch)."""

    def __init__(self, output: str, journal_dir: str, segment: Callable[[], tuple[str, int]]):
        self.output = output
        self.rows = RowDirs(output)
        self.journal_dir = journal_dir
        self._segment = segment  # (path, fd) of the segment being appended to
        self._fds: dict[str, int] = {}
        self._ids: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()
        for path in (output, journal_dir):
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            st = os.fstat(fd)
            self._fds[path] = fd
            self._ids[path] = (st.st_dev, st.st_ino)

    def check(self) -> str:
        """'' while everything is where it was; else what happened, naming the path."""
        with self._lock:
            if not self._fds:
                return ""
            problem = self._walk()
            if not problem:
                return ""
            # A move or removal can land between two steps of the walk, which then names a
            # path inside the one that changed (the journal "removed" when the output was
            # moved): walk again so that the outermost path that changed is the one named.
            return self._walk() or problem

    def _walk(self) -> str:
        for path, what in (
            (self.output, "output directory"),
            (self.journal_dir, "journal directory"),
        ):
            problem = self._check_dir(path, what)
            if problem:
                return problem
        return self._check_segment() or self.rows.check()

    def _check_dir(self, path: str, what: str) -> str:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            gone = os.fstat(self._fds[path]).st_nlink == 0
            return f"the {what} {path} was {'removed' if gone else 'moved away'} during the run"
        except OSError as e:
            return f"the {what} {path} cannot be reached ({e.strerror})"
        if (st.st_dev, st.st_ino) != self._ids[path]:
            gone = os.fstat(self._fds[path]).st_nlink == 0
            how = (
                "removed and replaced by another directory"
                if gone
                else "replaced (moved away, another directory in its place)"
            )
            return f"the {what} {path} was {how} during the run"
        return ""

    def _check_segment(self) -> str:
        path, fd = self._segment()
        if fd < 0:
            return ""
        try:
            mine = os.fstat(fd)
        except OSError:
            return ""  # closed meanwhile (rotation, shutdown): checked again next time
        try:
            st = os.stat(path)
        except FileNotFoundError:
            gone = mine.st_nlink == 0
            return f"the journal {path} was {'removed' if gone else 'moved away'} during the run"
        except OSError as e:
            return f"the journal {path} cannot be reached ({e.strerror})"
        if (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino):
            return f"the journal {path} was replaced by another file during the run"
        return ""

    def close(self) -> None:
        self.rows.close()
        with self._lock:
            for fd in self._fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._fds.clear()


def probe_write(directory: str) -> OSError | None:
    """Create, fill, sync and remove a small file in ``directory``; the error, or None."""
    path = os.path.join(directory, f".eagle3d-probe-{os.getpid()}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"\0" * _PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
    except OSError as e:
        return e
    return None


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer may still use there (0 when it cannot be read)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def probe(probes: list[Probe]) -> list[ProbeResult]:
    """Make each probe write; what came of it, with the free space there."""
    out = []
    for p in probes:
        error = probe_write(p.directory)
        why = f"{name(error.errno or 0)}: {error.strerror}" if error is not None else ""
        out.append(ProbeResult(p, error is None, free_bytes(p.directory), why))
    return out


class Reserve:
    """:data:`RESERVE_BYTES` held in a file at ``path`` while the disk has room."""

    def __init__(self, path: str) -> None:
        self.path = path

    def make(self) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, RESERVE_BYTES)
            finally:
                os.close(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(self.path)  # no room for it now: made again after the next resume

    def release(self) -> bool:
        """Give the room back; whether there was any."""
        try:
            os.unlink(self.path)
        except OSError:
            return False
        return True


__all__ = ["OutputIdentity", "Reserve", "free_bytes", "probe", "probe_write"]
