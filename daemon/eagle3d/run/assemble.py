"""The pieces of a shard's pipeline, made and wired before the producer starts.

None of them sends anything yet: the feeder starts reading when the daemon says so, and the
inbox holds every pipeline message until the producer is up (:mod:`eagle3d.run.daemon`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from eagle3proto import paths, reducer
from eagle3proto.paths import Shard

from eagle3d import config
from eagle3d.core.ledger import Ledger, Rules
from eagle3d.core.resume import ResumeFold
from eagle3d.core.sample import Sample
from eagle3d.ingest.feeder import Feeder
from eagle3d.produce.base import Producer
from eagle3d.remote import storedtype
from eagle3d.run import diskguard, job
from eagle3d.run.commits import Commits, commit_batch
from eagle3d.run.inbox import DumpArrived, Fed, FeedFailed, Inbox
from eagle3d.run.pipeline import Pipeline
from eagle3d.run.reaper import Reaper, limit_for
from eagle3d.run.recorder import Recorder
from eagle3d.run.ticker import Ticker

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


@dataclass(slots=True)
class Parts:
    producer: Producer
    pipeline: Pipeline
    feeder: Feeder
    ticker: Ticker
    closers: list[Callable[[], None]] = field(default_factory=list)  # in start order


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


def assemble(
    cfg: config.JobConfig,
    opened: Opened,
    where: Where,
    producer: Producer,
    *,
    session: int,
    status: bytearray,
    inbox: Inbox,
    state: reducer.ShardState,
    notifier: Any,
    watchdog: Any,
    on_done: Callable[[int], None],
    drain_timeout: float,
) -> Parts:
    """Make the committer, the ledger and its pipeline, the commit threads, the feeder, the
    ticker and the dump watcher (started: it removes what an earlier run left in the dump
    area), around ``producer`` (made, and starting, already)."""
    import torch

    from eagle3d.dumps.watcher import DumpWatcher
    from eagle3d.store.committer import Committer

    facts, rec, identity = opened.facts, opened.recorder, opened.identity
    # The daemon's own tensor work (validate, write) is memory-bound: one intra-op thread,
    # so OpenMP spinning never steals cores from a producer on the same host.
    torch.set_num_threads(1)
    # EAGLE3D_SPLICE=0 takes the splice fast path out: for its A/B (docs/benchmarks.md).
    splice = os.environ.get("EAGLE3D_SPLICE", "1") != "0"
    store = storedtype.get(facts.job.store_dtype)
    committer = Committer(
        where.output,
        store=store,
        writer=cfg.writer,
        splice=splice,
        staging=paths.staging_dir(where.output, where.shard),
    )
    committer.warm_up()
    removed = committer.clean_temp_files()  # the staging folder only: no row folder is listed
    if removed:
        log.info("removed %d stray temp file(s) from an earlier crash", removed)
    rules = Rules(
        window=cfg.concurrency or 1,  # the producer's own once it is up
        max_attempts=cfg.max_attempts,
        request_timeout=cfg.request_timeout,
        drain_timeout=drain_timeout,
        max_failed_fraction=cfg.max_failed_fraction,
        dump_dir=where.dump_dir,
        dataset=cfg.dataset,
    )
    shard = where.shard
    ledger = Ledger(
        status,
        range(shard.index, len(status), shard.count),
        facts.total,
        rules,
        rid_prefix=f"{opened.run_id[:8]}-{shard.index}-",
        session=session,
        # Until the first dump says better: fp32 of every state, per token.
        bytes_per_token=float((1 + len(facts.layers)) * facts.hidden_size * 4 + 8),
    )

    reaper = Reaper(limit_for(where.dump_dir))

    def body(batch: list[Sample]) -> list[Any]:
        return commit_batch(
            batch, committer, rec, identity, facts.hidden_size, facts.layers, reaper
        )

    threads = cfg.commit_thread_count()
    commits = Commits(body, inbox.put, threads, committer)
    feeder = Feeder(
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
    )
    ticker = Ticker(
        output=where.output,
        dump_dir=where.dump_dir,
        recorder=rec,
        identity=identity,
        state=state,
        notifier=notifier,
        watchdog=watchdog,
        pin=facts.pin,
    )
    ticker.producer = producer

    async def last_reading() -> None:
        await asyncio.wait_for(producer.refresh(), 5.0)
        rec.append(ticker.stats("finished"))

    def notify(method: str, text: str) -> None:
        getattr(notifier, method)(*((text,) if text else ()))

    pipeline = Pipeline(
        ledger,
        producer=producer,
        recorder=rec,
        commits=commits,
        journal_dir=where.journal_dir,
        dump_dir=where.dump_dir,
        notify=notify,
        stop_feed=feeder.stop,
        take=feeder.taken,
        last_reading=last_reading,
        on_done=on_done,
        pin=facts.pin,
    )
    ticker.pipeline = pipeline
    parts = Parts(producer, pipeline, feeder, ticker, [reaper.close, commits.close, feeder.stop])
    watcher = DumpWatcher(where.dump_dir, lambda path: inbox.put(DumpArrived(path)))
    watcher.start()
    parts.closers.append(watcher.stop)
    ticker.watcher = watcher
    for path in watcher.scan() + watcher.stale_temp_files():
        pipeline.orphan(path, "left by an earlier run")
    log.info("committing to %s with %d threads", where.output, threads)
    return parts
