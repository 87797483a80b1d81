"""The pieces of a shard's pipeline, and the running pipeline made with them, before the
producer is up.

None of them sends anything yet but the dump watcher (a dump that appears, to the running
pipeline: the daemon moves its inbox there at once): the feeder starts reading when the
daemon says so, and the ledger holds every message of the samples until the producer is up
(:mod:`eagle3d.core.ledger`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING

from eagle3proto import paths, reducer
from eagle3proto.paths import Shard

from eagle3d import config
from eagle3d.core import outcome as oc
from eagle3d.core.ledger import Ledger, Rules
from eagle3d.core.resume import ResumeFold
from eagle3d.core.sample import PENDING, CommitJob
from eagle3d.dumps import area
from eagle3d.ingest.feeder import Feeder
from eagle3d.produce.base import Producer
from eagle3d.remote import storedtype
from eagle3d.run import diskguard, job
from eagle3d.run.commits import Commits, commit_batch
from eagle3d.run.inbox import DumpArrived, Fed, FeedFailed, Inbox
from eagle3d.run.pipeline import Outlets, Pipeline, Work
from eagle3d.run.reaper import Reaper, limit_for
from eagle3d.run.recorder import Recorder
from eagle3d.run.ticker import Ticker
from eagle3d.serve.notify import WatchdogPolicy

if TYPE_CHECKING:
    from eagle3d.store.committer import Committer

log = logging.getLogger("eagle3d")

#: Rows the feeder may have tokenized ahead of what was sent (widened to the window).
FEED_AHEAD = 8


@dataclass(slots=True)
class Opened:
    """What the start found: the job, the replayed journal, and the way to write to it."""

    facts: job.JobFacts
    resume: ResumeFold
    run_id: str
    recorder: Recorder
    identity: diskguard.OutputIdentity


@dataclass(frozen=True, slots=True)
class Assembled:
    """What :func:`assemble` made: the running pipeline, its pieces, and the tick around it."""

    pipeline: Pipeline
    work: Work
    ticker: Ticker


@dataclass(slots=True)
class Where:
    """Where the shard's run lives."""

    shard: Shard
    output: str
    journal_dir: str
    dump_dir: str


def own_dump_dir(run_id: str, shard: Shard) -> str:
    """The run's own dump folder, named after the job, on /dev/shm where it can be."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else "/tmp"
    return os.path.join(base, f"eagle3d-{os.getuid()}", f"{run_id[:8]}-{shard.name}")


#: The run's own dump folder and its parent: the daemon's alone. Its dumps are transient and
#: read by nobody else (a --group reads the committed samples, not these).
OWN_DUMP_DIR_MODE = 0o700


def make_own_dump_dir(dump_dir: str) -> None:
    """Make :func:`own_dump_dir` (and its parent) with :data:`OWN_DUMP_DIR_MODE`; a parent
    an older eagle3d left wider is narrowed (it is this user's own, by its name)."""
    parent = os.path.dirname(dump_dir)
    for d in (parent, dump_dir):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, OWN_DUMP_DIR_MODE)
        st = os.lstat(d)
        if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != OWN_DUMP_DIR_MODE:
            os.chmod(d, OWN_DUMP_DIR_MODE)


def remove_if_empty(dump_dir: str) -> None:
    """The run's own dump folder (:func:`own_dump_dir`) goes when it is empty, and its
    parent with it; a --dump-dir the operator chose is theirs (a server may share it)."""
    if not dump_dir:
        return
    for d in (dump_dir, os.path.dirname(dump_dir)):
        try:
            os.rmdir(d)
        except OSError:
            return  # not empty (dumps of another shard or job), or already gone


def producer_name(cfg: config.JobConfig) -> str:
    """The producer in words, for the messages that blame it."""
    if cfg.backend == "sglang":
        return f"the SGLang server at {cfg.server}"
    if cfg.backend == "hf":
        return f"the HF workers ({cfg.model})"
    return f"the {cfg.backend} producer"


def make_ledger(
    cfg: config.JobConfig,
    facts: job.JobFacts,
    run_id: str,
    where: Where,
    status: bytearray,
    session: int,
    drain_timeout: float,
) -> Ledger:
    """The ledger of this shard's run, as the journal's replay left ``status``."""
    rules = Rules(
        window=cfg.concurrency or 1,  # the producer's own once it is up
        max_attempts=cfg.max_attempts,
        request_timeout=cfg.request_timeout,
        drain_timeout=drain_timeout,
        max_failed_fraction=cfg.max_failed_fraction,
        dump_dir=where.dump_dir,
        dataset=cfg.dataset,
        producer=producer_name(cfg),
    )
    shard = where.shard
    return Ledger(
        status,
        range(shard.index, len(status), shard.count),
        facts.total,
        rules,
        rid_prefix=f"{run_id[:8]}-{shard.index}-",
        session=session,
        # Until the first dump says better: fp32 of every state, per token.
        bytes_per_token=float((1 + len(facts.layers)) * facts.hidden_size * 4 + 8),
    )


def assemble(
    cfg: config.JobConfig,
    opened: Opened,
    where: Where,
    producer: Producer,
    ledger: Ledger,
    outlets: Outlets,
    stack: contextlib.AsyncExitStack[bool | None],
    *,
    status: bytearray,
    inbox: Inbox,
    state: reducer.ShardState,
    watchdog: WatchdogPolicy,
) -> Assembled:
    """Make the committer, the commit threads, the feeder, the dump watcher (started: it
    removes what an earlier run left in the dump area), the running pipeline around
    ``ledger`` with them, and the ticker around ``producer`` (made, and starting, already).
    Each piece's close goes on ``stack`` as it is made: they close in the reverse order."""
    from eagle3d.dumps.watcher import DumpWatcher

    facts, rec = opened.facts, opened.recorder
    dump_area = area.read(where.dump_dir)
    committer = _committer(cfg, opened, where, dump_area)
    hint = area.advice(where.dump_dir, dump_area)
    if hint:  # where a mount option would halve what its pages cost the commits
        log.info(hint)
    reaper = Reaper(limit_for(where.dump_dir))
    stack.callback(reaper.close)

    def body(batch: list[CommitJob]) -> list[oc.AnyOutcome]:
        return commit_batch(
            batch, committer, rec, opened.identity, facts.hidden_size, facts.layers, reaper
        )

    threads = cfg.commit_thread_count()
    commits = Commits(body, inbox.put, threads, committer)
    stack.callback(commits.close)
    feeder = _feeder(cfg, facts, where, status, inbox)
    stack.callback(feeder.stop)
    watcher = DumpWatcher(where.dump_dir, lambda path: inbox.put(DumpArrived(path)))
    watcher.start()
    stack.callback(watcher.stop)
    ticker = Ticker(
        output=where.output,
        dump_dir=where.dump_dir,
        recorder=rec,
        identity=opened.identity,
        state=state,
        notifier=outlets.notifier,
        watchdog=watchdog,
        producer=producer,
        ledger=ledger,
        orphans=outlets.orphans,
        watcher=watcher,
        post=inbox.put,
        pin=facts.pin,
    )

    async def last_reading() -> None:
        await asyncio.wait_for(producer.refresh(), 5.0)
        rec.append(ticker.stats("finished"))

    work = Work(producer, commits, feeder, last_reading, facts.pin)
    for path in watcher.scan() + watcher.stale_temp_files():
        outlets.orphans.remove(path, "left by an earlier run")
    log.info(
        "committing to %s with %d threads (%s); a dump's pages %s",
        where.output,
        threads,
        "as set" if cfg.commit_threads else "one per CPU, 2 to 8: each waits on its syncs",
        "spliced into the write" if committer.splice_pages else "written from its mapping",
    )
    return Assembled(Pipeline(ledger, outlets, work), work, ticker)


def _committer(
    cfg: config.JobConfig, opened: Opened, where: Where, dump_area: area.Area | None
) -> Committer:
    from eagle3d.store.committer import Committer

    # EAGLE3D_SPLICE=0 takes the splice fast path out: for its A/B (docs/benchmarks.md).
    splice = os.environ.get("EAGLE3D_SPLICE", "1") != "0"
    store = storedtype.get(opened.facts.job.store_dtype)
    committer = Committer(
        where.output,
        store=store,
        writer=cfg.writer,
        splice=splice,
        staging=paths.staging_dir(where.output, where.shard),
        rows=opened.identity.rows,
        # EAGLE3D_SPLICE_PAGES=0 writes from the mapping in any area: for its A/B.
        splice_pages=not area.huge_pages(dump_area)
        and os.environ.get("EAGLE3D_SPLICE_PAGES", "1") != "0",
    )
    committer.warm_up()
    removed = committer.clean_temp_files()  # the staging folder only: no row folder is listed
    if removed:
        log.info("removed %d stray temp file(s) from an earlier crash", removed)
    return committer


def _feeder(
    cfg: config.JobConfig, facts: job.JobFacts, where: Where, status: bytearray, inbox: Inbox
) -> Feeder:
    shard = where.shard
    return Feeder(
        model=cfg.model,
        dataset=cfg.dataset,
        fmt=facts.fmt,
        shard_index=shard.index,
        shard_count=shard.count,
        status=status,
        max_length=cfg.max_length,
        on_overflow=cfg.on_overflow,
        put=lambda item: inbox.put(Fed(item)),
        failed=lambda why, changed: inbox.put(FeedFailed(why, changed)),
        capacity=FEED_AHEAD,
        pin=facts.pin,
        max_line=cfg.max_line_bytes,
        skip_to=_first_pending(facts, shard, status),
        journal_dir=where.journal_dir,
    )


def _first_pending(facts: job.JobFacts, shard: Shard, status: bytearray) -> tuple[int, int] | None:
    """(row id, byte offset) of the shard's first pending row, where the dataset's offsets are
    known: a resumed feeder reads from there, not through every row already saved."""
    k = status[shard.index :: shard.count].find(PENDING)
    if facts.starts is None or k < 0:
        return None
    row = shard.index + k * shard.count
    return row, int(facts.starts[row])
