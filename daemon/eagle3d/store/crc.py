"""CRC-32 (zlib's polynomial and values) at memory speed when ISA-L is installed.

Every committed byte passes through CRC-32 twice in a sample's life: the zip records of the
sample file carry it (``torch.load`` checks them), and ``eagle3d verify`` recomputes the
whole file's. zlib's table-driven CRC runs at 2-5 GB/s here and was a tenth of the daemon's
CPU during a run; ISA-L's (carry-less multiply) gives the same numbers an order of magnitude
faster. Without the ``isal`` package, zlib's is used: same results, only slower.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Callable
from typing import Any

crc32: Callable[[Any, int], int]
try:
    from isal.isal_zlib import crc32 as _isal_crc32
except ImportError:  # pragma: no cover - the extract extra installs isal
    crc32 = zlib.crc32
    ENGINE = "zlib"
else:
    crc32 = _isal_crc32
    ENGINE = "isal"


def file_checksum(path: str, chunk: int = 16 << 20) -> tuple[int, str]:
    """(size, checksum) of a file, ``crc32:%08x`` of its bytes: what the journal's
    ``sample_saved`` records carry (:class:`eagle3d.store.committer.ChecksumWriter`)."""
    crc = 0
    size = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        mv = memoryview(buf)
        while n := f.readinto(buf):
            crc = crc32(mv[:n], crc)
            size += n
    return size, f"crc32:{crc:08x}"


_local = threading.local()


def fd_checksum(fd: int, chunk: int = 4 << 20) -> str:
    """``crc32:%08x`` of an open file's bytes from its current offset, read into a buffer
    kept per thread (a fresh 16 MiB one per file cost more than a small file's CRC)."""
    buf: bytearray | None = getattr(_local, "buf", None)
    if buf is None or len(buf) != chunk:
        buf = _local.buf = bytearray(chunk)
    mv = memoryview(buf)
    crc = 0
    while n := os.readv(fd, [mv]):
        crc = crc32(mv[:n], crc)
    return f"crc32:{crc:08x}"
