"""Direct I/O for committed files: a reused page-aligned buffer written as whole blocks through
an ``O_DIRECT`` descriptor, then cut back to the file's size; or a file's pages moved into
another by ``splice`` through a pipe, never passing through this process."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
from typing import Any

BLOCK = 4096  # O_DIRECT alignment of memory, offsets and lengths (covers 512 and 4K sectors)


class DirectBuffer:
    """A page-aligned buffer, reused from one ``O_DIRECT`` write to the next (one per
    commit thread: it is not thread-safe)."""

    def __init__(self) -> None:
        self._mm: mmap.mmap | None = None
        self.size = 0

    def view(self, nbytes: int) -> memoryview:
        """At least ``nbytes``, rounded up to whole blocks."""
        need = -(-nbytes // BLOCK) * BLOCK
        if need > self.size:
            # The old mapping is dropped, not closed: a view of it still alive (in a
            # traceback, say) would make close() raise, and it is unmapped once unused.
            self.size = max(need, 1 << 20)
            self._mm = mmap.mmap(-1, self.size)  # anonymous mappings are page-aligned
        assert self._mm is not None
        return memoryview(self._mm)[:need]


def write_direct(fd: int, parts: list[Any], total: int, buf: DirectBuffer) -> None:
    """Write ``parts`` (``total`` bytes) through an ``O_DIRECT`` descriptor.

    The parts are gathered into ``buf`` and written as whole blocks straight from it to
    the device, then the file is cut to ``total`` (the sync that follows covers both).
    A buffered write costs the kernel a copy into fresh page-cache pages and their
    writeback (CPU taken from a CPU producer's forward), and a job's terabytes, written
    once and never read again on this host, would push everything else out of the page
    cache. Raises OSError as the write fails (EINVAL where the filesystem refuses direct
    I/O: the caller falls back to a buffered write).
    """
    mv = buf.view(total)
    pos = 0
    for p in parts:
        b = memoryview(p).cast("B")
        mv[pos : pos + len(b)] = b
        pos += len(b)
    flush_direct(fd, mv, total)


def flush_direct(fd: int, mv: memoryview, total: int) -> None:
    """Write the first ``total`` bytes of ``mv`` (a :meth:`DirectBuffer.view`) as whole
    blocks from offset 0, cutting the file back to ``total`` if that does not fill its
    last block; for a buffered ``fd`` too."""
    if total < len(mv):  # the cut-off tail: no stale bytes, even in a temp file
        mv[total:] = bytes(len(mv) - total)
    off = 0
    while off < len(mv):
        n = os.pwrite(fd, mv[off:], off)
        if n <= 0 or n % BLOCK:  # a short direct write: only a full device gives one
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        off += n
    if total < len(mv):  # archives here are padded to whole blocks; other data may not be
        os.ftruncate(fd, total)


PIPE_BYTES = 1 << 20  # the most an unprivileged pipe holds (fs.pipe-max-size's default)


class SplicePipe:
    """A pipe that moves a file's pages into another by ``splice`` (one per commit thread,
    not thread-safe); closed when dropped."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_CLOEXEC)
        with contextlib.suppress(OSError):  # a lower fs.pipe-max-size: a smaller pipe
            fcntl.fcntl(self.w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self.size = fcntl.fcntl(self.w, fcntl.F_GETPIPE_SZ)

    def close(self) -> None:
        """Close both ends (at once)."""
        for fd in (self.r, self.w):
            if fd >= 0:
                os.close(fd)
        self.r = self.w = -1

    def __del__(self) -> None:
        self.close()


def write_spliced(
    fd: int,
    view: memoryview,
    source: int,
    copied: tuple[tuple[int, int], ...],
    total: int,
    pipe: SplicePipe,
) -> int:
    """Write the first ``total`` bytes of a file laid out as ``source`` is: the ranges in
    ``copied`` (sorted, disjoint, on block boundaries) from ``view``, everything else moved
    from the same offsets of ``source`` by ``splice`` — the kernel hands the source's
    page-cache pages to the write (``O_DIRECT``: to the device) without copying them, and
    without this process mapping, faulting or pinning them. Returns the bytes spliced.

    Raises OSError as a call fails: EINVAL where the filesystems refuse (the caller writes
    from ``view`` instead), EIO for a source shorter than ``total``. The pipe is left
    holding bytes after a failure: drop it."""
    pos = spliced = 0
    for begin, end in (*copied, (total, total)):
        if pos < begin:
            _splice_range(source, fd, pos, begin, pipe)
            spliced += begin - pos
        if begin < end:
            _pwrite_all(fd, view[begin:end], begin)
        pos = end
    return spliced


def _splice_range(source: int, fd: int, begin: int, end: int, pipe: SplicePipe) -> None:
    off = begin
    while off < end:
        n = os.splice(source, pipe.w, min(pipe.size, end - off), offset_src=off)
        if n <= 0:
            raise OSError(errno.EIO, f"the dump ends at {off}, before {end}")
        done = 0
        while done < n:
            m = os.splice(pipe.r, fd, n - done, offset_dst=off + done)
            if m <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            done += m
        off += n


def _pwrite_all(fd: int, data: memoryview, off: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, off)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        data, off = data[n:], off + n
