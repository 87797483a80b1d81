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
        ink = ~_WHITE[arr]
        nl = np.flatnonzero(arr == 10)
        if len(nl):
            self._ended(arr, ink, nl)
        else:
            self.ink = self.ink or bool(ink.any())
        self.pos += len(b)
        self.last = int(arr[-1])

    def _ended(self, arr: Any, ink: Any, nl: Any) -> None:
        """The rows ended in this chunk (``nl``: its newlines)."""
        base = self.pos
        cum = np.concatenate(([0], np.cumsum(ink, dtype=np.int64)))
        local = np.concatenate(([0], nl[:-1] + 1))
        inked = cum[nl] - cum[local] > 0
        inked[0] |= self.ink
        begin = np.concatenate(([self.start], base + nl[:-1] + 1))
        before = np.where(nl > 0, arr[np.maximum(nl - 1, 0)], self.last)
        length = base + nl - begin - (before == 13)
        blank = np.flatnonzero(~inked & (length <= self.max_line))
        self.blank.extend((blank + self.rows).tolist())
        if self.keep:
            self.starts.append(begin.astype(np.int64))
        self.rows += len(nl)
        self.start = self.raw = base + int(nl[-1]) + 1
        self.ink = bool(cum[-1] - cum[int(nl[-1]) + 1] > 0)

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
