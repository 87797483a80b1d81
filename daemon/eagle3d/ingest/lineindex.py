"""A JSONL stream's rows counted at the speed of memory: the rows, the blank ones, and (for a
file that can be seeked) where each row starts, found chunk by chunk with numpy rather than a
Python step per line.

It counts exactly what :func:`eagle3d.ingest.dataformats.iter_rows` yields: a row per line
ended by ``\\n``, plus a last one not ended if it holds any byte; a row is blank when every
byte of it is ASCII white space (a BOM before the first row included) and it is no longer than
``max_line`` bytes (a longer one is read as too long, never as blank). The starts let a reader
go straight to a row (:func:`eagle3d.ingest.dataformats.rows_at`): 8 bytes a row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np

#: Bytes scanned at a time (the temporaries are a few times this).
CHUNK = 1 << 20
_BOM = b"\xef\xbb\xbf"
_WHITE = np.zeros(256, dtype=bool)
_WHITE[list(b" \t\n\r\x0b\x0c")] = True
_WHITE_BYTES = b" \t\n\r\x0b\x0c"


def _inked(b: bytes) -> bool:
    """Whether ``b`` holds a byte that is not white space."""
    return bool(b.translate(None, _WHITE_BYTES))


@dataclass(slots=True)
class Lines:
    """What :func:`scan` found."""

    rows: int
    blank: list[int]
    starts: Any = None  # int64 array: the byte offset of each row (None: not kept)


@dataclass(slots=True)
class _Scan:
    max_line: int
    keep: bool
    rows: int = 0
    pos: int = 0  # bytes consumed
    start: int = 0  # where the current row's bytes start (past a BOM)
    raw: int = 0  # where the current row starts, a BOM included
    ink: bool = False  # the current row holds a byte that is not white space
    last: int = -1  # the byte before ``pos``
    blank: list[int] = field(default_factory=list)
    starts: list[Any] = field(default_factory=list)

    def chunk(self, b: bytes) -> None:
        arr = np.frombuffer(b, dtype=np.uint8)
        nl = np.flatnonzero(arr == 10)
        if len(nl):
            self._ended(b, arr, nl)
        else:
            self.ink = self.ink or _inked(b)
        self.pos += len(b)
        self.last = b[-1]

    def _ended(self, b: bytes, arr: Any, nl: Any) -> None:
        """The rows ended in this chunk (``nl``: its newlines). A row is blank only if it is
        empty or starts with white space: only those (and the chunk's first row, which may
        have begun in an earlier chunk) are looked at one by one."""
        base = self.pos
        begin = np.concatenate(([self.start], base + nl[:-1] + 1))
        local = begin - base
        first = arr[np.clip(local, 0, len(b) - 1)]
        maybe = (local >= nl) | _WHITE[first]
        maybe[0] = True
        for j in np.flatnonzero(maybe).tolist():
            if self._blank(b, j, int(local[j]), int(nl[j])):
                self.blank.append(self.rows + j)
        if self.keep:
            self.starts.append(begin.astype(np.int64))
        self.rows += len(nl)
        self.start = self.raw = base + int(nl[-1]) + 1
        self.ink = _inked(b[int(nl[-1]) + 1 :])

    def _blank(self, b: bytes, j: int, lo: int, hi: int) -> bool:
        """Whether row ``j`` of the chunk, ending at ``b[hi]``, is blank (row 0 may have
        begun in an earlier chunk: what it held there is ``self.ink``)."""
        if j == 0:
            if self.ink:
                return False
            start, lo = self.start, max(lo, 0)
        else:
            start = self.pos + lo
        cr = (b[hi - 1] if hi > 0 else self.last) == 13
        return self.pos + hi - start - cr <= self.max_line and not _inked(b[lo:hi])

    def end(self) -> Lines:
        if self.pos > self.raw:  # a last row with no newline
            if not self.ink and self.pos - self.start <= self.max_line:
                self.blank.append(self.rows)
            if self.keep:
                self.starts.append(np.array([self.start], dtype=np.int64))
            self.rows += 1
        starts = None
        if self.keep:
            starts = np.concatenate(self.starts) if self.starts else np.zeros(0, np.int64)
        return Lines(self.rows, self.blank, starts)


def scan(
    f: IO[bytes],
    max_line: int,
    keep_starts: bool = False,
    progress: Callable[[int, int], object] | None = None,
    chunk: int = CHUNK,
) -> Lines:
    """Count the rows of the JSONL stream ``f`` (``progress(rows, bytes)`` after each chunk);
    with ``keep_starts``, each row's offset in the stream."""
    s = _Scan(max_line, keep_starts)
    head = f.read(len(_BOM))
    if head == _BOM:  # not part of the first row's bytes; a file of it alone is one row
        s.pos = s.start = len(_BOM)
        s.last = _BOM[-1]
    elif head:
        s.chunk(head)
    while b := f.read(chunk):
        s.chunk(b)
        if progress is not None:
            progress(s.rows, s.pos)
    return s.end()


__all__ = ["CHUNK", "Lines", "scan"]
