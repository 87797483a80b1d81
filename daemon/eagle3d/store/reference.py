"""The reference writer: ``torch.save`` through a file object that checksums what it writes
(``--writer torch``), beside the archive writer of :mod:`eagle3d.store.archive`."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from eagle3d.store.crc import crc32

if TYPE_CHECKING:
    import torch


class ChecksumWriter:
    """A write-only file object over a descriptor that checksums what passes through it.

    ``torch.save`` writes a sample in dozens of small pieces (zip headers, padding, then the
    tensor data); pieces under 1 MiB are gathered and written together, so a small sample
    costs one or two syscalls instead of fifty. Call :meth:`flush` before syncing.
    """

    BUFFER = 1 << 20

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.crc = 0
        self.size = 0
        self._buf = bytearray()

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        self.crc = crc32(mv, self.crc)
        n = len(mv)
        self.size += n
        if n < self.BUFFER:
            self._buf += mv
            if len(self._buf) >= self.BUFFER:
                self.flush()
            return n
        self.flush()
        self._write_all(mv)
        return n

    def flush(self) -> None:
        if self._buf:
            self._write_all(memoryview(self._buf))
            self._buf = bytearray()

    def _write_all(self, mv: memoryview) -> None:
        off, n = 0, len(mv)
        while off < n:
            off += os.write(self.fd, mv[off:])

    @property
    def checksum(self) -> str:
        return f"crc32:{self.crc:08x}"


def _own(t: torch.Tensor) -> torch.Tensor:
    # torch.save writes whole storages: never let a view drag a larger buffer along.
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def save(torch: Any, payload: dict[str, Any], w: ChecksumWriter) -> None:
    """``torch.save`` of ``payload`` (each tensor its own storage) that lets a failed write's OSError (and its errno) through.

    When a write fails (ENOSPC, EIO), torch's zip writer raises a RuntimeError ("unexpected
    pos") while closing, with the OSError only as its context. Without this, a full disk
    looked like an internal error: the sample was retried and then failed for good instead
    of the daemon pausing.
    """
    try:
        torch.save({k: _own(t) for k, t in payload.items()}, w)
        w.flush()
    except RuntimeError as e:
        cause: BaseException | None = e.__context__
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__context__
        if cause is not None:
            raise cause from e
        raise
