"""Direct I/O for committed files: a reused page-aligned buffer written as whole blocks through
an ``O_DIRECT`` descriptor, then cut back to the file's size."""

from __future__ import annotations

import errno
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
