"""What an output holds, as its journals say: the committed samples, never a directory listing.

:func:`read` replays every shard journal under ``OUTPUT/.eagle3d`` and folds it the way every
reader of the journal does (docs/journal.md): the latest record of a sample wins, a
``sample_saved`` makes it committed, a later ``sample_invalid`` (``verify --repair``) takes
it back, a failure after a save does not. Each committed sample carries the storage format
of the session that saved it (``job.store_dtype`` of the ``run_started`` before it), so a
reader knows how to load it without opening it first.

The reader's :class:`~eagle3d.reader.HiddenStates` dataset, ``eagle3d export`` and
``eagle3d plan`` (what a resumed job still has to write) read outputs through this module.
Pure Python (no torch).
"""

from __future__ import annotations

import os
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
                self.job = e.job
                store = e.job.store_dtype
                self.total = e.total
                self.finished = False
            elif isinstance(e, ev.RunFinished):
                self.finished = True


@dataclass(slots=True)
class Catalog:
    """Every shard of an output, folded. :attr:`entries` are the committed samples of all
    shards in sample-id order."""

    output: str
    shards: list[ShardView] = field(default_factory=list)

    @property
    def entries(self) -> list[Entry]:
        merged: dict[int, Entry] = {}
        for s in self.shards:
            merged.update(s.saved)
        return [merged[i] for i in sorted(merged)]

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
