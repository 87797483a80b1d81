"""Reading a shard's journal: the one reader API, for the daemon's resume, its socket, the
monitor and ``verify``.

* :func:`replay` reads a shard's segments read-only, in order, and stops at the last valid
  record: a torn tail, a corrupt frame, a ``seq`` gap or a frame of another run id ends the
  replay and is reported as a :class:`Problem`, never skipped silently.
* :class:`Follower` tails a live shard without re-reading it.
* :func:`read_frames` gives a range of records as frames (a subscriber's catch-up).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Iterable
from typing import Protocol

import msgspec

from . import events as ev
from .codec import FRAME_OVERHEAD, HEADER_SIZE, TORN, SegmentHeader, Stop, encode_frame, scan

SEGMENT_SUFFIX = ".e3j"

_seq = operator.attrgetter("seq")
_run = operator.attrgetter("run")


class Problem(msgspec.Struct, frozen=True):
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


class Start(Protocol):
    """Where a replay may begin instead of the journal's start: after record ``seq`` of run
    ``run``, whose frame ends at byte ``end`` of segment ``segment`` (a file name)."""

    @property
    def run(self) -> str: ...
    @property
    def seq(self) -> int: ...
    @property
    def segment(self) -> str: ...
    @property
    def end(self) -> int: ...


class Replay(msgspec.Struct):
    """What :func:`replay` found."""

    run_id: str = ""
    next_seq: int = 0
    count: int = 0
    segments: list[str] = []
    problems: list[Problem] = []
    #: (segment path, offset of the end of its last good frame) for each segment read
    good_ends: dict[str, int] = {}

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


def replay(
    directory: str,
    sink: Callable[[list[ev.AnyEvent]], None] | None = None,
    start: Start | None = None,
) -> Replay:
    """Read every segment of a shard in order, feeding valid events to ``sink`` in batches.

    With ``start`` (a checkpoint's position, :mod:`eagle3proto.checkpoint`), only what
    follows record ``start.seq`` is read: the segments before its own are not opened, and
    its own is read from ``start.end`` on. Read-only: it never modifies the journal. The
    returned :class:`Replay` says where it stopped and why. Each segment is read a
    :data:`WINDOW` at a time: its memory does not grow with a segment's size or the job's.
    """
    out = Replay()
    segments = list_segments(directory)
    if start is not None:
        first = os.path.join(directory, start.segment)
        segments = [s for s in segments if s >= first]
        out.run_id, out.next_seq = start.run, start.seq + 1
    for i, path in enumerate(segments):
        out.segments.append(path)
        base = start.end if start is not None and i == 0 else HEADER_SIZE
        problem = _replay_segment(out, path, base, sink, last=i == len(segments) - 1)
        if problem is not None:
            out.problems.append(problem)
            if problem.fatal:
                break
    return out


#: Bytes of a segment read and scanned at a time: a replay holds this much of the journal
#: (and one record, if a record is larger), whatever the size of a segment (64 MiB) or of
#: the job. 1 MiB: a window's overhead (one read, one carry) is still noise (a 3M-record
#: journal replays in the same CPU time as with 4 MiB windows, docs/benchmarks.md), and the
#: transient it costs (the window, its payloads, their decoded events) is ~6 MB, not ~26.
WINDOW = 1 << 20


def _replay_segment(
    out: Replay,
    path: str,
    base: int,
    sink: Callable[[list[ev.AnyEvent]], None] | None,
    last: bool,
) -> Problem | None:
    """Replay one segment from byte ``base`` on into ``out`` and ``sink``; the problem that
    ended it, if any (a fatal one ends the replay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        head = os.pread(fd, HEADER_SIZE, 0)
        size = os.fstat(fd).st_size
        data_size = max(0, size - base)
        try:
            header = SegmentHeader.unpack(head)
        except ValueError as e:
            # A header is written and synced before a segment is renamed into place, so a
            # bad one is damage, not a torn write.
            return Problem(path, 0, "bad_header", str(e), len(head) + data_size, True)
        if not out.run_id:
            out.run_id = header.run_id
            out.next_seq = header.first_seq
        if header.run_id != out.run_id:
            return Problem(
                path, 0, "foreign_run", f"segment of run {header.run_id}", base + data_size, True
            )
        if base == HEADER_SIZE and header.first_seq != out.next_seq:
            detail = f"segment starts at seq {header.first_seq}, expected {out.next_seq}"
            return Problem(path, 0, "seq_gap", detail, base + data_size, True)
        tail = _scan_windows(out, path, fd, base, max(size, base), sink)
    finally:
        os.close(fd)
    if isinstance(tail, Problem):
        out.good_ends[path] = tail.offset
        return tail
    end, stop, torn_sector, size = tail
    out.good_ends[path] = end
    if stop is Stop.CLEAN:
        return None
    dropped = size - end
    if stop in TORN or (torn_sector and last):
        # A torn tail is what a crash mid-append leaves; in an older segment it can only
        # be unacknowledged bytes a crash left behind before the next start.
        return Problem(path, end, "torn", "torn tail: " + stop.value, dropped, False)
    detail = f"{stop.value} with {dropped} bytes after it"
    return Problem(path, end, "corrupt", detail, dropped, True)


def _read_window(fd: int, n: int, offset: int) -> bytes:
    """``n`` bytes of a segment at ``offset`` (fewer at its end): every read of a replay
    goes through here."""
    return os.pread(fd, n, offset)


def _scan_windows(
    out: Replay,
    path: str,
    fd: int,
    base: int,
    size: int,
    sink: Callable[[list[ev.AnyEvent]], None] | None,
) -> Problem | tuple[int, Stop, bool, int]:
    """Scan a segment's frames from ``base`` to ``size`` a :data:`WINDOW` at a time (a
    frame cut by a window's end is carried into the next), feeding them to ``sink``; a
    problem of the records (a seq gap, another run's frame), or (end of the last good
    frame, why the scan stopped there, whether the bad frame holds a zeroed sector, the
    segment's size as read). The stop is what a scan of the whole segment at once says."""
    pos, buf = base, b""  # buf: the segment's bytes from pos on, not yet scanned whole
    while True:
        want = size - pos - len(buf)
        if want > 0:
            more = _read_window(fd, min(WINDOW, want), pos + len(buf))
            if not more:  # shorter than fstat said: it was truncated meanwhile
                size = pos + len(buf)
            buf += more
        eof = pos + len(buf) >= size
        res = scan(buf)
        _, problem = _feed(out, path, res.payloads, pos, size, sink)
        if problem is not None:
            return problem
        stop = res.stop
        rest = len(buf) - res.end
        pos, buf = pos + res.end, buf[res.end :]
        if stop is Stop.CLEAN and not eof:
            continue
        if eof or stop in (Stop.BAD_LENGTH, Stop.BAD_CRC):
            return pos, stop, res.torn_sector, size
        if stop is Stop.ZEROS and rest >= FRAME_OVERHEAD:
            # A zero length here, whatever follows: a scan of the whole segment stops here
            # too, and calls it a zeroed tail only if every byte after it is zero.
            zeros = _all_zero(fd, pos + rest, size)
            return pos, Stop.ZEROS if zeros else Stop.BAD_LENGTH, False, size
        # SHORT, PAST_END, or fewer zero bytes than a frame header: the frame goes on in
        # the next window.


def _all_zero(fd: int, offset: int, size: int) -> bool:
    """Whether bytes ``offset..size`` of a segment are all zero, read a window at a time."""
    while offset < size:
        chunk = _read_window(fd, min(WINDOW, size - offset), offset)
        if not chunk:
            return True
        if any(chunk):
            return False
        offset += len(chunk)
    return True


#: Records decoded at a time: a 64 MiB segment's ~450k records decoded at once took ~500 MB;
#: 4,096 (a window holds ~6,500 records of ~160 bytes) keeps the decoded batch to a few MB.
DECODE_CHUNK = 4096


def _feed(
    out: Replay,
    path: str,
    payloads: list[bytes],
    base: int,
    size: int,
    sink: Callable[[list[ev.AnyEvent]], None] | None,
) -> tuple[int, Problem | None]:
    """Decode one segment's frames a chunk at a time into ``sink``, checking that seqs run
    on and the run is the same; (end of the last good frame, the problem that stopped it)."""
    for i in range(0, len(payloads), DECODE_CHUNK):
        batch = ev.decode_many(payloads[i : i + DECODE_CHUNK])
        good = _check_sequence(batch, out.run_id, out.next_seq)
        problem = None
        if good < len(batch):
            bad = batch[good]
            end = base + sum(len(p) + 8 for p in payloads[: i + good])
            if bad.run != out.run_id:
                reason, detail = "foreign_run", f"frame of run {bad.run or '?'} at seq {bad.seq}"
            else:
                reason = "seq_gap"
                detail = f"seq {bad.seq} where {out.next_seq + good} was expected"
            problem = Problem(path, end, reason, detail, size - end, True)
            batch = batch[:good]
        if batch:
            out.count += len(batch)
            out.next_seq += len(batch)
            if sink is not None:
                sink(batch)
        if problem is not None:
            return end, problem
    return 0, None


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

    @classmethod
    def after(cls, directory: str, start: Start) -> Follower:
        """A follower that begins after record ``start.seq`` (a checkpoint's position)."""
        fol = cls(directory)
        fol.run_id, fol.next_seq = start.run, start.seq + 1
        fol._segment = os.path.join(directory, start.segment)
        fol._offset = start.end
        return fol

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


def read_frames(directory: str, first: int, last: int) -> list[tuple[int, bytes]]:
    """Framed records ``first..last`` (inclusive) from a shard's journal, as (seq, frame):
    what the daemon's socket sends a subscriber catching up from before its in-memory tail.
    Empty when the segments' names disagree with the records they hold."""
    segments = list_segments(directory)
    starts = [int(os.path.basename(s).split(".")[0]) for s in segments]
    out: list[tuple[int, bytes]] = []
    for i, path in enumerate(segments):
        nxt = starts[i + 1] if i + 1 < len(starts) else None
        if nxt is not None and nxt <= first:
            continue
        if starts[i] > last:
            break
        res = scan(_read(path), HEADER_SIZE)
        seq = starts[i]
        for p in res.payloads:
            if first <= seq <= last:
                out.append((seq, encode_frame(bytes(p))))
            seq += 1
            if seq > last:
                break
    # Segment names are first seqs; check them against the records themselves.
    if out:
        got = ev.decode(out[0][1][8:])
        if got.seq != out[0][0]:
            return []
    return out
