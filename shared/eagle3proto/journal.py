"""The journal: append-only segments of framed msgpack events, the source of truth.

* :class:`JournalWriter` recovers a shard (torn bytes are kept aside, then cut off), starts a
  new segment at every open and at a size cap, and group-commits: records of durable kinds
  are fdatasync'ed before :meth:`JournalWriter.append` returns, chatty ones are written at
  least every ``flush_interval`` and synced at least every ``sync_interval``.

Reading (replay, tailing, ranges of frames) is :mod:`eagle3proto.journalread`.
"""

from __future__ import annotations

import contextlib
import operator
import os
import threading
import time
import uuid
from collections.abc import Callable

from . import events as ev
from .checkpoint import Position
from .codec import SegmentHeader, encode_frame
from .fileops import OsFileOps
from .journalread import Replay, Start, replay, segment_name
from .journalrepair import repair

DEFAULT_SEGMENT_BYTES = 64 << 20


class JournalError(OSError):
    """A write or sync to the journal failed; nothing after the last good frame was kept."""


_seq = operator.attrgetter("seq")
_run = operator.attrgetter("run")


def new_run_id() -> str:
    return uuid.uuid4().hex


class JournalWriter:
    """Appends events to a shard's journal with group commit. Thread-safe.

    Args:
        directory: the shard's journal directory (created if missing).
        shard_index, shard_count: written into every segment header.
        listener: called with each event, in seq order, once it is published: chatty
            records once written, durable records once synced.
        on_position: called after each run of published events with where the last one's
            frame is (a checkpoint's position), on the same thread as ``listener``.
        clock: wall-clock source for ``ts`` (time is an argument).
        boottime: the boot clock for ``bt`` (``CLOCK_BOOTTIME``; None: not stamped). Records
            are stamped from the first ``run_started`` this writer appends on: a record
            before it would be read against the previous session's boot.
        fileops: the filesystem seam.
    """

    def __init__(
        self,
        directory: str,
        *,
        shard_index: int = 0,
        shard_count: int = 1,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        flush_interval: float = 0.1,
        sync_interval: float = 1.0,
        listener: Callable[[ev.Event], None] | None = None,
        on_position: Callable[[Position], None] | None = None,
        clock: Callable[[], float] = time.time,
        boottime: Callable[[], float] | None = None,
        fileops: OsFileOps | None = None,
        background: bool = True,
    ) -> None:
        self.directory = directory
        self.shard_index = shard_index
        self.shard_count = shard_count
        self.segment_bytes = segment_bytes
        self.flush_interval = flush_interval
        self.sync_interval = sync_interval
        self.listener = listener
        self.on_position = on_position
        # seq -> (segment name, frame start, frame end, frame crc), until published
        self._frames: dict[int, tuple[str, int, int, int]] = {}
        self.clock = clock
        self.boottime = boottime
        self._stamp_bt = False  # from this writer's first run_started on
        self.fs = fileops or OsFileOps()
        self._background = background
        self.run_id = ""
        self._lock = threading.Lock()  # seq, buffer, written offsets
        self._sync_lock = threading.Lock()  # one fdatasync at a time; taken before _lock
        self._emit_lock = threading.Lock()
        self._fd = -1
        self._segment = ""
        self._seg_size = 0
        self._next_seq = 0
        self._buf: list[bytes] = []
        self._buf_events: list[ev.Event] = []
        self._buf_bytes = 0
        self._written_seq = -1  # last seq on disk (page cache)
        self._synced_seq = -1  # last seq known durable
        self._durable_pending: list[int] = []  # durable seqs written, not yet synced
        self._unpublished: dict[int, ev.Event] = {}
        self._published_seq = -1
        self._last_sync = 0.0
        self._closed = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.sync_count = 0

    # -- opening and recovery -------------------------------------------------------------

    def open(
        self,
        sink: Callable[[list[ev.AnyEvent]], None] | None = None,
        start: Start | None = None,
    ) -> Replay:
        """Recover the shard, start a new segment, append ``recovered`` records.

        Returns what was replayed (the valid events went to ``sink``): with ``start`` (a
        checked checkpoint's position), only the records after it.
        """
        os.makedirs(self.directory, mode=0o750, exist_ok=True)
        for name in os.listdir(self.directory):
            if name.endswith(".tmp"):
                os.unlink(os.path.join(self.directory, name))
        rep = replay(self.directory, sink, start)
        self.run_id = rep.run_id or new_run_id()
        self._next_seq = rep.next_seq
        self._written_seq = self._synced_seq = self._published_seq = rep.next_seq - 1
        repairs = repair(self.directory, rep, self.fs)
        self._start_segment()
        self._closed = False
        for p in repairs:
            self.append(
                ev.Recovered(
                    segment=os.path.basename(p.segment),
                    offset=p.offset,
                    dropped_bytes=p.dropped_bytes,
                    reason=p.reason,
                    kept=p.detail,
                )
            )
        if self._background:
            self._thread = threading.Thread(target=self._run, name="journal-flush", daemon=True)
            self._thread.start()
        return rep

    def _start_segment(self) -> None:
        name = os.path.join(self.directory, segment_name(self._next_seq))
        header = SegmentHeader(
            self.run_id,
            self._next_seq,
            self.shard_index,
            self.shard_count,
            time.time_ns(),
        ).pack()
        if os.path.exists(name):
            # An earlier session opened a segment at this seq and wrote nothing valid to it.
            os.replace(name, name + f".empty-{time.time_ns()}")
        tmp = name + ".tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # left by an attempt that failed (disk full): start it again
        fd = self.fs.create_exclusive(tmp)
        try:
            if self.fs.write(fd, header) != len(header):
                raise JournalError(28, "short write of segment header", tmp)
            self.fs.fdatasync(fd)
        finally:
            self.fs.close(fd)
        self.fs.replace(tmp, name)
        self.fs.fsync_dir(self.directory)
        self._fd = self.fs.open_append(name)
        self._segment = name
        self._seg_size = len(header)

    # -- appending ------------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def append(self, event: ev.Event, durable: bool | None = None) -> ev.Event:
        """Stamp ``event`` with seq/ts/run and append it.

        Durable kinds (or ``durable=True``) return only after fdatasync covers them.

        Raises:
            JournalError: the write or sync failed (disk full, I/O error). The journal was
                cut back to its last good frame; the event was not recorded.
        """
        self.append_many([event], durable)
        return event

    def append_many(self, events: list[ev.Event], durable: bool | None = None) -> None:
        """Append ``events`` in order, as consecutive records, with one write and (when any
        is durable) one fdatasync: a commit thread's batch of ``sample_saved`` records costs
        one sync, not one each. Durability and publishing are per record, as for
        :meth:`append`; if the write or sync fails, none of them is recorded.

        Raises:
            JournalError: as :meth:`append`.
        """
        if not events:
            return
        if self._seg_size >= self.segment_bytes:
            try:
                self._rotate()
            except JournalError:
                raise
            except OSError as e:  # a new segment refused (disk full, permission removed)
                raise JournalError(
                    e.errno or 5, f"journal rotation failed: {e}", self._segment
                ) from e
        any_durable = False
        with self._lock:
            if self._closed:
                raise JournalError(9, "journal is closed")
            frames = []
            for n, event in enumerate(events):  # encode all first: a failure changes nothing
                event.seq = self._next_seq + n
                if not event.ts:
                    event.ts = self.clock()
                if self.boottime is not None and not event.bt:
                    self._stamp_bt = self._stamp_bt or isinstance(event, ev.RunStarted)
                    if self._stamp_bt:
                        event.bt = self.boottime()
                event.run = self.run_id
                frames.append(encode_frame(ev.encode(event)))
            self._next_seq += len(events)
            at = self._seg_size + self._buf_bytes
            seg = os.path.basename(self._segment)
            track = self.on_position is not None
            for event, frame in zip(events, frames, strict=True):
                if track:
                    end = at + len(frame)
                    self._frames[event.seq] = (seg, at, end, int.from_bytes(frame[:4], "little"))
                    at = end
                self._buf.append(frame)
                self._buf_events.append(event)
                self._buf_bytes += len(frame)
                if self.listener is not None:
                    self._unpublished[event.seq] = event
                if type(event).durable if durable is None else durable:
                    self._durable_pending.append(event.seq)
                    any_durable = True
            flushed = False
            if any_durable:
                self._flush_locked()
            elif self._buf_bytes >= 1 << 16:
                self._flush_locked()
                flushed = True
            seq = events[-1].seq
        if any_durable:
            self._sync_to(seq)
        elif flushed:
            # Chatty records are published once written; until a flush nothing new is.
            self._emit()

    def _flush_locked(self) -> None:
        if not self._buf:
            return
        data = b"".join(self._buf)
        good = self._seg_size
        try:
            n = self.fs.write(self._fd, data)
            if n != len(data):
                raise JournalError(28, f"short write ({n} of {len(data)} bytes)", self._segment)
        except OSError as e:
            self._undo_locked(good)
            if isinstance(e, JournalError):
                raise
            raise JournalError(e.errno or 5, f"journal write failed: {e}", self._segment) from e
        self._seg_size += n
        self._written_seq = self._buf_events[-1].seq
        self._buf.clear()
        self._buf_events.clear()
        self._buf_bytes = 0

    def _undo_locked(self, good: int) -> None:
        # Cut back to the last good frame so nothing can ever hide behind a partial one,
        # and forget the unwritten records (their callers are told by the exception).
        try:
            self.fs.ftruncate(self._fd, good)
        except OSError:
            self._closed = True  # cannot guarantee the tail: stop appending to this segment
        for e in self._buf_events:
            self._unpublished.pop(e.seq, None)
            self._frames.pop(e.seq, None)
        dropped = {e.seq for e in self._buf_events}
        self._durable_pending = [s for s in self._durable_pending if s not in dropped]
        self._next_seq = self._written_seq + 1
        self._buf.clear()
        self._buf_events.clear()
        self._buf_bytes = 0

    def _sync_to(self, seq: int) -> None:
        with self._sync_lock:
            if self._synced_seq >= seq:
                return  # another thread's fdatasync already covered us: group commit
            with self._lock:
                self._flush_locked()
                target = self._written_seq
                fd = self._fd
            try:
                self.fs.fdatasync(fd)
            except OSError as e:
                # After a failed fsync the kernel may have dropped the dirty pages; a retry
                # could falsely succeed (PostgreSQL's fsync lesson). Stop using this journal.
                with self._lock:
                    self._closed = True
                raise JournalError(e.errno or 5, f"journal fdatasync failed: {e}") from e
            self.sync_count += 1
            self._last_sync = time.monotonic()
            with self._lock:
                self._synced_seq = max(self._synced_seq, target)
                self._durable_pending = [s for s in self._durable_pending if s > target]
        self._emit()

    def _emit(self) -> None:
        with self._emit_lock:
            with self._lock:
                limit = self._written_seq
                if self._durable_pending:
                    limit = min(limit, self._durable_pending[0] - 1)
                ready: list[ev.Event] = []
                s = self._published_seq + 1
                frame = None
                while s <= limit:
                    e = self._unpublished.pop(s, None)
                    if e is not None:
                        ready.append(e)
                    frame = self._frames.pop(s, frame)
                    s += 1
                self._published_seq = max(self._published_seq, limit)
            if self.listener is not None:
                for e in ready:
                    self.listener(e)
            if self.on_position is not None and frame is not None and ready:
                seg, start, end, crc = frame
                last = ready[-1]
                self.on_position(
                    Position(run=last.run, seq=last.seq, segment=seg, start=start, end=end, crc=crc)
                )

    def flush(self) -> None:
        """Write buffered chatty records (no fsync)."""
        with self._lock:
            self._flush_locked()
        self._emit()

    def sync(self) -> None:
        """Write and fdatasync everything appended so far."""
        with self._lock:
            last = self._next_seq - 1
        if last >= 0:
            self._sync_to(last)

    def _rotate(self) -> None:
        with self._sync_lock, self._lock:
            if self._seg_size < self.segment_bytes:
                return
            self._flush_locked()
            self.fs.fdatasync(self._fd)
            self._synced_seq = self._written_seq
            self._durable_pending.clear()
            old = self._fd
            # The new segment first: if it cannot be made (disk full, permission removed),
            # the old one stays open and the next append tries again.
            self._start_segment()
            self.fs.close(old)
        self._emit()

    def _run(self) -> None:
        last_sync = time.monotonic()
        while not self._stop.wait(self.flush_interval):
            try:
                self.flush()
                now = time.monotonic()
                if now - last_sync >= self.sync_interval:
                    if self._synced_seq < self._written_seq:
                        self.sync()
                    last_sync = now
            except JournalError:
                continue  # the appender that hits it next reports it

    def segment(self) -> tuple[str, int]:
        """(path, descriptor) of the segment being appended to; descriptor -1 when closed."""
        with self._lock:
            return self._segment, (-1 if self._closed else self._fd)

    def abandon(self) -> None:
        """Stop without writing anything more: buffered chatty records are dropped. For a
        journal whose file is no longer where readers look (removed, moved, replaced)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._buf.clear()
            self._buf_events.clear()
            self._buf_bytes = 0
            if not self._closed:
                self._closed = True
                self.fs.close(self._fd)

    def close(self) -> None:
        """Sync everything and close the current segment."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._closed:
            return
        try:
            self.sync()
        finally:
            with self._lock:
                self._closed = True
                self.fs.close(self._fd)

    def __enter__(self) -> JournalWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
