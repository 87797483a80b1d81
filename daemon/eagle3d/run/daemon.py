"""The daemon's lifecycle: the order in which its pieces start and stop, and signals.

Start: preflight checks, the shard's lock, the job's facts and the journal's replay (the
resume), the fingerprint check; then the producer starts (a model load, a server to wait
for: the longest step of a short job, so it begins before anything else costly) while the
space check tokenizes the rows left and the daemon makes ``run_started``, the event socket and
the pieces of the pipeline (:mod:`eagle3d.run.assemble`), and the feeder tokenizes; once the
producer is up the pipeline runs (:mod:`eagle3d.run.pipeline` around the
:class:`~eagle3d.core.ledger.Ledger`) with the 1 s :mod:`ticker <eagle3d.run.ticker>`, until
the ledger says it is done. Nothing is sent before the space check passed and the producer is
up; the producer's own reports reach the journal after ``run_started``. Stop, in this order
(the reverse of the opening, the producer's stop pushed again once the pieces exist so that
it comes before them): the tick and the progress line, the producer (its workers finish
what they hold), the dump watcher, the feeder, the commit threads (what runs is finished),
the reaper, the socket, the run's own dump folder, the journal, the lock.

From its first second the start says what it does (:mod:`eagle3d.run.stages`: a log line per
stage, progress while the dataset is read and the space check samples it) and serves it to
monitors on the start beacon (:mod:`eagle3d.serve.beacon`, an abstract Unix socket: no file)
until the event socket is up; a signal during those reads ends the start at once.

Every outside event reaches the loop thread through one :class:`~eagle3d.run.inbox.Inbox`,
signals included (SIGTERM and SIGINT stop, SIGHUP probes a paused area now), and goes to the
one dispatcher (:meth:`eagle3d.run.pipeline.Pipeline.dispatch`) from the journal's replay
on; the :class:`~eagle3d.core.ledger.Ledger` decides what each means at every stage (a
signal before the producer is up, its reports before ``run_started``, the end). The inbox's
messages go to the pipeline made at the replay, with no pieces yet
(:class:`~eagle3d.run.pipeline.Unmade`), then, from the step that makes the pieces on, to the
running pipeline :func:`~eagle3d.run.assemble.assemble` makes around the same ledger: each
object is made with what it needs, and the daemon only moves its inbox from one to the next.
The daemon opens what the run needs, in order, each on one
:class:`contextlib.AsyncExitStack`: what is closed at the end is closed in the reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from eagle3proto import events as ev
from eagle3proto import locks, paths, reducer
from eagle3proto.journal import JournalWriter
from eagle3proto.paths import Shard

from eagle3d import config
from eagle3d.core import messages as m
from eagle3d.core import reshard
from eagle3d.core.resume import ResumeFold
from eagle3d.core.sample import SAVED, SKIPPED
from eagle3d.exitcodes import EXIT_INTERNAL, EXIT_OK, EXIT_OUTPUT, EXIT_PRODUCER, Fatal
from eagle3d.produce.base import Producer
from eagle3d.produce.factory import make_producer, starting_words
from eagle3d.remote import faults
from eagle3d.remote.threadnames import name_threads
from eagle3d.run import capture, checkpoints, diskguard, job, layout, preflight, spacecheck
from eagle3d.run import recorder as recording
from eagle3d.run.assemble import (
    Assembled,
    Opened,
    Where,
    assemble,
    make_ledger,
    make_own_dump_dir,
    own_dump_dir,
    remove_if_empty,
)
from eagle3d.run.checkpoints import Checkpoints
from eagle3d.run.inbox import Inbox, InboxMsg, ProducerPort, Signalled
from eagle3d.run.orphans import Orphans
from eagle3d.run.pipeline import Outlets, Pipeline, Unmade
from eagle3d.run.recorder import Recorder
from eagle3d.run.stages import StartStages, StartStopped
from eagle3d.serve.notify import Notifier, WatchdogPolicy

if TYPE_CHECKING:
    from eagle3d.run.keptrows import Keep
    from eagle3d.serve.beacon import StartBeacon
    from eagle3d.serve.server import EventServer

Stack = contextlib.AsyncExitStack[bool | None]
T = TypeVar("T")

log = logging.getLogger("eagle3d")


class Daemon:
    """Runs one shard of one job to completion (or to a clean stop)."""

    def __init__(self, cfg: config.JobConfig, *, drain_timeout: float = 60.0) -> None:
        self.cfg = cfg
        self.shard: Shard = cfg.shard_spec()
        self.output = os.path.abspath(cfg.output)
        self.jdir = paths.journal_dir(self.output, self.shard)
        self.drain_timeout = drain_timeout
        self.fresh = False  # a new job (no journal yet): its space check came first
        self._keep_rows: Keep | None = None  # the rows it read, kept once the start is on
        self.state = reducer.new_state()  # the journal's records folded, for subscribers
        self.status = bytearray()  # a byte per dataset row, resumed from the journal
        self.inbox = Inbox(self._receive)
        self.finished = asyncio.Event()
        self.exit_code = EXIT_INTERNAL
        # From the journal's replay on: the one the inbox's messages go to (the start's,
        # then the running one).
        self.pipeline: Pipeline | None = None
        self.server: EventServer | None = None
        self.beacon: StartBeacon | None = None
        self.notifier = Notifier.from_env()
        self.watchdog = WatchdogPolicy.from_env()
        self.stages = StartStages(self.notifier.status)  # what the start does, said
        self.stopping = asyncio.Event()  # a signal came (SIGTERM, SIGINT)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        # Handlers first: a SIGTERM during the journal replay or the model load must still
        # end in a clean stop rather than Python's default of dying on the spot. What they
        # put waits in the inbox until the ledger exists to judge it; the start's stages
        # see it at once (a long read ends at its next step: StartStopped).
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._signalled, sig)
        loop.add_signal_handler(signal.SIGHUP, self.inbox.put, m.Hangup())
        async with contextlib.AsyncExitStack() as stack:
            try:
                await self._open_beacon(stack)
                return await self._run(stack)
            except Fatal as e:
                log.error("%s", e)
                return e.code
            except StartStopped as e:
                return await self._stopped_starting(e)

    def _signalled(self, sig: int) -> None:
        self.stages.stop(signal.Signals(sig).name)
        self.stopping.set()
        self.inbox.put(Signalled(sig))

    async def _reading(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` (a read of the start: the dataset, the space check's sample) on a
        thread of its own; a signal ends the wait at once with :class:`StartStopped`. What
        it still reads is abandoned (it writes nothing; it ends at its next progress step,
        or with the process: a daemon thread)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        box: list[T] = []

        def work() -> None:
            try:
                box.append(fn(*args))
            except BaseException as e:  # handed to the loop, raised there
                _settle(loop, done, e)
            else:
                _settle(loop, done, None)

        threading.Thread(target=work, name="eagle3d-start", daemon=True).start()
        stop = asyncio.create_task(self._signal())
        await asyncio.wait({done, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not done.done():
            done.cancel()  # what the thread still says is dropped
            self.stages.check()  # the signal's StartStopped
        done.result()  # the thread's exception, if it raised
        return box[0]

    async def _signal(self) -> None:
        await self.stopping.wait()

    async def _open_beacon(self, stack: Stack) -> None:
        """The start beacon, from the first second until the event socket is up."""
        from eagle3d.serve.beacon import StartBeacon

        beacon = StartBeacon(
            paths.start_beacon_name(self.output, self.shard),
            lambda: self.stages.info(os.getpid()),
            shard=self.shard,
            output=self.output,
            host=socket.gethostname(),
        )
        if await beacon.open():
            self.beacon = beacon
            stack.push_async_callback(beacon.close)

    async def _stopped_starting(self, e: StartStopped) -> int:
        """A signal during a stage of the start: before the ledger exists nothing was
        journaled and the start ends here (exit 0, resumable); after, the ledger judged
        the signal (through the inbox) and its exit code stands."""
        if self.pipeline is None:
            log.info("%s: stopping (nothing journaled; rerun to start)", e)
            return EXIT_OK
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.finished.wait(), 5.0)
        return self.exit_code if self.finished.is_set() else EXIT_OK

    async def _run(self, stack: Stack) -> int:
        """Open what the run needs, in order (each close on ``stack``), checking between
        two steps whether the ledger already says the run is over (a signal, nothing to do)."""
        opened = await self._open(stack)
        p = self._begin(opened)
        if p.ledger.done:  # nothing left to do: the job's capture contract, if it has none
            capture.write(self.output, opened.facts.capture or {})
        await asyncio.sleep(0)  # what waited in the inbox (a signal in the replay) is judged
        if self.finished.is_set():
            return self.exit_code
        where = Where(self.shard, self.output, self.jdir, p.outlets.dump_dir)
        self.stages.begin(f"launching the producer ({self.cfg.backend})")
        producer = await self._launch(stack, opened, where)
        if not (self.cfg.no_space_check or self.fresh):  # a resumed job: what its journal left
            self.stages.begin("checking the space the job needs")
            args = (self.cfg, opened.facts, self.shard, self.output, self.status, self.stages)
            keep = await self._reading(spacecheck.check_space, *args)
            if keep is not None:  # the start goes on: its rows kept for the next one
                await asyncio.to_thread(keep.save, self.jdir)
        capture.write(self.output, opened.facts.capture or {})
        if self.finished.is_set():
            return self.exit_code
        sock = self._announce(opened, p)
        await self._start_server(stack, sock)
        if self.beacon is not None:  # monitors find the event socket (or the journal) now
            await self.beacon.close()
        if self.finished.is_set():
            return self.exit_code
        running = assemble(
            self.cfg,
            opened,
            where,
            producer.producer,
            p.ledger,
            p.outlets,
            stack,
            status=self.status,
            inbox=self.inbox,
            state=self.state,
            watchdog=self.watchdog,
        )
        # In the same step, no await between: the inbox drains on the loop, so whatever the
        # pieces just made put is handled by the pipeline that drives them.
        self.pipeline = running.pipeline
        stack.push_async_callback(producer.stop)  # before the pieces: workers finish theirs
        stack.callback(running.ticker.close)  # the progress line's last word, first
        return await self._start_and_run(stack, running, producer)

    def _journal(self, ckpts: Checkpoints) -> JournalWriter:
        """The shard's journal writer: records stamped with the wall clock and, from the
        session's ``run_started`` on, the boot clock (ages immune to wall-clock steps)."""
        return JournalWriter(
            self.jdir,
            shard_index=self.shard.index,
            shard_count=self.shard.count,
            listener=ckpts.listener,
            on_position=ckpts.on_position,
            clock=faults.wall_clock(),  # time.time, or a test's wall-clock step
            boottime=locks.boottime,
            fileops=recording.FaultFileOps(),  # a module attribute: tests slot a layer under it
        )

    async def _open(self, stack: Stack) -> Opened:
        """The checks, the lock, the job's facts, the journal replayed and open. Every check
        that can refuse a new job runs before anything is written under the output."""
        cfg = self.cfg
        self.stages.begin(f"checking the model folder {cfg.model}")
        preflight.check_model(cfg.model, weights=cfg.backend == "hf")
        preflight.check_dataset(cfg.dataset)
        facts = await self._refusals()
        self.stages.check()  # a signal before the first byte under the output: none written
        preflight.check_output(self.output, cfg.group_id())
        with preflight.layout_lock(self.output):
            # Again under the lock (a daemon of another layout may have won), and this
            # shard's lock taken inside it: from then on no other layout can start.
            others = layout.check(self.output, self.shard)
            preflight.make_dirs(self.jdir)
            lock = preflight.ShardLock(paths.lock_path(self.output, self.shard))
            lock.acquire()
        stack.callback(lock.release)
        self.stages.begin(f"reading the journal {self.jdir}")
        self.status[:] = bytearray(facts.lines)
        # Every record reaches subscribers through the inbox, and the checkpoint writer.
        ckpts = Checkpoints(self.jdir, self.inbox.put)
        journal = self._journal(ckpts)
        resume = ResumeFold(self.status, self.state)
        start = await asyncio.to_thread(checkpoints.restore, resume, self.jdir)
        journal.open(resume.sink, start)
        ckpts.seed(resume)
        stack.callback(ckpts.close)  # after the journal's last record: a clean stop's fold
        reserve = diskguard.Reserve(os.path.join(self.jdir, ".reserve"))
        recorder = Recorder(journal, self.inbox.put, reserve)
        identity = diskguard.OutputIdentity(self.output, self.jdir, journal.segment)
        stack.callback(identity.close)
        stack.callback(recorder.close)
        for i in facts.blank:  # no samples: skipped, whatever an older version made of them
            self.status[i] = SKIPPED
        self._check_row_folders(identity)
        reserve.make()
        if others:  # the shard count changed: what other layouts settled stays theirs
            facts.inherited = reshard.settle(self.status, self.shard, others)
            facts.total -= facts.inherited
            log.info("%s", layout.describe(others, self.shard, facts.inherited))
            changed = layout.check_job(others, facts.job, cfg.force_resume)
            if changed:
                log.warning("taking over a changed job because of --force-resume (%s)", changed)
            if resume.last_started is None and not layout.pending(self.status, self.shard):
                # Nothing left for this new shard: a session that does nothing, so that
                # readers see the shard (its total) before the ledger's run_finished.
                recorder.append(self._started(facts, session=1, sock="", saved=0, failed=0))
        forced = job.check_fingerprint(
            resume.last_started, facts.job, cfg.force_resume, self.output
        )
        if forced:
            log.warning("resuming a changed job because of --force-resume (%s)", forced)
        forced = capture.check(self.output, facts.capture or {}, cfg.force_resume)
        if forced:
            log.warning("resuming with a changed model (%s) because of --force-resume", forced)
        await asyncio.to_thread(job.keep_pin, facts, self.jdir, cfg.max_line_bytes)
        if self._keep_rows is not None:  # what a new job's space check read
            await asyncio.to_thread(self._keep_rows.save, self.jdir)
        return Opened(facts, resume, journal.run_id, recorder, identity)

    async def _refusals(self) -> job.JobFacts:
        """Every check that can refuse a new job, before anything is written under the
        output; the job's facts."""
        cfg = self.cfg
        layout.check(self.output, self.shard, fold=False)
        preflight.check_output_reachable(self.output)
        self.stages.begin(f"reading dataset {_described(cfg.dataset)}")
        facts = await self._reading(job.describe, cfg, self.shard, self.output, self.stages)
        # A new job (no journal of any layout): every row pending, so the space check can
        # refuse now. A resumed or resharded one is checked once its journal is read.
        self.fresh = not paths.shard_dirs(self.output)
        if self.fresh and not cfg.no_space_check:
            self.stages.begin("checking the space the job needs")
            status = bytearray(facts.lines)
            for i in facts.blank:
                status[i] = SKIPPED
            args = (cfg, facts, self.shard, self.output, status, self.stages)
            self._keep_rows = await self._reading(spacecheck.check_space, *args)
        return facts

    def _check_row_folders(self, identity: diskguard.OutputIdentity) -> None:
        """The job's row folders are real folders, and those holding samples the journal
        says are saved exist (exit 4 naming the first that is not); they are remembered."""
        status, shard, size = self.status, self.shard, paths.GROUP_SIZE
        groups = range(0, len(status), size)
        names = [paths.rows_dir(g) for g in groups]
        # A group's own rows' statuses, each searched at memory speed (no step a row).
        saved = {
            paths.rows_dir(g)
            for g in groups
            if SAVED in status[g + (shard.index - g) % shard.count : g + size : shard.count]
        }
        problem = identity.rows.adopt(names, saved)
        if problem:
            raise Fatal(EXIT_OUTPUT, problem)

    def _begin(self, opened: Opened) -> Pipeline:
        """The ledger from the journal's replay, the pipeline of the start around it (no
        pieces yet: :class:`~eagle3d.run.pipeline.Unmade`), and the inbox open to it: from
        here on the ledger judges every message (a signal during the start, too)."""
        cfg = self.cfg
        dump_dir = cfg.dump_dir or own_dump_dir(opened.run_id, self.shard)
        where = Where(self.shard, self.output, self.jdir, dump_dir)
        session = self.state.session + 1
        ledger = make_ledger(
            cfg, opened.facts, opened.run_id, where, self.status, session, self.drain_timeout
        )
        outlets = Outlets(
            recorder=opened.recorder,
            orphans=Orphans(opened.recorder),
            notifier=self.notifier,
            publish=self._published,
            post=self.inbox.put,
            journal_dir=self.jdir,
            dump_dir=dump_dir,
            on_done=self._set_done,
        )
        p = self.pipeline = Pipeline(ledger, outlets, Unmade())
        self.inbox.open(asyncio.get_running_loop())
        p.handle(m.Replayed(opened.resume.finished_last), time.monotonic())
        return p

    async def _launch(self, stack: Stack, opened: Opened, where: Where) -> ProducerStart:
        """Begin the producer's start (worker processes loading the model, or the wait for a
        server). Before this the daemon has imported nothing heavy (no torch): on a CPU the
        workers' start and the daemon's own imports then share the cores instead of taking
        turns (docs/benchmarks.md, "Whole short job")."""
        cfg, facts = self.cfg, opened.facts
        producer = make_producer(
            cfg,
            dump_dir=where.dump_dir,
            hidden_size=facts.hidden_size,
            layers=facts.layers,
            store_dtype=facts.job.store_dtype,
        )
        if not cfg.dump_dir:  # the run's own folder; a --dump-dir is the operator's
            make_own_dump_dir(where.dump_dir)
            stack.callback(remove_if_empty, where.dump_dir)
        start = ProducerStart(producer, ProducerPort(self.inbox))
        stack.push_async_callback(start.stop)  # a start refused (the space check) or cut short
        try:
            await producer.launch(start.port)
        except Exception as e:
            raise Fatal(EXIT_PRODUCER, f"producer {cfg.backend} failed to start: {e}") from e
        start.begin()
        return start

    def _announce(self, opened: Opened, p: Pipeline) -> str:
        """``run_started`` (after the records that reopen what an earlier run failed for the
        environment's fault); returns the event socket's path."""
        cfg, facts, rec = self.cfg, opened.facts, opened.recorder
        sock = cfg.socket or paths.default_socket_path(self.output, self.shard)
        reopen = opened.resume.reopening_records()
        if reopen:  # so that every reader of the journal agrees they are pending again
            rec.append_many(list(reopen))
            ids = sorted(r.idx for r in reopen)
            shown = ", ".join(map(str, ids[:10])) + (" ..." if len(ids) > 10 else "")
            log.warning(
                "%d sample(s) recorded as failed by an earlier run for a reason that was not their own (a signal, a full or unwritable disk) are retried: %s",
                len(ids),
                shown,
            )
        saved, failed = p.ledger.counts()
        started = self._started(facts, p.ledger.session, sock, saved, failed)
        if not rec.append(started):
            raise Fatal(EXIT_INTERNAL, f"the journal in {self.jdir} refused run_started")
        p.handle(m.Announced(), time.monotonic())
        log.info(
            "job %s shard %s: %d samples, %d already saved, %d failed; session %d",
            opened.run_id[:8],
            self.shard.name,
            facts.total,
            saved,
            failed,
            p.ledger.session,
        )
        if facts.blank:
            log.info("%d blank line(s) of %s skipped (no samples)", len(facts.blank), cfg.dataset)
        return sock

    def _started(
        self, facts: job.JobFacts, session: int, sock: str, saved: int, failed: int
    ) -> ev.RunStarted:
        return ev.RunStarted(
            max_failed_fraction=self.cfg.max_failed_fraction,
            space_reserve_bytes=spacecheck.reserve_bytes(self.cfg),
            job=facts.job,
            total=facts.total,
            session=session,
            pid=os.getpid(),
            pid_start=locks.start_time(os.getpid()),
            boot_id=locks.boot_id(),
            host=socket.gethostname(),
            socket=sock,
            already_saved=saved,
            already_failed=failed,
            skipped=len(facts.blank),
            dataset_pinned=True,
            inherited=facts.inherited,
        )

    async def _start_and_run(self, stack: Stack, running: Assembled, start: ProducerStart) -> int:
        """The feeder reads while the producer starts; once it is up (or failed, or a signal
        came first) the ledger knows, and the run goes on until it says it is done."""
        cfg, ticker = self.cfg, running.ticker
        running.work.feeder.start()
        phase, what = starting_words(cfg)
        running.pipeline.handle(m.ProducerStarting(cfg.backend, phase, what), time.monotonic())
        beat = asyncio.create_task(ticker.while_starting(phase))
        stop = asyncio.create_task(self.finished.wait())
        await asyncio.wait({start.task(), stop}, return_when=asyncio.FIRST_COMPLETED)
        beat.cancel()
        stop.cancel()
        if self.finished.is_set():  # a signal during the model load: the ledger stopped
            return self.exit_code
        try:
            start.task().result()
        except Exception as e:
            why = f"producer {cfg.backend} failed to start: {e}"
            self.inbox.put(m.ProducerFailed(why, EXIT_PRODUCER))
        else:
            window = cfg.concurrency or start.producer.window()
            self.inbox.put(m.ProducerUp(cfg.backend, window))
            name_threads()
            tick = asyncio.create_task(ticker.run())
            stack.callback(tick.cancel)
        await self.finished.wait()
        return self.exit_code

    def _set_done(self, code: int) -> None:
        if not self.finished.is_set():
            self.exit_code = code
            self.finished.set()

    async def _start_server(self, stack: Stack, sock: str) -> None:
        from eagle3d.serve.server import EventServer

        server = EventServer(
            sock,
            journal_dir=self.jdir,
            snapshot=lambda: self.state,
            shard=self.shard,
            output=self.output,
            host=socket.gethostname(),
            gid=self.cfg.group_id(),
        )
        try:
            await server.start()
        except Exception as e:
            log.warning("no live socket at %s: %s (monitors fall back to the journal)", sock, e)
            return
        self.server = server
        stack.push_async_callback(self._close_server, server)

    async def _close_server(self, server: EventServer) -> None:
        await asyncio.sleep(0)  # the journal's last records reach subscribers
        with contextlib.suppress(Exception):
            await server.close()

    # -- the inbox -----------------------------------------------------------------------

    def _receive(self, msgs: list[InboxMsg]) -> None:
        """The inbox's burst, to the one dispatcher (the inbox opens once it exists)."""
        assert self.pipeline is not None
        self.pipeline.receive(msgs)

    def _published(self, e: ev.Event) -> None:
        """A record the journal holds (its listener, through the inbox): folded into the
        state subscribers see, and sent to them."""
        reducer.apply(self.state, e)
        if self.server is not None:
            self.server.publish(e)


def _settle(
    loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None], error: BaseException | None
) -> None:
    """A thread's end to its future, on the loop (gone already: nobody waits)."""

    def put() -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(None)

    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(put)


def _described(path: str) -> str:
    """``big.jsonl (188.29 MB)``: the dataset as its stage names it."""
    from eagle3d.store.sizing import size

    try:
        return f"{os.path.basename(path)} ({size(os.path.getsize(path))})"
    except OSError:
        return os.path.basename(path)


class ProducerStart:
    """The producer and its start, stopped once: the stop has two places in the daemon's
    stack (a start cut short before the pipeline's pieces exist; the pipeline's end, before
    them), and whichever comes first stops it."""

    def __init__(self, producer: Producer, port: ProducerPort) -> None:
        self.producer = producer
        self.port = port
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    def begin(self) -> None:
        self._task = asyncio.create_task(self.producer.start(self.port))

    def task(self) -> asyncio.Task[None]:
        assert self._task is not None  # begun by the daemon's _launch
        return self._task

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._task is not None and not self._task.done():
            self._task.cancel()  # a start refused (the space check) or stopped midway
            with contextlib.suppress(BaseException):
                await self._task
        with contextlib.suppress(Exception):
            await self.producer.stop()


__all__ = ["Daemon"]
