"""Checksums of whole files as the journal records them (``crc32:%08x``), with the CRC-32 of
:mod:`eagle3d.remote.crc` (ISA-L's where installed)."""

from __future__ import annotations

import os
import threading

from eagle3d.remote.crc import ENGINE, crc32

__all__ = ["ENGINE", "crc32", "fd_checksum", "file_checksum"]


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
