"""A state checkpoint beside the journal: the fold of a prefix of it, so that readers replay
only the tail (etcd's snapshot + WAL, LevelDB's MANIFEST).

The file ``checkpoint.e3c`` in a shard's journal directory holds a :class:`Checkpoint`: the
:class:`~eagle3proto.reducer.ShardState` after record ``position.seq``, an opaque ``extra``
blob for the daemon's own resume fold, and the position itself (segment, the frame's offsets
and CRC). It is written whole to a temp file, synced and renamed into place, behind a header
``magic | u32 crc | u64 length`` whose CRC covers the payload.

:func:`load` accepts a checkpoint only if its checksum holds, it decodes, and the journal
still holds the very frame it names (same seq, run, offsets and CRC); anything else (missing,
damaged, from another run, ahead of a journal cut back by a crash) is refused with a
message, and the reader replays the whole journal as before. The journal stays the source
of truth: a checkpoint is only ever a shortcut to a fold the journal also gives.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from . import events as ev
from . import reducer, sealed
from .codec import HEADER_SIZE, MAX_RECORD, SegmentHeader, frame_crc

if TYPE_CHECKING:
    import threading

CHECKPOINT_NAME = "checkpoint.e3c"
MAGIC = b"E3DCKPT\x01"
#: Bumped whenever :class:`~eagle3proto.reducer.ShardState` or :class:`Checkpoint` changes
#: shape: an older file is then refused (and the journal replayed) rather than misread.
VERSION = 2
_HEAD = struct.Struct("<8sIQ")
_SEED = zlib.crc32(b"eagle3d-checkpoint-v1")
_FRAME = struct.Struct("<II")
#: How often the daemon writes one: every this many records, or this many seconds.
EVERY_RECORDS = 50_000
EVERY_SECONDS = 10.0


class Position(msgspec.Struct, frozen=True, kw_only=True):
    """Record ``seq`` of run ``run``: its frame spans ``start..end`` of ``segment`` (a file
    name in the journal directory) and carries ``crc``."""

    run: str
    seq: int
    segment: str
    start: int
    end: int
    crc: int


class Checkpoint(msgspec.Struct, kw_only=True):
    version: int
    position: Position
    ts: float  # wall clock when it was taken
    state: reducer.ShardState
    extra: bytes = b""  # the daemon's resume fold (eagle3d.core.resume)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Checkpoint)


def path_in(jdir: str) -> str:
    return os.path.join(jdir, CHECKPOINT_NAME)


def encode(ck: Checkpoint) -> bytes:
    payload = _encoder.encode(ck)
    return sealed.seal(MAGIC, _SEED, payload)


def write(jdir: str, data: bytes) -> None:
    """Put an encoded checkpoint in place atomically (temp file, fsync, rename, fsync dir)."""
    sealed.write_atomic(path_in(jdir), data)  # 0640, as the journal


class Loaded(msgspec.Struct, frozen=True):
    """What :func:`load` found: a checkpoint to start from, or why there is none."""

    checkpoint: Checkpoint | None
    note: str  # '' when one was found and checked; else why the whole journal is read

    @property
    def missing(self) -> bool:
        return self.checkpoint is None and self.note.startswith("no checkpoint")


def load(jdir: str) -> Loaded:
    """The shard's checkpoint, checked against its journal; see the module's docstring."""
    path = path_in(jdir)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return Loaded(None, f"no checkpoint in {jdir}: the whole journal is read")
    except OSError as e:
        return Loaded(None, _refused(path, f"unreadable ({e.strerror or e})"))
    why = _check_bytes(data)
    if why:
        return Loaded(None, _refused(path, why))
    try:
        ck = _decoder.decode(memoryview(data)[_HEAD.size :])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return Loaded(None, _refused(path, f"does not decode ({e})"))
    if ck.version != VERSION:
        return Loaded(None, _refused(path, f"format version {ck.version}, not {VERSION}"))
    why = _check_position(jdir, ck.position)
    if why:
        return Loaded(None, _refused(path, why))
    return Loaded(ck, "")


def _refused(path: str, why: str) -> str:
    return f"checkpoint {path} ignored: {why}; the whole journal is read"


def _check_bytes(data: bytes) -> str:
    if len(data) < _HEAD.size:
        return f"{len(data)} bytes, shorter than its header"
    magic, crc, n = _HEAD.unpack_from(data)
    if magic != MAGIC:
        return "not an eagle3d checkpoint (bad magic)"
    if n != len(data) - _HEAD.size:
        return f"payload of {len(data) - _HEAD.size} bytes where the header says {n}"
    if zlib.crc32(memoryview(data)[_HEAD.size :], _SEED) != crc:
        return "checksum mismatch"
    return ""


def _check_position(jdir: str, pos: Position) -> str:
    """'' when the journal holds the frame ``pos`` names; else what differs."""
    seg = os.path.join(jdir, pos.segment)
    n = pos.end - pos.start - _FRAME.size
    if os.path.basename(pos.segment) != pos.segment or pos.start < HEADER_SIZE:
        return f"bad position {pos.segment}@{pos.start}"
    if not 0 < n <= MAX_RECORD:
        return f"bad frame length {n} at {pos.segment}@{pos.start}"
    try:
        with open(seg, "rb") as f:
            header = SegmentHeader.unpack(f.read(HEADER_SIZE))
            f.seek(pos.start)
            frame = f.read(pos.end - pos.start)
    except FileNotFoundError:
        return f"its segment {pos.segment} is gone"
    except (OSError, ValueError) as e:
        return f"its segment {pos.segment} is unreadable ({e})"
    if header.run_id != pos.run:
        return f"its segment {pos.segment} belongs to run {header.run_id}, not {pos.run}"
    if len(frame) != pos.end - pos.start:
        return f"the journal ends before record {pos.seq} ({pos.segment}@{pos.end})"
    crc, length = _FRAME.unpack_from(frame)
    if length != n or crc != pos.crc or frame_crc(frame[4:]) != crc:
        return f"the journal holds another record at {pos.segment}@{pos.start}"
    try:
        rec = ev.decode(frame[_FRAME.size :])
    except Exception as exc:  # any decode failure means: not the record it names
        return f"record at {pos.segment}@{pos.start} does not decode ({exc})"
    if rec.seq != pos.seq or rec.run != pos.run:
        return f"the journal holds seq {rec.seq}, not {pos.seq}, at {pos.segment}@{pos.start}"
    return ""


class Checkpointer:
    """Folds the journal's published records and writes a checkpoint every
    :data:`EVERY_RECORDS` records or :data:`EVERY_SECONDS` seconds, and at :meth:`close`.

    ``fold`` folds one record into the writer's own copy of the state; ``snapshot`` gives
    that state and the ``extra`` blob, consistent with what was folded. Both are called on the
    journal's emitting thread (serialized by the journal): :meth:`on_event` for every record
    and :meth:`on_position` once after each published run of them. Encoding happens there (a
    consistent copy); the file is written by a thread of its own, latest first, so that no
    appender waits for a checkpoint's fsync.

    Until :meth:`seed` it only holds what it is given (records appended while the journal
    opens, before the resumed fold exists); ``seed`` folds those past the seed's seq.
    """

    def __init__(
        self,
        jdir: str,
        fold: Callable[[ev.Event], None],
        snapshot: Callable[[], tuple[reducer.ShardState, bytes]],
        *,
        every_records: int = EVERY_RECORDS,
        every_seconds: float = EVERY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        import threading  # the daemon's writer only: a reader (``--once``) never loads it

        self.jdir = jdir
        self._fold = fold
        self._snapshot = snapshot
        self.every_records = every_records
        self.every_seconds = every_seconds
        self._clock = clock
        self._wall = wall
        self._seeded = False
        self._early: list[ev.Event] = []
        self._since = 0
        self._last = clock()
        self._pos: Position | None = None
        self._written: Position | None = None
        self._lock = threading.Condition()
        self._pending: bytes | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self.written = 0
        self.error = ""

    def seed(self, seq: int) -> None:
        """The fold now holds the journal through ``seq``: fold what came after it."""
        early, self._early = self._early, []
        for e in early:
            if e.seq > seq:
                self._fold(e)
        self._seeded = True
        import threading

        self._thread = threading.Thread(target=self._run, name="checkpoint", daemon=True)
        self._thread.start()

    def on_event(self, e: ev.Event) -> None:
        if not self._seeded:
            self._early.append(e)
            return
        self._fold(e)
        self._since += 1

    def on_position(self, pos: Position) -> None:
        self._pos = pos
        if not self._seeded:
            return
        if self._since >= self.every_records or (
            self._since and self._clock() - self._last >= self.every_seconds
        ):
            self._take(pos)

    def _take(self, pos: Position) -> None:
        state, extra = self._snapshot()
        data = encode(
            Checkpoint(version=VERSION, position=pos, ts=self._wall(), state=state, extra=extra)
        )
        self._since = 0
        self._last = self._clock()
        with self._lock:
            self._pending = data
            self._lock.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._pending is None and not self._stop:
                    self._lock.wait()
                data, self._pending = self._pending, None
                if data is None:
                    return
            self._write(data)

    def _write(self, data: bytes) -> None:
        try:
            write(self.jdir, data)
            self.written += 1
        except OSError as e:  # a full disk: the journal is still whole, readers replay it
            self.error = f"checkpoint not written: {e}"
            with contextlib.suppress(OSError):
                os.unlink(path_in(self.jdir) + ".tmp")

    def close(self, final: bool = True) -> None:
        """Stop the writer thread; with ``final``, write a checkpoint at the last position
        first (a clean stop: the next reader replays nothing)."""
        with self._lock:
            self._stop = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            data, self._pending = self._pending, None
        if final and self._seeded and self._pos is not None and self._since:
            state, extra = self._snapshot()
            data = encode(
                Checkpoint(
                    version=VERSION, position=self._pos, ts=self._wall(), state=state, extra=extra
                )
            )
        if data is not None:
            self._write(data)
