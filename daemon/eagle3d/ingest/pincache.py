"""The dataset's pin and row index kept beside the journal, so that a resume does not read the
whole dataset again.

A start pins the dataset (:mod:`eagle3d.ingest.pin`: a hash of every byte) and counts its rows
(:mod:`eagle3d.ingest.lineindex`): about a CPU-second at a million rows, growing with the
dataset. Once a start is accepted, the daemon keeps both in ``dataset.e3p`` in its journal
directory (:func:`save`); the next start takes them from there (:func:`load`) instead of
reading the dataset, when the file at the dataset's path is provably the one they describe.

Provably: the same path, device, inode, size, modification *and status-change* times, and a
status-change time older than the moment the cached read began by more than :data:`RACY_NS`
(git's "racily clean" rule: the kernel stamps times at a coarse tick, so a file written in
the tick the read began could keep the times it had; one last changed well before cannot). A
rewrite that puts the modification time back (``touch -r``, ``os.utime``) still moves the
status-change time, which no user can set. The cache is a shortcut, never the truth: every
block the run reads afterwards is still checked against its pinned hash
(:class:`~eagle3d.ingest.pin.PinnedReader`), and a cache that is damaged, of another version,
format or line limit is ignored with a message and the dataset read as before.

The file: ``magic | u32 crc | u64 length``, then a msgpack :class:`Cached` (the rows' offsets
as little-endian int64 bytes); written to a temp file, synced and renamed into place.
"""

from __future__ import annotations

import os
import zlib

import msgspec
import numpy as np
from eagle3proto import sealed

from eagle3d.ingest.lineindex import Lines
from eagle3d.ingest.pin import Pin

NAME = "dataset.e3p"
MAGIC = b"E3DPIN\x00\x01"
VERSION = 1
#: How much older than the cached read's start the dataset's last change must be.
RACY_NS = 2_000_000_000
_SEED = zlib.crc32(b"eagle3d-pin-cache-v1")
_DIGEST = 8  # bytes of each block's hash (eagle3d.ingest.pin)


class Cached(msgspec.Struct, kw_only=True):
    """A pin and the rows found through it, as stored."""

    version: int
    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    taken_ns: int
    sha: str
    blocks: bytes  # the blocks' hashes, end to end
    fmt: str
    max_line: int
    rows: int
    blank: list[int]
    starts: bytes | None  # int64 little-endian, a row each (None: not kept for this format)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Cached)


def path_in(jdir: str) -> str:
    return os.path.join(jdir, NAME)


def encode(pin: Pin, fmt: str, max_line: int, lines: Lines) -> bytes:
    starts = None if lines.starts is None else np.asarray(lines.starts, "<i8").tobytes()
    c = Cached(
        version=VERSION,
        path=pin.path,
        dev=pin.dev,
        ino=pin.ino,
        size=pin.size,
        mtime_ns=pin.mtime_ns,
        ctime_ns=pin.ctime_ns,
        taken_ns=pin.taken_ns,
        sha=pin.sha,
        blocks=b"".join(pin.blocks),
        fmt=fmt,
        max_line=max_line,
        rows=lines.rows,
        blank=list(lines.blank),
        starts=starts,
    )
    payload = _encoder.encode(c)
    return sealed.seal(MAGIC, _SEED, payload)


def decode(data: bytes) -> Cached:
    """The cache in ``data``; ValueError naming what is wrong with it."""
    c = sealed.open_struct(data, MAGIC, _SEED, _decoder, VERSION)
    if len(c.blocks) % _DIGEST or (c.starts is not None and len(c.starts) != 8 * c.rows):
        raise ValueError("its blocks or row offsets are the wrong length")
    return c


def racy(ctime_ns: int, taken_ns: int) -> bool:
    """Whether a file last changed at ``ctime_ns`` and read from ``taken_ns`` on could have
    changed again within the same kernel tick, unseen by its times."""
    return ctime_ns > taken_ns - RACY_NS


def differs(c: Cached, path: str, st: os.stat_result, fmt: str, max_line: int) -> str:
    """'' when ``c`` describes the file ``path`` whose status is ``st`` (read as ``fmt``
    with ``max_line``); else why it does not."""
    if c.path != path:
        return f"it is of {c.path}"
    if (c.dev, c.ino) != (st.st_dev, st.st_ino):
        return "another file is at the dataset's path"
    if (c.size, c.mtime_ns, c.ctime_ns) != (st.st_size, st.st_mtime_ns, st.st_ctime_ns):
        return "the dataset changed since (its size or times)"
    if racy(c.ctime_ns, c.taken_ns):
        return "the dataset had changed just before it was read (its times prove nothing)"
    if (c.fmt, c.max_line) != (fmt, max_line):
        return "it was read with another format or line limit"
    return ""


def load(jdir: str, dataset: str, fmt: str, max_line: int) -> tuple[Pin, Lines] | str:
    """The dataset's pin and rows from the cache in ``jdir``, or why it was not used ('' when
    there is none)."""
    where = path_in(jdir)
    try:
        with open(where, "rb") as f:
            data = f.read()
        st = os.stat(dataset)
    except FileNotFoundError:
        return ""
    except OSError as e:
        return f"{where} was not used: {e.strerror}"
    try:
        c = decode(data)
    except ValueError as e:
        return f"{where} was not used: {e}"
    why = differs(c, os.path.abspath(dataset), st, fmt, max_line)
    if why:
        return f"{where} was not used: {why}"
    return _pin(c), _lines(c)


def _pin(c: Cached) -> Pin:
    blocks = tuple(c.blocks[i : i + _DIGEST] for i in range(0, len(c.blocks), _DIGEST))
    return Pin(c.path, c.dev, c.ino, c.size, c.mtime_ns, blocks, c.sha, c.ctime_ns, c.taken_ns)


def _lines(c: Cached) -> Lines:
    starts = None if c.starts is None else np.frombuffer(c.starts, "<i8")
    return Lines(c.rows, c.blank, starts)


def save(jdir: str, pin: Pin, fmt: str, max_line: int, lines: Lines) -> None:
    """Keep ``pin`` and ``lines`` in ``jdir`` atomically (temp file, fsync, rename, fsync
    dir)."""
    sealed.write_atomic(path_in(jdir), encode(pin, fmt, max_line, lines))  # 0640: as the journal


__all__ = ["NAME", "RACY_NS", "Cached", "differs", "load", "path_in", "racy", "save"]
