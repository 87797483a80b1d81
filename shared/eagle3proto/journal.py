"""The journal: append-only segments of framed msgpack events, the source of truth.

* :func:`replay` reads a shard's segments read-only, in order, and stops at the last valid
  record: a torn tail, a corrupt frame, a ``seq`` gap or a frame of another run id ends the
  replay and is reported as a :class:`Problem`, never skipped silently.
* :class:`JournalWriter` recovers a shard (torn bytes are kept aside, then cut off), starts a
  new segment at every open and at a size cap, and group-commits: records of durable kinds
  are fdatasync'ed before :meth:`JournalWriter.append` returns, chatty ones are written at
  least every ``flush_interval`` and synced at least every ``sync_interval``.
* :class:`Follower` tails a live shard without re-reading it.
"""

from __future__ import annotations

import contextlib
import operator
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from . import events as ev
from .codec import HEADER_SIZE, TORN, SegmentHeader, Stop, encode_frame, scan
from .fileops import OsFileOps

SEGMENT_SUFFIX = ".e3j"
DEFAULT_SEGMENT_BYTES = 64 << 20


class JournalError(OSError):
    """A write or sync to the journal failed; nothing after the last good frame was kept."""


@dataclass(frozen=True, slots=True)
class Problem:
    """Why replay stopped before the end of the data (or what it had to step over)."""

    segment: str
    offset: int
    reason: str  # torn | corrupt | seq_gap | foreign_run | bad_header
    detail: str
    dropped_bytes: int
    fatal: bool  # True: nothing after this point was replayed

    def describe(self) -> str:
        name = os.path.basename(self.segment)
        return f"{name}@{self.offset}: {self.reason} ({self.detail}; {self.dropped_bytes} bytes)"


@dataclass(slots=True)
class Replay:
    """What :func:`replay` found."""

    run_id: str = ""
    next_seq: int = 0
    count: int = 0
    segments: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    #: (segment path, offset of the end of its last good frame) for each segment read
    good_ends: dict[str, int] = field(default_factory=dict)

    @property
    def stopped_early(self) -> bool:
        return any(p.fatal for p in self.problems)


def list_segments(directory: str) -> list[str]:
    """Segment files of a shard, in order (their names are the zero-padded first seq)."""
    try:
        names = [n for n in os.listdir(directory) if n.endswith(SEGMENT_SUFFIX)]
    except FileNotFoundError:
        return []
    return [os.path.join(directory, n) for n in sorted(names)]


def segment_name(first_seq: int) -> str:
    return f"{first_seq:016d}{SEGMENT_SUFFIX}"


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def replay(directory: str, sink: Callable[[list[ev.AnyEvent]], None] | None = None) -> Replay:
    """Read every segment of a shard in order, feeding valid events to ``sink`` in batches.

    Read-only: it never modifies the journal. The returned :class:`Replay` says where it
    stopped and why.
    """
    out = Replay()
    segments = list_segments(directory)
    for i, path in enumerate(segments):
        last = i == len(segments) - 1
        out.segments.append(path)
        data = _read(path)
        try:
            header = SegmentHeader.unpack(data)
        except ValueError as e:
            # A header is written and synced before a segment is renamed into place, so a
            # bad one is damage, not a torn write.
            out.problems.append(Problem(path, 0, "bad_header", str(e), len(data), True))
            break
        if not out.run_id:
            out.run_id = header.run_id
            out.next_seq = header.first_seq
        if header.run_id != out.run_id:
            out.problems.append(
                Problem(path, 0, "foreign_run", f"segment of run {header.run_id}", len(data), True)
            )
            break
        if header.first_seq != out.next_seq:
            out.problems.append(
                Problem(
                    path,
                    0,
                    "seq_gap",
                    f"segment starts at seq {header.first_seq}, expected {out.next_seq}",
                    len(data),
                    True,
                )
            )
            break
        result = scan(data, HEADER_SIZE)
        batch = ev.decode_many(result.payloads)
        end = result.end
        stop_problem: Problem | None = None
        good = _check_sequence(batch, out.run_id, out.next_seq)
        if good < len(batch):
            bad = batch[good]
            end = HEADER_SIZE + sum(len(p) + 8 for p in result.payloads[:good])
            if bad.run != out.run_id:
                reason, detail = "foreign_run", f"frame of run {bad.run or '?'} at seq {bad.seq}"
            else:
                reason = "seq_gap"
                detail = f"seq {bad.seq} where {out.next_seq + good} was expected"
            stop_problem = Problem(path, end, reason, detail, len(data) - end, True)
            batch = batch[:good]
        if batch:
            out.count += len(batch)
            out.next_seq += len(batch)
            if sink is not None:
                sink(batch)
        out.good_ends[path] = end
        if stop_problem is None and result.stop is not Stop.CLEAN:
            dropped = len(data) - end
            if result.stop in TORN or (result.torn_sector and last):
                # A torn tail is what a crash mid-append leaves; in an older segment it can
                # only be unacknowledged bytes a crash left behind before the next start.
                detail = "torn tail: " + result.stop.value
                stop_problem = Problem(path, end, "torn", detail, dropped, False)
            else:
                detail = f"{result.stop.value} with {dropped} bytes after it"
                stop_problem = Problem(path, end, "corrupt", detail, dropped, True)
        if stop_problem is not None:
            out.problems.append(stop_problem)
            if stop_problem.fatal:
                break
    return out


def _check_sequence(batch: list[ev.AnyEvent], run_id: str, first: int) -> int:
    """Number of leading events whose seq runs +1 from ``first`` and whose run matches."""
    n = len(batch)
    # Fast path in C: the whole batch is in order and of this run.
    if list(map(_seq, batch)) == list(range(first, first + n)) and all(
        map(run_id.__eq__, map(_run, batch))
    ):
        return n
    expected = first
    for i, e in enumerate(batch):
        if e.seq != expected or e.run != run_id:
            return i
        expected += 1
    return len(batch)


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
        clock: wall-clock source for ``ts`` (time is an argument).
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
        clock: Callable[[], float] = time.time,
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
        self.clock = clock
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

    def open(self, sink: Callable[[list[ev.AnyEvent]], None] | None = None) -> Replay:
        """Recover the shard, start a new segment, append ``recovered`` records.

        Returns what was replayed (the valid events went to ``sink``).
        """
        os.makedirs(self.directory, exist_ok=True)
        for name in os.listdir(self.directory):
            if name.endswith(".tmp"):
                os.unlink(os.path.join(self.directory, name))
        rep = replay(self.directory, sink)
        self.run_id = rep.run_id or new_run_id()
        self._next_seq = rep.next_seq
        self._written_seq = self._synced_seq = self._published_seq = rep.next_seq - 1
        repairs = self._repair(rep)
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

    def _repair(self, rep: Replay) -> list[Problem]:
        """Set aside everything after the last good record, then cut it off."""
        repairs: list[Problem] = []
        if not rep.problems:
            return repairs
        cut_from: str | None = None
        for p in rep.problems:
            if p.dropped_bytes == 0 and p.reason != "bad_header":
                continue
            kept = self._keep_aside(p.segment, p.offset)
            self.fs.truncate_path(p.segment, p.offset) if p.offset else None
            if p.offset == 0 or p.reason == "bad_header":
                os.replace(p.segment, p.segment + ".broken")
            repairs.append(Problem(p.segment, p.offset, p.reason, kept, p.dropped_bytes, p.fatal))
            if p.fatal:
                cut_from = p.segment
        if cut_from is not None:
            later = [s for s in list_segments(self.directory) if s > cut_from]
            for s in later:
                os.replace(s, s + ".broken")
                size = os.path.getsize(s + ".broken")
                repairs.append(Problem(s, 0, "after_corruption", s + ".broken", size, True))
        self.fs.fsync_dir(self.directory)
        return repairs

    def _keep_aside(self, path: str, offset: int) -> str:
        kept = f"{path}.broken-{offset}"
        with open(path, "rb") as src, open(kept, "wb") as dst:
            src.seek(offset)
            dst.write(src.read())
            dst.flush()
            os.fsync(dst.fileno())
        return kept

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
                event.run = self.run_id
                frames.append(encode_frame(ev.encode(event)))
            self._next_seq += len(events)
            for event, frame in zip(events, frames, strict=True):
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
                while s <= limit:
                    e = self._unpublished.pop(s, None)
                    if e is not None:
                        ready.append(e)
                    s += 1
                self._published_seq = max(self._published_seq, limit)
            if self.listener is not None:
                for e in ready:
                    self.listener(e)

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


class Follower:
    """Tails a shard's journal: each :meth:`poll` returns the events appended since the last.

    It keeps its position (segment, byte offset, next seq) and never re-reads what it has
    already returned. A newer segment is entered once the current one is complete; a torn
    tail in an abandoned segment is stepped over and reported in :attr:`problems`.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.run_id = ""
        self.next_seq = 0
        self.problems: list[Problem] = []
        self._segment = ""
        self._offset = 0
        self.stuck: Problem | None = None

    def poll(self) -> list[ev.AnyEvent]:
        out: list[ev.AnyEvent] = []
        while True:
            segments = list_segments(self.directory)
            if not self._segment:
                if not segments:
                    return out
                self._open(segments[0])
            newer = [s for s in segments if s > self._segment]
            out.extend(self._read_current(final=bool(newer)))
            if self.stuck is not None or not newer:
                return out
            self._open(newer[0])

    def _open(self, path: str) -> None:
        with open(path, "rb") as f:
            header = SegmentHeader.unpack(f.read(HEADER_SIZE))
        if not self.run_id:
            self.run_id = header.run_id
            self.next_seq = header.first_seq
        self._segment = path
        self._offset = HEADER_SIZE

    def _read_current(self, final: bool) -> list[ev.AnyEvent]:
        with open(self._segment, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        if not data:
            return []
        res = scan(data)
        batch = ev.decode_many(res.payloads)
        good = _check_sequence(batch, self.run_id, self.next_seq)
        batch = batch[:good]
        self._offset += sum(len(p) + 8 for p in res.payloads[:good])
        self.next_seq += len(batch)
        if good < len(res.payloads) or (res.stop is not Stop.CLEAN and res.stop not in TORN):
            if not (final and res.stop in TORN and good == len(res.payloads)):
                self.stuck = Problem(
                    self._segment, self._offset, "corrupt", res.stop.value, len(data), True
                )
        elif final and res.stop is not Stop.CLEAN:
            self.problems.append(
                Problem(self._segment, self._offset, "torn", res.stop.value, len(data), False)
            )
        return batch


def iter_events(directory: str) -> tuple[list[ev.AnyEvent], Replay]:
    """Convenience: replay a shard into a list (tests, small journals)."""
    out: list[ev.AnyEvent] = []
    rep = replay(directory, out.extend)
    return out, rep


def flatten(batches: Iterable[list[ev.AnyEvent]]) -> list[ev.AnyEvent]:
    return [e for b in batches for e in b]
