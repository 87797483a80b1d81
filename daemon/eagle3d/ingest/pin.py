"""The dataset pinned for the life of a run: what the file was at the start, and a reader that
never hands out a byte of anything else.

:func:`take` reads the file once at the start (the job's fingerprint hashes it anyway) and
keeps its identity (device, inode, size, modification time) and a hash of each
:data:`BLOCK`-byte block. :class:`PinnedReader` is the only way the run reads the dataset
afterwards: it reads whole blocks, compares each with its pinned hash before any of its bytes
leave, never reads past the pinned size, and raises :class:`DatasetChanged` at the first
difference (a block rewritten, a file shorter than pinned). :func:`changed` compares the
identity with what the path holds now (the daemon's tick, and once more before
``run_finished``). So a dataset rewritten, truncated or appended to under a running job stops
it (exit 6) before anything read from the new content is committed, and a line is never cut
short by a file that ended early.
"""

from __future__ import annotations

import hashlib
import io
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

#: Bytes per pinned block: a hash of 8 bytes per MiB (800 KB for a 100 GB dataset).
BLOCK = 1 << 20


class DatasetChanged(RuntimeError):
    """The dataset is not what the run pinned at its start; the message names it."""


@dataclass(frozen=True, slots=True)
class Pin:
    """The dataset at ``path`` as the run found it."""

    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    blocks: tuple[bytes, ...]  # the hash of each BLOCK-byte block, the last one short
    sha: str  # blake2b-128 of the whole file (the job fingerprint's dataset_sha)
    ctime_ns: int = 0  # its status change time (eagle3d.ingest.pincache trusts a pin by it)
    taken_ns: int = 0  # the wall clock when the read began

    def changed(self) -> str:
        """'' while the path holds the pinned file unchanged; else what differs."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            return _said(self.path, f"it cannot be read any more ({e.strerror})")
        return self._differs(st)

    def _differs(self, st: os.stat_result) -> str:
        if (st.st_dev, st.st_ino) != (self.dev, self.ino):
            return _said(self.path, "another file is in its place")
        if st.st_size != self.size:
            return _said(self.path, f"{self.size} bytes at the start, {st.st_size} now")
        if st.st_mtime_ns != self.mtime_ns:
            return _said(self.path, "it was written to (its modification time moved)")
        return ""


def _said(path: str, what: str) -> str:
    return f"dataset {path} changed during the run: {what}"


def _digest(block: bytes) -> bytes:
    return hashlib.blake2b(block, digest_size=8).digest()


def take(
    path: str,
    progress: Callable[[int, int], object] | None = None,
    clock: Callable[[], int] = time.time_ns,
) -> Pin:
    """Pin the dataset at ``path``: read it whole once (``progress(bytes read, size)`` after
    each block). Raises :class:`DatasetChanged` when it changes while being read."""
    taken = clock()
    whole = hashlib.blake2b(digest_size=16)
    blocks: list[bytes] = []
    with open(path, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        size = 0
        while block := _read_block(f):
            whole.update(block)
            blocks.append(_digest(block))
            size += len(block)
            if progress is not None:
                progress(size, st.st_size)
        pin = Pin(
            os.path.abspath(path),
            st.st_dev,
            st.st_ino,
            size,
            st.st_mtime_ns,
            tuple(blocks),
            whole.hexdigest(),
            st.st_ctime_ns,
            taken,
        )
        problem = pin._differs(os.fstat(f.fileno()))
    if problem:
        raise DatasetChanged(problem)
    return pin


def _read_block(f: io.RawIOBase | io.BufferedIOBase, want: int = BLOCK) -> bytes:
    """Up to ``want`` bytes, short only at the end of the file."""
    parts: list[bytes] = []
    while want > 0:
        b = f.read(want)
        if not b:
            break
        parts.append(b)
        want -= len(b)
    return b"".join(parts)


class PinnedReader(io.RawIOBase):
    """The pinned file's bytes, each block checked against its pinned hash before it is
    handed out. Seekable (parquet reads its footer first)."""

    def __init__(self, pin: Pin) -> None:
        super().__init__()
        self.pin = pin
        self._f = open(pin.path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        problem = pin._differs(os.fstat(self._f.fileno()))
        if problem:
            self._f.close()
            raise DatasetChanged(problem)
        self._pos = 0
        self._block = -1
        self._data = b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.pin.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        if self._pos >= self.pin.size:
            return 0  # the pinned end: bytes appended since are not read
        n = self._load(self._pos // BLOCK)
        start = self._pos - self._block * BLOCK
        chunk = self._data[start : start + min(len(buffer), n - start)]
        memoryview(buffer)[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)

    def _load(self, k: int) -> int:
        """Block ``k`` read and checked; its length."""
        if k != self._block:
            self._f.seek(k * BLOCK)
            want = min(BLOCK, self.pin.size - k * BLOCK)
            data = _read_block(self._f, want)
            if len(data) != want:
                at = k * BLOCK + len(data)
                raise DatasetChanged(
                    _said(self.pin.path, f"it ends at byte {at}, not {self.pin.size}")
                )
            if _digest(data) != self.pin.blocks[k]:
                where = f"bytes {k * BLOCK}-{k * BLOCK + want - 1} differ from the start's"
                raise DatasetChanged(_said(self.pin.path, where))
            self._block, self._data = k, data
        return len(self._data)

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()


def open_pinned(pin: Pin) -> io.BufferedReader:
    """A buffered reader over :class:`PinnedReader`."""
    return io.BufferedReader(PinnedReader(pin), buffer_size=BLOCK)


__all__ = ["BLOCK", "DatasetChanged", "Pin", "PinnedReader", "open_pinned", "take"]
