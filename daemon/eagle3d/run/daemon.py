"""The daemon's lifecycle: the order in which its pieces start and stop, and signals.

Start: preflight checks, the shard's lock, the job's facts and the journal's replay (the
resume), the fingerprint check; then the producer starts (a model load, a server to wait
for: the longest step of a short job, so it begins before anything else costly) while the
space check tokenizes the rows left and the daemon makes ``run_started``, the event socket and
the pieces of the pipeline (:mod:`eagle3d.run.assemble`), and the feeder tokenizes; once the
producer is up the pipeline runs (:mod:`eagle3d.run.pipeline` around the
:class:`~eagle3d.core.ledger.Ledger`) with the 1 s :mod:`ticker <eagle3d.run.ticker>`, until
the ledger says it is done. Nothing is sent before the space check passed and the producer is
up; the producer's own reports reach the journal after ``run_started``. Stop, in this order: the progress
line, the producer (its workers finish what they hold), the dump watcher, the feeder, the
commit threads (what runs is finished), the journal, the socket, the lock.

Every outside event reaches the loop thread through one :class:`~eagle3d.run.inbox.Inbox`,
signals included (SIGTERM and SIGINT stop, SIGHUP probes a paused area now).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import time
from typing import Any

from eagle3proto import events as ev
from eagle3proto import paths, reducer
from eagle3proto.journal import JournalWriter
from eagle3proto.paths import Shard

from eagle3d import config
from eagle3d.core.resume import ResumeFold, describe_counts, finish_code, outcome_words
from eagle3d.core.sample import FAILED, PENDING, SAVED, SKIPPED
from eagle3d.exitcodes import EXIT_INTERNAL, EXIT_OK, EXIT_PRODUCER, Fatal
from eagle3d.produce.base import Producer
from eagle3d.produce.factory import make_producer, starting_words
from eagle3d.remote.threadnames import name_threads
from eagle3d.run import checkpoints, diskguard, job, preflight, spacecheck
from eagle3d.run import recorder as recording
from eagle3d.run.assemble import Opened, Parts, Where, assemble, own_dump_dir, remove_if_empty
from eagle3d.run.checkpoints import Checkpoints
from eagle3d.run.inbox import Hangup, Inbox, JournalFault, ProducerPort, ProducerState, Signalled
from eagle3d.run.recorder import Recorder

log = logging.getLogger("eagle3d")


class Daemon:
    """Runs one shard of one job to completion (or to a clean stop)."""

    def __init__(self, cfg: config.JobConfig, *, drain_timeout: float = 60.0) -> None:
        self.cfg = cfg
        self.shard: Shard = cfg.shard_spec()
        self.output = os.path.abspath(cfg.output)
        self.jdir = paths.journal_dir(self.output, self.shard)
        self.drain_timeout = drain_timeout
        self.state = reducer.new_state()  # the journal's records folded, for subscribers
        self.status = bytearray()  # a byte per dataset row, resumed from the journal
        self.inbox = Inbox(self._handle)
        self.finished = asyncio.Event()
        self.exit_code = EXIT_OK
        self.stopping = ""  # a signal before the pipeline runs
        self.running = False  # the producer is up and the pipeline handles messages
        self.held: list[object] = []  # pipeline messages from before it runs
        self.lock: preflight.ShardLock | None = None
        self.opened: Opened | None = None
        self.checkpoints: Checkpoints | None = None
        self.parts: Parts | None = None
        self.server: Any = None
        self.dump_dir = ""
        self.producer: Producer | None = None
        self.starting: asyncio.Task[None] | None = None  # the producer's start, once begun
        self.announced = False  # run_started is in the journal
        self.early: list[ProducerState] = []  # the producer's reports from before it
        from eagle3d.serve.notify import Notifier, WatchdogPolicy

        self.notifier = Notifier.from_env()
        self.watchdog = WatchdogPolicy.from_env()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.inbox.open(loop)
        # Handlers first: a SIGTERM during the journal replay or the model load must still
        # end in a clean stop rather than Python's default of dying on the spot.
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.inbox.put, Signalled(sig))
        loop.add_signal_handler(signal.SIGHUP, self.inbox.put, Hangup())
        try:
            try:
                opened = await self._open()
            except Fatal as e:
                log.error("%s", e)
                return e.code
            if self.stopping:
                return EXIT_OK
            code = self._already_done(opened)
            if code is not None:
                # A Type=notify unit that exits 0 before READY=1 fails with 'protocol' and
                # is restarted: a finished job started again at boot must be a clean no-op.
                self.notifier.ready()
                self.notifier.status("finished: nothing to do")
                return code
            return await self._main(opened)
        finally:
            await self._shutdown()

    async def _open(self) -> Opened:
        """The checks, the lock, the job's facts, the journal replayed and open."""
        cfg = self.cfg
        preflight.check_model(cfg.model)
        preflight.check_dataset(cfg.dataset)
        preflight.check_layout(self.output, self.shard)  # before anything is written
        preflight.check_output(self.output)
        with preflight.layout_lock(self.output):
            preflight.check_layout(self.output, self.shard)  # a daemon of another layout won
            os.makedirs(self.jdir, exist_ok=True)
        self.lock = preflight.ShardLock(paths.lock_path(self.output, self.shard))
        self.lock.acquire()
        self.notifier.status("reading dataset and journal")
        facts = await asyncio.to_thread(job.describe, cfg, self.shard, self.output)
        self.status[:] = bytearray(facts.lines)
        # Every record reaches subscribers through the inbox, and the checkpoint writer.
        self.checkpoints = Checkpoints(self.jdir, self.inbox.put)
        journal = JournalWriter(
            self.jdir,
            shard_index=self.shard.index,
            shard_count=self.shard.count,
            listener=self.checkpoints.listener,
            on_position=self.checkpoints.on_position,
            fileops=recording.FaultFileOps(),  # a module attribute: tests slot a layer under it
        )
        resume = ResumeFold(self.status, self.state)
        start = await asyncio.to_thread(checkpoints.restore, resume, self.jdir)
        journal.open(resume.sink, start)
        self.checkpoints.seed(resume)
        reserve = diskguard.Reserve(os.path.join(self.jdir, ".reserve"))
        recorder = Recorder(journal, self.inbox.put, reserve)
        identity = diskguard.OutputIdentity(self.output, self.jdir, journal.segment)
        self.opened = Opened(facts, resume, journal.run_id, recorder, identity)
        for i in facts.blank:  # no samples: skipped, whatever an older version made of them
            self.status[i] = SKIPPED
        reserve.make()
        forced = job.check_fingerprint(
            resume.last_started, facts.job, cfg.force_resume, self.output
        )
        if forced:
            log.warning("resuming a changed job because of --force-resume (%s)", forced)
        if self._counts()[0]:  # work left: the producer loads while the rest is made ready
            await self._launch_producer(facts, journal.run_id)
        if not cfg.no_space_check:
            self.notifier.status("checking the space the job needs")
            args = (cfg, facts, self.shard, self.output, self.status)
            await asyncio.to_thread(spacecheck.check_space, *args)
        return self.opened

    async def _launch_producer(self, facts: job.JobFacts, run_id: str) -> None:
        """Begin the producer's start (worker processes loading the model, or the wait for a
        server). Before this the daemon has imported nothing heavy (no torch): on a CPU the
        workers' start and the daemon's own imports then share the cores instead of taking
        turns (docs/benchmarks.md, "Whole short job")."""
        cfg = self.cfg
        self.dump_dir = cfg.dump_dir or own_dump_dir(run_id, self.shard)
        self.producer = make_producer(
            cfg,
            dump_dir=self.dump_dir,
            hidden_size=facts.hidden_size,
            layers=facts.layers,
            store_dtype=facts.job.store_dtype,
        )
        port = ProducerPort(self.inbox)
        try:
            await self.producer.launch(port)
        except Exception as e:
            raise Fatal(EXIT_PRODUCER, f"producer {cfg.backend} failed to start: {e}") from e
        self.starting = asyncio.create_task(self.producer.start(port))

    def _counts(self) -> tuple[list[int], int, int]:
        """(this shard's pending rows, saved, failed)."""
        ids = range(self.shard.index, len(self.status), self.shard.count)
        status = self.status
        pending = [i for i in ids if status[i] == PENDING]
        saved = sum(1 for i in ids if status[i] == SAVED)
        return pending, saved, sum(1 for i in ids if status[i] == FAILED)

    def _already_done(self, opened: Opened) -> int | None:
        """The exit status of a job with nothing left to do, else None."""
        pending, saved, failed = self._counts()
        if pending:
            return None
        total, fraction = opened.facts.total, self.cfg.max_failed_fraction
        code = finish_code(saved, failed, total, fraction)
        if not opened.resume.finished_last:
            opened.recorder.append(ev.RunFinished(saved=saved, failed=failed, exit_code=code))
        counts = describe_counts(saved, failed, total)
        log.info("nothing to do: job already finished (%s) in %s", counts, self.output)
        words = outcome_words(code, failed, total, fraction)
        if words:
            log.error("%s", words)
        return code

    async def _main(self, opened: Opened) -> int:
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
        _, saved, failed = self._counts()
        session = self.state.session + 1
        started = ev.RunStarted(
            job=facts.job,
            total=facts.total,
            session=session,
            pid=os.getpid(),
            host=socket.gethostname(),
            socket=sock,
            already_saved=saved,
            already_failed=failed,
            skipped=len(facts.blank),
            dataset_pinned=True,
        )
        if not rec.append(started):
            raise Fatal(EXIT_INTERNAL, f"the journal in {self.jdir} refused run_started")
        self.announced = True
        early, self.early = self.early, []
        for m in early:
            self._producer_state(m)
        log.info(
            "job %s shard %s: %d samples, %d already saved, %d failed; session %d",
            opened.run_id[:8],
            self.shard.name,
            facts.total,
            saved,
            failed,
            session,
        )
        if facts.blank:
            log.info("%d blank line(s) of %s skipped (no samples)", len(facts.blank), cfg.dataset)
        await self._start_server(sock)
        assert self.producer is not None  # launched by _open: there are pending rows
        where = Where(self.shard, self.output, self.jdir, self.dump_dir)
        parts = self.parts = assemble(
            cfg,
            opened,
            where,
            self.producer,
            session=session,
            status=self.status,
            inbox=self.inbox,
            state=self.state,
            notifier=self.notifier,
            watchdog=self.watchdog,
            on_done=self._set_done,
            drain_timeout=self.drain_timeout,
        )
        # The feeder tokenizes while the producer loads; what it hands over waits in
        # ``held`` until the producer is up.
        parts.feeder.start()
        starting = asyncio.create_task(self._start_producer(parts, rec))
        stop = asyncio.create_task(self.finished.wait())
        await asyncio.wait({starting, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if self.stopping:  # a signal during the model load: stop without starting work
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Fatal):
                await starting
            rec.append(ev.RunStopped(reason=f"{self.stopping} while starting", exit_code=EXIT_OK))
            return EXIT_OK
        try:
            window = starting.result()
        except Fatal as e:
            log.error("%s", e)
            rec.append(ev.RunStopped(reason=str(e), exit_code=e.code))
            return e.code
        return await self._run_pipeline(parts, window)

    async def _start_producer(self, parts: Parts, rec: Recorder) -> int:
        """Start the producer (journaled, so that a monitor shows a load and for how long,
        not a stall); returns its window."""
        cfg, producer = self.cfg, parts.producer
        self.notifier.extend_timeout(600_000_000)
        self.notifier.status(f"starting producer {cfg.backend}")
        phase, what = starting_words(cfg)
        log.info("%s", what)
        rec.append(ev.RunState(state=phase, reason=what))
        beat = asyncio.create_task(parts.ticker.while_starting(phase))
        try:
            assert self.starting is not None
            await self.starting
        except Exception as e:
            raise Fatal(EXIT_PRODUCER, f"producer {cfg.backend} failed to start: {e}") from e
        finally:
            beat.cancel()
        window = cfg.concurrency or producer.window()
        self.notifier.ready()
        rec.append(ev.RunState(state="running", reason=f"producer {cfg.backend} up"))
        log.info("producer %s up; window %d; dumps in %s", cfg.backend, window, self.dump_dir)
        return window

    async def _run_pipeline(self, parts: Parts, window: int) -> int:
        p, now = parts.pipeline, time.monotonic()
        led = p.ledger
        led.rules = dataclasses.replace(led.rules, window=window)
        led.last_progress = now
        p.read_dump_area(now)
        self.running = True
        parts.feeder.widen(window)
        held, self.held = self.held, []
        for msg in held:
            p.handle(msg, now)
        name_threads()
        tick = asyncio.create_task(parts.ticker.run())
        try:
            await self.finished.wait()
            return self.exit_code
        finally:
            tick.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tick

    def _set_done(self, code: int) -> None:
        if not self.finished.is_set():
            self.exit_code = code
            self.finished.set()

    async def _start_server(self, sock: str) -> None:
        from eagle3d.serve.server import EventServer

        server = EventServer(
            sock,
            journal_dir=self.jdir,
            snapshot=lambda: self.state,
            shard=self.shard,
            output=self.output,
            host=socket.gethostname(),
        )
        try:
            await server.start()
        except Exception as e:
            log.warning("no live socket at %s: %s (monitors fall back to the journal)", sock, e)
            return
        self.server = server

    # -- the inbox -----------------------------------------------------------------------

    def _handle(self, msgs: list[object]) -> None:
        now = time.monotonic()
        for m in msgs:
            if isinstance(m, ev.Event):
                self._published(m)
            elif isinstance(m, Signalled):
                self._on_signal(signal.Signals(m.signum).name, now)
            elif isinstance(m, Hangup):
                self._on_hup(now)
            elif isinstance(m, ProducerState):
                self._producer_state(m)
            elif self.running and self.parts is not None:
                self.parts.pipeline.handle(m, now)
            elif isinstance(m, JournalFault) and not m.pause:
                log.error("journal failure before the run started: %s", m.message)
                self.stopping = f"journal failure: {m.message}"
                self._set_done(EXIT_INTERNAL)
            else:
                self.held.append(m)  # handled once the producer is up

    def _producer_state(self, m: ProducerState) -> None:
        """Logged and journaled; one from before ``run_started`` waits for it."""
        if not self.announced:
            self.early.append(m)
            return
        level = logging.INFO if m.state == "up" else logging.WARNING
        log.log(level, "producer %s: %s", m.state, m.message)
        if self.opened is not None:
            self.opened.recorder.append(ev.ProducerEvent(state=m.state, message=m.message))

    def _published(self, e: ev.Event) -> None:
        """A record the journal holds (its listener, through the inbox): folded into the
        state subscribers see, and sent to them."""
        reducer.apply(self.state, e)
        if self.server is not None:
            self.server.publish(e)

    def _on_signal(self, name: str, now: float) -> None:
        if self.running and self.parts is not None:
            p = self.parts.pipeline
            p.apply(p.ledger.stop(name, now))
            return
        if self.stopping:
            return
        self.stopping = f"signal {name}"
        if self.parts is not None:
            self.parts.feeder.stop()
        self.notifier.stopping()
        log.info("%s before the pipeline started: stopping", name)
        self._set_done(EXIT_OK)

    def _on_hup(self, now: float) -> None:
        """SIGHUP: probe the paused areas now instead of at the next interval."""
        p = self.parts.pipeline if self.running and self.parts is not None else None
        if p is None or not p.ledger.faults:
            log.info("SIGHUP: nothing is paused")
            return
        log.info("SIGHUP: trying the paused area(s) again now")
        results = diskguard.probe(p.ledger.probes_due(now, force=True))
        p.apply(p.ledger.probed(results, now, force=True))

    # -- stopping ------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        parts, opened = self.parts, self.opened
        if parts is not None:
            parts.ticker.close()
        if self.starting is not None and not self.starting.done():
            self.starting.cancel()  # a start refused (the space check) or stopped midway
            with contextlib.suppress(BaseException):
                await self.starting
        if self.producer is not None:
            with contextlib.suppress(Exception):
                await self.producer.stop()
        if parts is not None:
            for close in reversed(parts.closers):
                close()
        if opened is not None:
            opened.recorder.close()
            opened.identity.close()
        if self.checkpoints is not None:
            self.checkpoints.close()  # after the journal's last record: a clean stop's fold
        if not self.cfg.dump_dir:  # the run's own folder; a --dump-dir is the operator's
            remove_if_empty(self.dump_dir)
        await asyncio.sleep(0)  # the journal's last records reach subscribers
        if self.server is not None:
            with contextlib.suppress(Exception):
                await self.server.close()
        if self.lock is not None:
            self.lock.release()


__all__ = ["Daemon"]
