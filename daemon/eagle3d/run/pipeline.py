"""The pipeline: the one dispatcher of the daemon's messages, and the one place where the
ledger's effects are carried out, on the loop thread.

Every message of the inbox (:data:`eagle3d.run.inbox.InboxMsg`) goes through
:meth:`Pipeline.dispatch`, a ``match`` that ends in ``assert_never``: a journal record is
published, a dump's size is read, a journal fault and a signal become the ledger's words,
and every message then goes to the ledger (:meth:`eagle3d.core.ledger.Ledger.handle`).
Every effect it answers goes through :meth:`Pipeline.apply`, the same kind of ``match``:
records to the recorder (a record it refuses goes back to the ledger), requests to the
producer, dumps to the commit scheduler, pauses to the journal and to systemd. Effects are
carried out in order; those a carried-out effect leads to are queued behind it, so the
ledger is never re-entered.

The pipeline exists from the journal's replay on (a signal then stops the run); the pieces
that only the running pipeline uses (:class:`Work`: the producer, the commit threads, the
feeder) are made once the job is known to start and handed over with :meth:`Pipeline.equip`.
The ledger asks nothing of them before the producer is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import assert_never

from eagle3proto import events as ev

from eagle3d.core import effects as fx
from eagle3d.core import messages as m
from eagle3d.core.envfault import JOURNAL, EnvFault
from eagle3d.core.ledger import Ledger
from eagle3d.ingest.feeder import Feeder
from eagle3d.ingest.pin import Pin
from eagle3d.produce.base import Producer
from eagle3d.remote.dumpfile import rid_of
from eagle3d.remote.threadnames import name_threads
from eagle3d.run import diskguard
from eagle3d.run.commits import Commits
from eagle3d.run.inbox import DumpArrived, InboxMsg, JournalFault, Signalled
from eagle3d.run.orphans import Orphans
from eagle3d.run.recorder import Recorder
from eagle3d.serve.notify import Notifier

log = logging.getLogger("eagle3d")

#: How old a reading of the dump area's free space may be when the window is asked.
DUMP_FREE_MAX_AGE_S = 0.25


@dataclass(frozen=True, slots=True)
class Work:
    """What the running pipeline drives: made once the job is known to start."""

    producer: Producer
    commits: Commits
    feeder: Feeder
    last_reading: Callable[[], Awaitable[None]]  # the last stats record before run_finished
    pin: Pin | None = None  # the dataset as pinned at the start


class Pipeline:
    """Runs one shard's pipeline around ``ledger``."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        recorder: Recorder,
        notifier: Notifier,
        publish: Callable[[ev.Event], None],
        post: Callable[[InboxMsg], None],
        journal_dir: str,
        dump_dir: str,
        on_done: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ledger = ledger
        self.recorder = recorder
        self.notifier = notifier
        self.publish = publish
        self.post = post
        self.journal_dir = journal_dir
        self.dump_dir = dump_dir
        self.on_done = on_done
        self.clock = clock
        self.orphans = Orphans(recorder)
        self.work: Work | None = None
        self._dump_read = -1.0
        self._tasks: set[asyncio.Task[None]] = set()

    def equip(self, work: Work) -> None:
        """The running pieces, once made (before the producer can be up)."""
        self.work = work

    def _work(self) -> Work:
        if self.work is None:  # the ledger sends nothing before the producer is up
            raise RuntimeError("the ledger asked for the pipeline's work before it was made")
        return self.work

    # -- messages ------------------------------------------------------------------------

    def receive(self, msgs: list[InboxMsg]) -> None:
        """The inbox's burst, in order."""
        now = self.clock()
        for msg in msgs:
            self.dispatch(msg, now)

    def dispatch(self, msg: InboxMsg, now: float) -> None:
        """One message of the inbox (every kind is handled here, or mypy says which is not)."""
        stale = now - self._dump_read > DUMP_FREE_MAX_AGE_S
        if stale and self.ledger.running and not isinstance(msg, ev.Event):
            self.read_dump_area(now)
        match msg:
            case ev.Event():
                self.publish(msg)
            case DumpArrived(path=path):
                self.dump_arrived(path, now)
            case JournalFault():
                self.journal_fault(msg, now)
            case Signalled(signum=signum):
                self.handle(m.Stop(signal.Signals(signum).name), now)
            case m.Committed():
                self._work().commits.batch_done()
                self.handle(msg, now)
            case m.RequestFailed() | m.ProducerUp() | m.Tick():
                self.read_dump_area(now)  # a full dump area? the window's room? (read it now)
                self.handle(msg, now)
            case (
                m.Replayed()
                | m.ProducerStarting()
                | m.Announced()
                | m.ProducerFailed()
                | m.ProducerReport()
                | m.Stop()
                | m.Hangup()
                | m.LastReading()
                | m.Fed()
                | m.Started()
                | m.Dumped()
                | m.FeedFailed()
                | m.DatasetChanged()
                | m.DumpArea()
                | m.Pause()
                | m.Probed()
                | m.Refused()
                | m.JournalFailed()
                | m.Lose()
            ):
                self.handle(msg, now)
            case _:
                assert_never(msg)

    def handle(self, msg: m.Msg, now: float) -> None:
        """``msg`` to the ledger; what it answers, carried out."""
        self.apply(self.ledger.handle(msg, now))

    def journal_fault(self, msg: JournalFault, now: float) -> None:
        if msg.pause:
            self.handle(m.Pause(EnvFault(JOURNAL, self.journal_dir, msg.errno, msg.message)), now)
        else:
            self.handle(m.JournalFailed(msg.message), now)

    def dump_arrived(self, path: str, now: float) -> None:
        rid = rid_of(path)
        if rid is None or not self.ledger.owns(rid):
            return
        try:
            size: int | None = os.path.getsize(path)
        except FileNotFoundError:
            size = None
        self.handle(m.Dumped(rid, path, size), now)

    def read_dump_area(self, now: float) -> None:
        self._dump_read = now
        self.handle(m.DumpArea(diskguard.free_bytes(self.dump_dir)), now)

    # -- effects ---------------------------------------------------------------------------

    def apply(self, effects: list[fx.Effect]) -> None:
        """Carry out ``effects`` in order (and whatever they lead to, after them)."""
        todo = deque(effects)
        while todo:
            todo.extend(self.carry_out(todo.popleft()))

    def carry_out(self, e: fx.Effect) -> list[fx.Effect]:
        """One effect; what the ledger answers to what came of it (a refusal, a probe)."""
        match e:
            case fx.Record(event=event):
                if not self.recorder.append(event):
                    return self.ledger.handle(m.Refused(event), self.clock())
            case fx.Submit(request=request):
                self._work().producer.submit(request)
            case fx.Commit(job=job, forget_dirs=forget_dirs):
                self._work().commits.submit(job, forget_dirs)
            case fx.Taken():
                self._work().feeder.taken()
            case fx.Log(level=level, message=message):
                log.log(level, "%s", message)
            case fx.SeenDump(rid=rid):
                self._work().producer.dump_arrived(rid)
            case fx.Cancel(rid=rid):
                self._work().producer.cancel(rid)
            case fx.RemoveDump(path=path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            case fx.Orphan(path=path, reason=reason):
                self.orphans.remove(path, reason)
            case fx.Probe(probes=probes, force=force):
                results = diskguard.probe(probes)
                return self.ledger.handle(m.Probed(results, force), self.clock())
            case _:
                self._carry_out_state(e)
        return []

    def _carry_out_state(self, e: fx.StateEffect) -> None:
        """The effects on the run's state: pauses, sd_notify, the feed, the end."""
        match e:
            case fx.Paused(fault=fault):
                self.recorder.append_paused(ev.RunState(state="paused", reason=fault.reason))
                self.notifier.status(f"PAUSED: {fault.reason}")
            case fx.Resumed(reason=reason):
                self.recorder.append(ev.RunState(state="running", reason=reason))
                self.recorder.reserve.make()
            case fx.NotifyReady():
                self.notifier.ready()
            case fx.NotifyStatus(text=text):
                self.notifier.status(text)
            case fx.NotifyStopping():
                self.notifier.stopping()
            case fx.NotifyExtendTimeout(usec=usec):
                self.notifier.extend_timeout(usec)
            case fx.Running(window=window):
                self._work().feeder.widen(window)
                name_threads()
            case fx.StopFeed():
                if self.work is not None:  # no feeder yet: nothing reads the dataset
                    self.work.feeder.stop()
            case fx.Finish():
                self._spawn(self._finish())
            case fx.Done(code=code):
                if self.ledger.lost:
                    self.recorder.lose(self.ledger.lost)
                self.on_done(code)
            case _:
                assert_never(e)

    def orphan(self, path: str, reason: str) -> None:
        """Remove a dump nobody asked for, and journal that it was."""
        self.orphans.remove(path, reason)

    async def _finish(self) -> None:
        try:  # a last reading is a nicety; finishing is not
            await self._work().last_reading()
        except Exception:
            log.exception("the last stats record before run_finished failed")
        pin = self._work().pin
        changed = pin.changed() if pin is not None else ""
        # Never "finished" over a dataset that is not the one read.
        self.post(m.DatasetChanged(changed) if changed else m.LastReading())

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
