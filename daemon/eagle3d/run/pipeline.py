"""The pipeline: each message from the inbox goes to the ledger; each effect it answers is
carried out here, on the loop thread.

This is the only place where the ledger's decisions meet the world: records go to the
recorder (a record it refuses goes back to the ledger), requests to the producer, dumps to
the commit scheduler, pauses to the journal and to systemd. Effects are carried out in order;
those a carried-out effect leads to are queued behind it, so the ledger is never re-entered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from eagle3proto import events as ev

from eagle3d.core import effects as fx
from eagle3d.core.envfault import JOURNAL, EnvFault
from eagle3d.core.ledger import Ledger
from eagle3d.produce.base import Producer
from eagle3d.remote.dumpfile import rid_of
from eagle3d.run import diskguard
from eagle3d.run.commits import Commits
from eagle3d.run.inbox import (
    Committed,
    DumpArrived,
    Fed,
    FeedFailed,
    JournalFault,
    RequestFailed,
    RequestsStarted,
)
from eagle3d.run.recorder import Recorder

log = logging.getLogger("eagle3d")

#: How old a reading of the dump area's free space may be when the window is asked.
DUMP_FREE_MAX_AGE_S = 0.25


class Pipeline:
    """Runs one shard's pipeline around ``ledger``."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        producer: Producer,
        recorder: Recorder,
        commits: Commits,
        journal_dir: str,
        dump_dir: str,
        notify: Callable[[str, str], None],
        stop_feed: Callable[[], None],
        take: Callable[[], None],
        last_reading: Callable[[], Awaitable[None]],
        on_done: Callable[[int], None],
        pin: Any = None,
    ) -> None:
        self.ledger = ledger
        self.producer = producer
        self.recorder = recorder
        self.commits = commits
        self.journal_dir = journal_dir
        self.dump_dir = dump_dir
        self.notify = notify
        self.stop_feed = stop_feed
        self.take = take
        self.last_reading = last_reading
        self.on_done = on_done
        self.pin = pin  # the dataset as pinned at the start (ingest.pin.Pin), or None
        self.orphans = 0
        self._dump_read = -1.0
        self._tasks: set[asyncio.Task[None]] = set()

    # -- messages ------------------------------------------------------------------------

    def handle(self, msg: object, now: float) -> None:
        """One message of the inbox (the daemon routes the rest)."""
        led = self.ledger
        if now - self._dump_read > DUMP_FREE_MAX_AGE_S:
            self.read_dump_area(now)
        if isinstance(msg, Fed):
            self.apply(led.fed(msg.item, now))
        elif isinstance(msg, DumpArrived):
            self.dump_arrived(msg.path, now)
        elif isinstance(msg, Committed):
            self.commits.batch_done()
            for p, result in msg.results:
                self.apply(led.committed(p, result, now))
        elif isinstance(msg, RequestsStarted):
            self.apply(led.started(msg.rids, now))
        elif isinstance(msg, RequestFailed):
            if msg.error == "DumpMissing":  # was the dump area full? (read it now)
                self.read_dump_area(now)
            self.apply(led.request_failed(msg.rid, msg.error, msg.message, msg.retryable, now))
        elif isinstance(msg, JournalFault):
            self.journal_fault(msg, now)
        elif isinstance(msg, FeedFailed) and msg.changed:
            self.apply(led.dataset_changed(msg.message, now))
        elif isinstance(msg, FeedFailed):
            self.apply(led.abort(f"reading the dataset failed: {msg.message}", now))
        else:  # pragma: no cover - a message type nobody handles is a bug
            log.error("unhandled message %r", msg)

    def journal_fault(self, msg: JournalFault, now: float) -> None:
        if msg.pause:
            fault = EnvFault(JOURNAL, self.journal_dir, msg.errno, msg.message)
            self.apply(self.ledger.pause(fault, now))
        else:
            self.apply(self.ledger.journal_failed(msg.message, now))

    def dump_arrived(self, path: str, now: float) -> None:
        rid = rid_of(path)
        if rid is None or not self.ledger.owns(rid):
            return
        try:
            size: int | None = os.path.getsize(path)
        except FileNotFoundError:
            size = None
        self.apply(self.ledger.dumped(rid, path, size, now))

    def read_dump_area(self, now: float) -> None:
        self._dump_read = now
        self.apply(self.ledger.observe_dump_area(diskguard.free_bytes(self.dump_dir), now))

    # -- effects ---------------------------------------------------------------------------

    def apply(self, effects: list[fx.Effect]) -> None:
        """Carry out ``effects`` in order (and whatever they lead to, after them)."""
        todo = deque(effects)
        while todo:
            e = todo.popleft()
            if isinstance(e, fx.Record):
                if not self.recorder.append(e.event):
                    todo.extend(self.ledger.refused(e.event, time.monotonic()))
            elif isinstance(e, fx.Submit):
                self.producer.submit(e.request)
            elif isinstance(e, fx.Commit):
                self.commits.submit(e.sample, e.forget_dirs)
            elif isinstance(e, fx.Taken):
                self.take()
            else:
                self._other(e)

    def _other(self, e: fx.Effect) -> None:
        if isinstance(e, fx.Log):
            log.log(e.level, "%s", e.message)
        elif isinstance(e, fx.SeenDump):
            self.producer.dump_arrived(e.rid)
        elif isinstance(e, fx.Cancel):
            self.producer.cancel(e.rid)
        elif isinstance(e, fx.RemoveDump):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(e.path)
        elif isinstance(e, fx.Orphan):
            self.orphan(e.path, e.reason)
        elif isinstance(e, fx.Paused):
            self.recorder.append_paused(ev.RunState(state="paused", reason=e.fault.reason))
            self.notify("status", f"PAUSED: {e.fault.reason}")
        elif isinstance(e, fx.Resumed):
            self.recorder.append(ev.RunState(state="running", reason=e.reason))
            self.recorder.reserve.make()
        elif isinstance(e, fx.Notify):
            self.notify(e.method, e.text)
        elif isinstance(e, fx.StopFeed):
            self.stop_feed()
        elif isinstance(e, fx.Finish):
            self._spawn(self._finish())
        elif isinstance(e, fx.Done):
            if self.ledger.lost:
                self.recorder.lose(self.ledger.lost)
            self.on_done(e.code)

    def orphan(self, path: str, reason: str) -> None:
        """Remove a dump nobody asked for, and journal that it was."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        self.orphans += 1
        self.recorder.append(ev.DumpOrphan(rid=rid_of(path) or "", path=path, reason=reason))

    async def _finish(self) -> None:
        try:  # a last reading is a nicety; finishing is not
            await self.last_reading()
        except Exception:
            log.exception("the last stats record before run_finished failed")
        changed = self.pin.changed() if self.pin is not None else ""
        if changed:  # never "finished" over a dataset that is not the one read
            self.apply(self.ledger.dataset_changed(changed, time.monotonic()))
            return
        self.apply(self.ledger.finish(time.monotonic()))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
