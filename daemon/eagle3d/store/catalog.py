"""What an output holds, as its journals say: the committed samples, never a directory listing.

:func:`read` replays every shard journal under ``OUTPUT/.eagle3d`` and folds it the way every
reader of the journal does (docs/journal.md): the latest record of a sample wins, a
``sample_saved`` makes it committed, a later ``sample_invalid`` (``verify --repair``) takes
it back, a failure after a save does not. Each committed sample carries the storage format
of the session that saved it (``job.store_dtype`` of the ``run_started`` before it), so a
reader knows how to load it without opening it first.

The reader's :class:`~eagle3d.reader.HiddenStates` dataset and ``eagle3d plan`` (what a
resumed job still has to write) read outputs through :func:`read`, which keeps every committed
sample's :class:`Entry`. ``eagle3d export`` reads them through :func:`scan`, in two passes
over the journals and a few bytes a sample (:class:`Counted`), as ``eagle3d verify`` does.
Pure Python (no torch).
"""

from __future__ import annotations

import os
import zlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from eagle3proto import events as ev
from eagle3proto import paths
from eagle3proto.journalread import replay


@dataclass(frozen=True, slots=True)
class Entry:
    """One committed sample: its id, file (relative to the output), size, tokens,
    checksum, and the storage format it was saved in ('' before journals recorded it)."""

    idx: int
    path: str
    bytes: int
    tokens: int
    checksum: str
    store_dtype: str
    truncated: bool = False


@dataclass(slots=True)
class ShardView:
    """One shard's journal, folded."""

    shard: paths.Shard
    total: int = -1
    finished: bool = False
    job: ev.JobInfo | None = None  # of the last run_started
    saved: dict[int, Entry] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)  # failed for good, latest record
    problems: list[str] = field(default_factory=list)
    fatal: bool = False  # the replay stopped before the end (records after it unread)

    def session(self, e: ev.RunStarted | ev.RunFinished) -> None:
        """A session's start or end."""
        if isinstance(e, ev.RunStarted):
            self.job = e.job
            self.total = e.total
            self.finished = False
        else:
            self.finished = True

    def sink(self, batch: list[ev.AnyEvent]) -> None:
        store = self.job.store_dtype if self.job is not None else ""
        for e in batch:
            if isinstance(e, ev.SampleSaved):
                self.saved[e.idx] = Entry(
                    e.idx, e.path, e.bytes, e.tokens, e.checksum, store, e.truncated
                )
                self.failed.discard(e.idx)
            elif isinstance(e, ev.SampleInvalid):
                self.saved.pop(e.idx, None)
            elif isinstance(e, ev.SampleFailed):
                if e.idx in self.saved:
                    continue
                if e.retry:
                    self.failed.discard(e.idx)
                else:
                    self.failed.add(e.idx)
            elif isinstance(e, ev.RunStarted):
                store = e.job.store_dtype
                self.session(e)
            elif isinstance(e, ev.RunFinished):
                self.session(e)


@dataclass(slots=True)
class _Shards:
    """What every fold of an output's shards says of the output as a whole."""

    output: str
    shards: list[ShardView] = field(default_factory=list)

    @property
    def job(self) -> ev.JobInfo | None:
        """The job of the first shard's last session (every shard of an output is one
        job: the daemon refuses another layout or fingerprint)."""
        return next((s.job for s in self.shards if s.job is not None), None)

    @property
    def problems(self) -> list[str]:
        return [f"{s.shard.name}: {p}" for s in self.shards for p in s.problems]

    @property
    def finished(self) -> bool:
        return bool(self.shards) and all(s.finished for s in self.shards)

    def path(self, entry: Entry) -> str:
        return os.path.join(self.output, entry.path)


@dataclass(slots=True)
class Catalog(_Shards):
    """Every shard of an output, folded. :attr:`entries` are the committed samples of all
    shards in sample-id order."""

    @property
    def entries(self) -> list[Entry]:
        merged: dict[int, Entry] = {}
        for s in self.shards:
            merged.update(s.saved)
        return [merged[i] for i in sorted(merged)]


def checksum_key(checksum: str) -> int:
    """A journal checksum (``crc32:%08x``) as the 32-bit number it writes; any other
    spelling as the CRC-32 of its text."""
    if checksum.startswith("crc32:") and len(checksum) == 14:
        try:
            return int(checksum[6:], 16)
        except ValueError:
            pass
    return zlib.crc32(checksum.encode())


class Counted:
    """Sample id -> the ``sample_saved`` record that counts (the latest of the last shard
    that saved it, unless a ``sample_invalid`` followed): its shard's ordinal (1-based; 0:
    none) and the low 32 bits of its ``seq``. 5 bytes a sample in two arrays (6 past 255
    shards), grown as ids appear; no record is kept."""

    def __init__(self, shards: int = 1) -> None:
        self.owners = array("B" if shards < 256 else "H")
        self.seqs = array("I")

    def _grow(self, idx: int) -> None:
        n = idx + 1 - len(self.owners)
        if n > 0:
            n = max(n, len(self.owners) >> 3)  # amortized: an eighth more at a time
            self.owners.frombytes(bytes(self.owners.itemsize * n))
            self.seqs.frombytes(bytes(4 * n))

    def set(self, idx: int, ordinal: int, seq: int) -> None:
        self._grow(idx)
        self.owners[idx] = ordinal
        self.seqs[idx] = seq & 0xFFFFFFFF

    def owner(self, idx: int) -> int:
        return self.owners[idx] if idx < len(self.owners) else 0

    def counts(self, idx: int, ordinal: int, seq: int) -> bool:
        """Is this record (of shard ``ordinal``) the one that counts for sample ``idx``?"""
        return self.owner(idx) == ordinal and self.seqs[idx] == seq & 0xFFFFFFFF

    def committed(self) -> int:
        """How many samples have a record that counts."""
        return len(self.owners) - self.owners.count(0)


class _CountFold:
    """Pass 1 over one shard's journal for :func:`scan`: its sessions into ``view``, its
    commits into ``index``."""

    def __init__(self, view: ShardView, ordinal: int, index: Counted) -> None:
        self.view = view
        self.ordinal = ordinal
        self.index = index

    def sink(self, batch: list[ev.AnyEvent]) -> None:
        index, ordinal = self.index, self.ordinal
        for e in batch:
            if isinstance(e, ev.SampleSaved):
                index.set(e.idx, ordinal, e.seq)
            elif isinstance(e, ev.SampleInvalid):
                if index.owner(e.idx) == ordinal:
                    index.set(e.idx, 0, 0)
            elif isinstance(e, ev.RunStarted | ev.RunFinished):
                self.view.session(e)


@dataclass(slots=True)
class Streamed(_Shards):
    """Every shard of an output folded to a few bytes a committed sample (:func:`scan`):
    :attr:`index` says which record of each sample counts (the shards' ``saved`` stay
    empty); :meth:`each` reads the journals again for those records."""

    dirs: list[str] = field(default_factory=list)  # each shard's journal directory
    index: Counted = field(default_factory=Counted)

    def each(self, fn: Callable[[Entry], None]) -> int:
        """Call ``fn`` with each committed sample's :class:`Entry`, in journal order (shard
        by shard); how many. Records appended since :func:`scan` are not among them."""
        n = 0
        for ordinal, jdir in enumerate(self.dirs, start=1):
            fold = _EntryFold(self.index, ordinal, fn)
            replay(jdir, fold.sink)
            n += fold.n
        return n


class _EntryFold:
    """Pass 2 over one shard's journal for :meth:`Streamed.each`."""

    def __init__(self, index: Counted, ordinal: int, fn: Callable[[Entry], None]) -> None:
        self.index = index
        self.ordinal = ordinal
        self.fn = fn
        self.store = ""  # the storage dtype of the session the records are of
        self.n = 0

    def sink(self, batch: list[ev.AnyEvent]) -> None:
        for e in batch:
            if isinstance(e, ev.RunStarted):
                self.store = e.job.store_dtype
            elif isinstance(e, ev.SampleSaved) and self.index.counts(e.idx, self.ordinal, e.seq):
                self.n += 1
                self.fn(
                    Entry(e.idx, e.path, e.bytes, e.tokens, e.checksum, self.store, e.truncated)
                )


class NoJournal(FileNotFoundError):
    """The directory holds no eagle3d journal."""


def read(output: str) -> Catalog:
    """Fold the journals of ``output``. Raises NoJournal when there are none."""
    out = os.path.abspath(output)
    dirs = paths.shard_dirs(out)
    if not dirs:
        raise NoJournal(f"no eagle3d journal under {out}/{paths.STATE_DIR}")
    cat = Catalog(out)
    for shard, jdir in dirs:
        view = ShardView(shard)
        rep = replay(jdir, view.sink)
        view.problems = [p.describe() for p in rep.problems]
        view.fatal = rep.stopped_early
        cat.shards.append(view)
    return cat


def scan(output: str) -> Streamed:
    """Pass 1 over the journals of ``output`` (:class:`Streamed`). Raises NoJournal when
    there are none."""
    out = os.path.abspath(output)
    dirs = paths.shard_dirs(out)
    if not dirs:
        raise NoJournal(f"no eagle3d journal under {out}/{paths.STATE_DIR}")
    cat = Streamed(out, index=Counted(len(dirs)))
    for ordinal, (shard, jdir) in enumerate(dirs, start=1):
        view = ShardView(shard)
        rep = replay(jdir, _CountFold(view, ordinal, cat.index).sink)
        view.problems = [p.describe() for p in rep.problems]
        view.fatal = rep.stopped_early
        cat.shards.append(view)
        cat.dirs.append(jdir)
    return cat


def read_shard(output: str, shard: paths.Shard) -> ShardView | None:
    """One shard's journal folded, or None when it has none yet."""
    jdir = paths.journal_dir(os.path.abspath(output), shard)
    if not os.path.isdir(jdir):
        return None
    view = ShardView(shard)
    rep = replay(jdir, view.sink)
    view.problems = [p.describe() for p in rep.problems]
    view.fatal = rep.stopped_early
    return view
