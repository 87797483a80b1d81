"""The pipeline: the one dispatcher of the daemon's messages, and the one place where the
ledger's effects are carried out, on the loop thread.

Every message of the inbox (:data:`eagle3d.run.inbox.InboxMsg`) goes through
:meth:`Pipeline.dispatch`, a ``match`` that ends in ``assert_never``: a journal record is
published, a dump's size is read, a journal fault and a signal become the ledger's words,
and every message then goes to the ledger (:meth:`eagle3d.core.ledger.Ledger.handle`).
Every effect it answers goes through :meth:`Pipeline.carry_out`, the same kind of
``match``: records to the recorder (a record it refuses goes back to the ledger), requests
to the producer, dumps to the commit scheduler, pauses to the journal and to systemd.
Effects are carried out in order; those a carried-out effect leads to are queued behind
it, so the ledger is never re-entered.

A pipeline is made whole, never wired afterwards, and twice in a run, around the same
ledger and :class:`Outlets`: from the journal's replay on with :class:`Unmade` pieces (a
signal during the start is the ledger's to judge, but the producer's requests, the commit
threads and the feeder do not exist yet), then by :func:`eagle3d.run.assemble.assemble`
with its :class:`Work` once the job is known to start; the daemon hands the inbox from the
first to the second in the step that made the pieces (see :class:`Unmade` for why the first
is never asked for them).
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
from typing import NoReturn, assert_never

from eagle3proto import events as ev

from eagle3d.core import effects as fx
from eagle3d.core import messages as m
from eagle3d.core.envfault import JOURNAL, EnvFault
from eagle3d.core.ledger import Ledger
from eagle3d.core.sample import CommitJob, Request
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
class Outlets:
    """Where the pipeline's effects go in every phase of the run: the journal (through the
    recorder), the dumps nobody asked for (``orphans``, counted for the run), sd_notify, the
    monitors (``publish``), the inbox (``post``), the daemon's end (``on_done``); the
    journal's and the dump area's folders; the clock."""

    recorder: Recorder
    orphans: Orphans
    notifier: Notifier
    publish: Callable[[ev.Event], None]
    post: Callable[[InboxMsg], None]
    journal_dir: str
    dump_dir: str
    on_done: Callable[[int], None]
    clock: Callable[[], float] = time.monotonic


@dataclass(frozen=True, slots=True)
class Work:
    """The pieces the running pipeline drives: made once the job is known to start."""

    producer: Producer
    commits: Commits
    feeder: Feeder
    last_reading: Callable[[], Awaitable[None]]  # the last stats record before run_finished
    pin: Pin | None = None  # the dataset as pinned at the start

    def batch_done(self) -> None:
        self.commits.batch_done()

    def submit(self, request: Request) -> None:
        self.producer.submit(request)

    def commit(self, job: CommitJob, forget_dirs: bool) -> None:
        self.commits.submit(job, forget_dirs)

    def taken(self) -> None:
        self.feeder.taken()

    def seen_dump(self, rid: str) -> None:
        self.producer.dump_arrived(rid)

    def cancel(self, rid: str) -> None:
        self.producer.cancel(rid)

    def widen(self, window: int) -> None:
        self.feeder.widen(window)

    def stop_feed(self) -> None:
        self.feeder.stop()

    async def last_words(self) -> m.LastReading | m.DatasetChanged:
        """The last reading taken (or given up), then the dataset's pin checked: what
        finishes the run, or what stops it (never "finished" over a dataset not the one
        read)."""
        try:  # a last reading is a nicety; finishing is not
            await self.last_reading()
        except Exception:
            log.exception("the last stats record before run_finished failed")
        changed = self.pin.changed() if self.pin is not None else ""
        return m.DatasetChanged(changed) if changed else m.LastReading()


@dataclass(frozen=True, slots=True)
class Unmade:
    """The pipeline's pieces from the journal's replay until they are made: none.

    Only a stop of the feed can be asked of them, and there is nothing to stop (no feeder
    yet: nothing reads the dataset). The rest is never asked, by the order of the start:

    * ``Committed`` comes only from the commit threads, and ``Fed``, ``DumpArrived`` and the
      tick's messages only from pieces :func:`~eagle3d.run.assemble.assemble` makes: the
      daemon hands the inbox to the running pipeline in the same step, with no ``await``
      between, so a message they put is drained there (the inbox drains on the loop).
    * The ledger answers ``Submit``, ``Commit``, ``Taken``, ``SeenDump``, ``Cancel``,
      ``Running`` and ``Finish`` only once the producer is up (it holds every message of the
      samples until then), and ``ProducerUp`` is posted only after the pieces are made; a
      replayed shard with nothing left to do ends with ``Done``, not ``Finish``.

    Each method that cannot be called says so in its type (``NoReturn``).
    """

    def batch_done(self) -> NoReturn:
        raise _unmade("a commit batch's end")

    def submit(self, request: Request) -> NoReturn:
        raise _unmade(f"the request {request.rid}")

    def commit(self, job: CommitJob, forget_dirs: bool) -> NoReturn:
        raise _unmade(f"the commit of {job.rid}")

    def taken(self) -> NoReturn:
        raise _unmade("a row taken off the feed")

    def seen_dump(self, rid: str) -> NoReturn:
        raise _unmade(f"the dump of {rid}")

    def cancel(self, rid: str) -> NoReturn:
        raise _unmade(f"the cancel of {rid}")

    def widen(self, window: int) -> NoReturn:
        raise _unmade("the running window")

    def stop_feed(self) -> None:
        """No feeder yet: nothing reads the dataset."""

    async def last_words(self) -> NoReturn:
        raise _unmade("the run's finish")


#: The pipeline's pieces: none yet (the start), or the running pipeline's.
Pieces = Unmade | Work


def _unmade(what: str) -> RuntimeError:
    return RuntimeError(f"the ledger asked for {what} before the pipeline's pieces were made")


class Pipeline:
    """Runs one shard's pipeline around ``ledger``, with ``pieces`` (see above)."""

    def __init__(self, ledger: Ledger, outlets: Outlets, pieces: Pieces) -> None:
        self.ledger = ledger
        self.outlets = outlets
        self.pieces = pieces
        self.recorder = outlets.recorder
        self.notifier = outlets.notifier
        self.clock = outlets.clock
        self._dump_read = -1.0
        self._tasks: set[asyncio.Task[None]] = set()

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
                self.outlets.publish(msg)
            case DumpArrived(path=path):
                self.dump_arrived(path, now)
            case JournalFault():
                self.journal_fault(msg, now)
            case Signalled(signum=signum):
                self.handle(m.Stop(signal.Signals(signum).name), now)
            case m.Committed():
                self.pieces.batch_done()
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
            fault = EnvFault(JOURNAL, self.outlets.journal_dir, msg.errno, msg.message)
            self.handle(m.Pause(fault), now)
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
        self.handle(m.DumpArea(diskguard.free_bytes(self.outlets.dump_dir)), now)

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
                self.pieces.submit(request)
            case fx.Commit(job=job, forget_dirs=forget_dirs):
                self.pieces.commit(job, forget_dirs)
            case fx.Taken():
                self.pieces.taken()
            case fx.Log(level=level, message=message):
                log.log(level, "%s", message)
            case fx.SeenDump(rid=rid):
                self.pieces.seen_dump(rid)
            case fx.Cancel(rid=rid):
                self.pieces.cancel(rid)
            case fx.RemoveDump(path=path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            case fx.Orphan(path=path, reason=reason):
                self.outlets.orphans.remove(path, reason)
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
                self.pieces.widen(window)
                name_threads()
            case fx.StopFeed():
                self.pieces.stop_feed()
            case fx.Finish():
                self._spawn(self._finish())
            case fx.Done(code=code):
                if self.ledger.lost:
                    self.recorder.lose(self.ledger.lost)
                self.outlets.on_done(code)
            case _:
                assert_never(e)

    async def _finish(self) -> None:
        self.outlets.post(await self.pieces.last_words())

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
