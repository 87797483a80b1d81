"""``eagle3d run``: the extraction daemon.

One asyncio loop owns the pipeline state. A feeder thread streams and tokenizes the shard's
dataset lines; the loop keeps a window of requests in flight at the producer; the dump
watcher reports dumps as they land (the daemon never takes the producer's word); commit
threads validate and commit dumps, each ending in a durable ``sample_saved`` record. Every
journal record is folded into the live :class:`~eagle3proto.reducer.ShardState` and
published on the socket in seq order.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import errno
import logging
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from eagle3proto import events as ev
from eagle3proto import paths, reducer
from eagle3proto.fileops import OsFileOps
from eagle3proto.journal import JournalError, JournalWriter
from eagle3proto.paths import Shard

from . import config, envfault, faults, guard, job, storedtype
from .cli import EXIT_CODES
from .commit import CommitError, Committer
from .dump import BadDump, DumpVanished, rid_of, vanished
from .envfault import DUMPS, JOURNAL, OUTPUT, EnvFault
from .handoff import Coalesced, Handoff
from .preflight import (
    EXIT_CONFIG,
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_OUTPUT,
    EXIT_PRODUCER,
    EXIT_SPACE,
    Fatal,
    ShardLock,
    check_dataset,
    check_layout,
    check_model,
    check_output,
    layout_lock,
)
from .producers.base import Producer, Request
from .threadnames import name_threads
from .watcher import DumpWatcher

if TYPE_CHECKING:
    from .progress import ProgressLine
    from .telemetry import Telemetry

log = logging.getLogger("eagle3d")

SENT, DUMPED = 1, 2
PENDING, SAVED, FAILED, SKIPPED = job.PENDING, job.SAVED, job.FAILED, job.SKIPPED
_END = object()
COMMIT_BATCH = 8  # samples a commit thread takes at once (see Daemon._start_commits)
_VANISHED = envfault.Verdict(counted=False, why="its dump was removed before it was read")
PROBE_EVERY_S = 2.0  # while paused: how often a probe write asks whether the area is back
DUMP_FULL_MEMORY_S = 60.0  # a dump that never arrives this long after the area was full


@dataclass(slots=True)
class Pending:
    """One sample the daemon is working on."""

    idx: int
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool
    attempt: int = 0  # counted attempts (the sample's own failures), this one included
    sends: int = 0  # every send, uncounted ones included: names the request
    rid: str = ""
    stage: int = 0
    sent_at: float = 0.0
    dump_path: str = ""
    started: bool = False  # the producer said it is computing this attempt
    recount: bool = True  # the next send is a new attempt (False after an uncounted failure)
    commit_retried: bool = False  # a commit that lost its row directory was tried again


class _FaultFileOps(OsFileOps):
    """Journal file operations with the whitebox kill points that live inside an append."""

    def write(self, fd: int, data: bytes | memoryview) -> int:
        if len(data) > 16 and faults.hit("kill:mid_frame") is not None:
            # The write's last frame loses its last bytes. Half the write, as before, ended
            # exactly between two frames when it held two of the same size (a commit batch
            # of two), and then nothing was torn.
            os.write(fd, bytes(data)[: len(data) - 8])
            os._exit(137)
        return super().write(fd, data)

    def fdatasync(self, fd: int) -> None:
        faults.kill_point("after_append_before_sync")
        super().fdatasync(fd)


class Daemon:
    """Runs one shard of one job to completion (or to a clean stop)."""

    def __init__(self, cfg: config.JobConfig, *, drain_timeout: float = 60.0) -> None:
        self.cfg = cfg
        self.shard: Shard = cfg.shard_spec()
        self.output = os.path.abspath(cfg.output)
        self.drain_timeout = drain_timeout
        self.state = reducer.new_state()
        self.status = bytearray()
        self.inflight: dict[str, Pending] = {}
        self.by_idx: dict[int, Pending] = {}
        self.retry_commits: list[Pending] = []
        self.commit_queue: collections.deque[Pending] = collections.deque()
        self.commit_busy = 0  # batches running on commit threads
        self.commits_closed = False
        self.commit_threads = 1
        self._pub: Coalesced[ev.Event] | None = None  # made with the loop, in run()
        self.unrecorded: list[Any] = []  # bad lines whose sample_failed the journal refused
        self.requeue: list[Pending] = []  # uncounted failures waiting for the pause to end
        self.orphans = 0
        self.paused = ""  # the reason of the pause, '' while running
        self.faults: dict[str, EnvFault] = {}  # area -> what refused a write there
        self._next_probe = 0.0
        self.lost = ""  # the output's identity is lost: what happened (exit 4)
        self.identity: guard.OutputIdentity | None = None
        self.skipped = 0
        self.dump_dir = ""
        self._dump_free = (0.0, 0)  # (when read, free bytes) of the dump area
        self._dump_full_at = -1e18  # when the dump area was last seen full
        self.bytes_per_token = 0.0  # of a dump, the largest seen (estimated before the first)
        self._bpt_seen = 0.0
        self.largest_dump = 0
        self.stopping = ""
        self.feed_done = False
        self.last_progress = time.monotonic()
        self.largest_sample = 0
        self.hidden_size = 0
        self.layers: list[int] = []
        self.journal: JournalWriter | None = None
        self.producer: Producer | None = None
        self.server: Any = None
        self.notifier: Any = None
        self.watchdog_policy: Any = None
        self._exit_code = EXIT_OK
        self.wake = asyncio.Event()
        self.done = asyncio.Event()
        self._feed_stop = threading.Event()
        self._pipeline_started = False
        self._finishing: asyncio.Future[None] | None = None
        self._telemetry: Telemetry | None = None  # made with the first stats record
        self._progress: ProgressLine | None = None  # made with the first tick
        self._lock: ShardLock | None = None

    # -- the whole lifecycle -------------------------------------------------------------------

    async def run(self) -> int:
        self.loop = asyncio.get_running_loop()
        self._pub = Coalesced(self.loop, self._drain_published)
        self._setup_notify()
        # Handlers first: a SIGTERM during the journal replay or the model load must still
        # end in a clean stop rather than Python's default of dying on the spot.
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self._on_signal, sig)
        self.loop.add_signal_handler(signal.SIGHUP, self._on_hup)
        try:
            try:
                await self._start()
            except Fatal as e:
                log.error("%s", e)
                return e.code
            if self.stopping:
                return EXIT_OK
            done = self._already_done()
            if done is not None:
                # A Type=notify unit that exits 0 before READY=1 fails with 'protocol' and
                # is restarted: a finished job started again at boot must be a clean no-op.
                self._notify("ready")
                self._notify("status", "finished: nothing to do")
                return done
            return await self._main()
        finally:
            await self._shutdown()

    def _setup_notify(self) -> None:
        try:
            from .notify import Notifier, WatchdogPolicy
        except ImportError:  # pragma: no cover - notify ships with eagle3d
            return
        self.notifier = Notifier.from_env()
        self.watchdog_policy = WatchdogPolicy.from_env()

    def _notify(self, method: str, *args: Any) -> None:
        if self.notifier is not None:
            getattr(self.notifier, method)(*args)

    async def _start(self) -> None:
        cfg = self.cfg
        check_model(cfg.model)
        check_dataset(cfg.dataset)
        check_layout(self.output, self.shard)  # before anything is written
        check_output(self.output)
        jdir = paths.journal_dir(self.output, self.shard)
        with layout_lock(self.output):
            check_layout(self.output, self.shard)  # a daemon of another layout won the race
            os.makedirs(jdir, exist_ok=True)
        self._lock = ShardLock(paths.lock_path(self.output, self.shard))
        self._lock.acquire()
        self._notify("status", "reading dataset and journal")
        facts = await asyncio.to_thread(job.describe, cfg, self.shard, self.output)
        self.job, self.total, self.fmt = facts.job, facts.total, facts.fmt
        self.hidden_size, self.layers = facts.hidden_size, facts.layers
        self.status = bytearray(facts.lines)
        self.journal = JournalWriter(
            jdir,
            shard_index=self.shard.index,
            shard_count=self.shard.count,
            listener=self._published_threadsafe,
            fileops=_FaultFileOps(),
        )
        self.resume = job.ResumeFold(self.status, self.state)
        self.journal.open(self.resume.sink)
        self.run_id = self.journal.run_id
        self.identity = guard.OutputIdentity(self.output, jdir, self.journal.segment)
        for i in facts.blank:  # no samples: skipped, whatever an older version made of them
            self.status[i] = SKIPPED
        self.skipped = len(facts.blank)
        self._make_reserve()
        forced = job.check_fingerprint(
            self.resume.last_started, self.job, cfg.force_resume, self.output
        )
        if forced:
            log.warning("resuming a changed job because of --force-resume (%s)", forced)
        if not cfg.no_space_check:
            await self._check_space(facts)

    async def _check_space(self, facts: job.JobFacts) -> None:
        """Refuse (exit 10) a job whose remaining samples do not fit on the output's
        filesystem with the reserve (eagle3d.plan, on this shard's pending rows)."""
        from . import plan, sizing

        self._notify("status", "checking the space the job needs")
        try:
            report = await asyncio.to_thread(
                plan.check_run, self.cfg, facts, self.shard, self.output, self.status
            )
        except Exception as e:  # the check must never be why a job cannot start
            log.warning("space check skipped: %s: %s", type(e).__name__, e)
            return
        need = sizing.size(report.bytes)
        if report.disk is None:
            log.warning("space check skipped: free space of %s unknown", self.output)
        elif report.fits is False:
            raise Fatal(
                EXIT_SPACE,
                f"the job does not fit: {need} still to write, {sizing.size(report.disk.free)}"
                f" free on {report.disk.path}, reserve {sizing.size(report.reserve)}"
                " (eagle3d plan with the same arguments says more; --no-space-check"
                " starts anyway, and the run pauses when the disk is full)",
            )
        else:
            how = f"a sample of {report.tokenized:,} rows" if report.sampled else "every row"
            log.info(
                "space: %s still to write (from %s), %s free on %s",
                need,
                how,
                sizing.size(report.disk.free),
                report.disk.path,
            )

    def _shard_ids(self) -> range:
        return range(self.shard.index, len(self.status), self.shard.count)

    def _counts(self) -> tuple[int, int]:
        """(saved, failed) samples of this shard, from the per-sample status."""
        ids = self._shard_ids()
        status = self.status
        return sum(1 for i in ids if status[i] == SAVED), sum(1 for i in ids if status[i] == FAILED)

    def _already_done(self) -> int | None:
        """The exit status of a job with nothing left to do, else None."""
        status = self.status
        if any(status[i] == PENDING for i in self._shard_ids()):
            return None
        saved, failed = self._counts()
        code = job.finish_code(saved, failed, self.total, self.cfg.max_failed_fraction)
        if not self.resume.finished_last:
            assert self.journal is not None
            self.journal.append(ev.RunFinished(saved=saved, failed=failed, exit_code=code))
        counts = job.describe_counts(saved, failed, self.total)
        log.info("nothing to do: job already finished (%s) in %s", counts, self.output)
        self._say_outcome(code, failed)
        return code

    def _say_outcome(self, code: int, failed: int) -> None:
        if code == EXIT_OK:
            return
        log.error(
            "%s: %d of %d sample(s) failed for good, more than --max-failed-fraction %g allows"
            " (the first failures are above and in the journal; eagle3-top --once lists them)",
            "every sample failed" if failed >= self.total else "too many samples failed",
            failed,
            self.total,
            self.cfg.max_failed_fraction,
        )

    async def _main(self) -> int:
        cfg = self.cfg
        assert self.journal is not None
        self.socket_path = cfg.socket or paths.default_socket_path(self.output, self.shard)
        self._reopen()
        done_before, failed_before = self._counts()
        self.rid_prefix = f"{self.run_id[:8]}-{self.shard.index}-"
        self.session = self.state.session + 1
        self.journal.append(
            ev.RunStarted(
                job=self.job,
                total=self.total,
                session=self.session,
                pid=os.getpid(),
                host=socket.gethostname(),
                socket=self.socket_path,
                already_saved=done_before,
                already_failed=failed_before,
                skipped=self.skipped,
            )
        )
        log.info(
            "job %s shard %s: %d samples, %d already saved, %d failed; session %d",
            self.run_id[:8],
            self.shard.name,
            self.total,
            done_before,
            failed_before,
            self.session,
        )
        if self.skipped:
            log.info("%d blank line(s) of %s skipped (no samples)", self.skipped, cfg.dataset)
        await self._start_server()
        self.dump_dir = cfg.dump_dir or _default_dump_dir(self.run_id, self.shard)
        self.bytes_per_token = float((1 + len(self.layers)) * self.hidden_size * 4 + 8)
        self.committer = Committer(self.output, store=storedtype.get(self.job.store_dtype))
        # The daemon's own tensor work (validate, torch.save) is memory-bound: one intra-op
        # thread, so OpenMP spinning never steals cores from a producer on the same host.
        import torch

        torch.set_num_threads(1)
        self.committer.warm_up()
        removed = self.committer.clean_temp_files(
            [paths.sample_relpath(i) for i in range(0, len(self.status), paths.GROUP_SIZE)]
        )
        if removed:
            log.info("removed %d stray temp file(s) from an earlier crash", removed)
        self.watcher = DumpWatcher(self.dump_dir, self.loop, self._on_dump)
        self.watcher.start()
        for path in self.watcher.scan() + self.watcher.stale_temp_files():
            self._orphan(path, "left by an earlier run")
        threads = cfg.commit_thread_count()
        self.commit_pool = ThreadPoolExecutor(threads, thread_name_prefix="commit")
        self.commit_threads = threads
        log.info("committing to %s with %d threads", self.output, threads)
        starting = asyncio.create_task(self._start_producer())
        stop = asyncio.create_task(self.done.wait())
        await asyncio.wait({starting, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if self.stopping:  # a signal during the model load: stop without starting work
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Fatal):
                await starting
            self._append(ev.RunStopped(reason=f"{self.stopping} while starting", exit_code=EXIT_OK))
            return EXIT_OK
        try:
            starting.result()
        except Fatal as e:
            log.error("%s", e)
            self._append(ev.RunStopped(reason=str(e), exit_code=e.code))
            return e.code
        self._pipeline_started = True
        self.handoff: Handoff[Any] = Handoff(self.loop, max(8, self.window))
        feeder = threading.Thread(target=self._feed, name="feeder", daemon=True)
        feeder.start()
        name_threads()
        tasks = [
            asyncio.create_task(self._dispatch()),
            asyncio.create_task(self._tick()),
        ]
        await self.done.wait()
        self._feed_stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return self._exit_code

    def _reopen(self) -> None:
        """Journal that the failures an older eagle3d recorded for good but that were the
        environment's (a signal, a full or unwritable disk) are pending again, so every
        reader of the journal agrees that they are."""
        reopen = self.resume.reopen
        if not reopen:
            return
        assert self.journal is not None
        self.journal.append_many(
            [
                ev.SampleFailed(
                    idx=e.idx,
                    error=e.error,
                    message=f"not the sample's fault, retried: {e.message}",
                    attempt=0,
                    retry=True,
                    environment=True,
                )
                for e in reopen.values()
            ]
        )
        log.warning(
            "%d sample(s) recorded as failed by an earlier run for a reason that was not"
            " their own (a signal, a full or unwritable disk) are retried: %s",
            len(reopen),
            ", ".join(map(str, sorted(reopen)[:10])) + (" ..." if len(reopen) > 10 else ""),
        )

    async def _start_server(self) -> None:
        try:
            from .server import EventServer
        except ImportError:  # pragma: no cover
            log.warning("socket server unavailable in this installation")
            return
        self.server = EventServer(
            self.socket_path,
            journal_dir=paths.journal_dir(self.output, self.shard),
            snapshot=lambda: self.state,
            shard=self.shard,
            output=self.output,
            host=socket.gethostname(),
        )
        try:
            await self.server.start()
        except Exception as e:
            self.server = None
            log.warning(
                "no live socket at %s: %s (monitors fall back to the journal)", self.socket_path, e
            )

    async def _start_producer(self) -> None:
        cfg = self.cfg
        if cfg.backend == "synthetic":
            from .producers.synthetic import SyntheticProducer

            self.producer = SyntheticProducer(
                dump_dir=self.dump_dir,
                hidden_size=self.hidden_size,
                aux_layers=self.layers,
                dtype=self.job.store_dtype,
                threads=(cfg.workers or 1) + 1,
                window=cfg.concurrency or 8,
            )
        elif cfg.backend == "sglang":
            from .producers.sglang import SGLangProducer

            self.producer = SGLangProducer(
                cfg.server,
                dump_dir=self.dump_dir,
                aux_layers=self.layers,
                concurrency=cfg.concurrency or 32,
                request_timeout=cfg.request_timeout,
            )
        else:
            from .producers.hf import HFProducer

            self.producer = HFProducer(
                cfg.model,
                dump_dir=self.dump_dir,
                aux_layers=self.layers,
                workers=cfg.workers,
                threads=cfg.worker_threads,
                batch_tokens=cfg.batch_tokens,
                device=cfg.device,
                dtype=cfg.dtype,
                store_dtype=self.job.store_dtype,
                hang_timeout=cfg.request_timeout,
                window=cfg.concurrency,
            )
        self._notify("extend_timeout", 600_000_000)
        self._notify("status", f"starting producer {cfg.backend}")
        # Journaled, so a monitor shows a load (and for how long) instead of a stall; the
        # heartbeat's stats carry the workers' memory, which grows while a load progresses.
        phase, what = _starting_words(cfg)
        log.info("%s", what)
        self._append(ev.RunState(state=phase, reason=what))
        beat = asyncio.create_task(self._beat_while_starting(phase))
        try:
            await self.producer.start(_Callbacks(self))
        except Exception as e:
            raise Fatal(EXIT_PRODUCER, f"producer {cfg.backend} failed to start: {e}") from e
        finally:
            beat.cancel()
        self.window = cfg.concurrency or self.producer.window()
        self.last_progress = time.monotonic()
        self._notify("ready")
        self._append(ev.RunState(state="running", reason=f"producer {cfg.backend} up"))
        log.info("producer %s up; window %d; dumps in %s", cfg.backend, self.window, self.dump_dir)

    async def _beat_while_starting(self, phase: str) -> None:
        """A stats record a second while the producer starts (the tick runs only after)."""
        while True:
            await asyncio.sleep(1.0)
            self._append(self._stats(phase, producer_rss=True))
            self._progress_tick()

    # -- feeding and sending -------------------------------------------------------------------

    def _feed(self) -> None:
        """Feeder thread: stream the shard's lines, tokenize the pending ones."""
        from transformers import AutoTokenizer

        from .chat import ChatEncoder
        from .dataformats import BadSample, iter_rows, parse_row

        tok = AutoTokenizer.from_pretrained(self.cfg.model)
        enc = ChatEncoder(tok, max_length=self.cfg.max_length, on_overflow=self.cfg.on_overflow)
        status = self.status
        for idx, raw in iter_rows(self.cfg.dataset, self.fmt, self.shard.index, self.shard.count):
            if self._feed_stop.is_set():
                return
            if idx >= len(status) or status[idx] != PENDING:
                continue  # saved, failed for good, or a blank line
            item: Any
            try:
                t = enc.encode(parse_row(idx, raw))
                item = Pending(idx, list(t.input_ids), list(t.loss_mask), bool(t.truncated))
            except BadSample as bad:
                item = bad
            if not self._put(item):
                return
        self._put(_END)

    def _put(self, item: Any) -> bool:
        """Hand one item to the dispatcher (blocking); False once the run is stopping."""
        return self.handoff.put(item, self._feed_stop)

    async def _dispatch(self) -> None:
        from .dataset import BadSample

        while True:
            while (self._window_full() or self.paused) and not self.stopping:
                self.wake.clear()
                await self.wake.wait()
            if self.stopping:
                return
            if self.requeue:  # uncounted failures (a pause on the dump area) go first
                self._send(self.requeue.pop(0))
                continue
            # Failures that could not be journaled (disk full) go first once resumed.
            if self.unrecorded:
                item = self.unrecorded.pop(0)
            elif self.feed_done:
                # Nothing more to read, but a sample in flight may still come back uncounted
                # (a pause on the dump area) and go to the requeue: keep serving it.
                self.wake.clear()
                await self.wake.wait()
                continue
            else:
                item = await self.handoff.get()
            if item is _END:
                self.feed_done = True
                self._check_done()
                continue
            if isinstance(item, BadSample):
                # Say it in the foreground too, naming the file: the record alone is only
                # visible to someone who already knows to look at the journal.
                log.warning("%s: %s", self.cfg.dataset, item)
                failed = ev.SampleFailed(
                    idx=item.idx, error=item.error, message=str(item), attempt=0
                )
                if not self._append(failed):
                    # Not in the journal (a full disk pauses us): keep it for after the
                    # resume, or the run would finish counting a failure nobody recorded.
                    self.unrecorded.append(item)
                    continue
                self.status[item.idx] = FAILED
                continue
            if item.idx in self.by_idx:  # pragma: no cover - a bug, said loudly, not a wedge
                log.error("sample %d handed over while already in flight; ignored", item.idx)
                continue
            self._send(item)

    def _window_full(self) -> bool:
        # The window counts requests at the producer only: a sample whose dump arrived is
        # committed in parallel, so a slow commit never starves the producer (this overlap
        # is the point). Committing samples are bounded separately, to bound the dump area.
        # A producer that says when it starts a batch (the HF worker) has those requests
        # replaced at once: its batcher then always chooses from a full window (with the
        # window short by the running batch, the demo set's batches were 70 % real tokens
        # instead of 78 %).
        waiting = sent = planned = 0
        for p in self.inflight.values():
            if p.stage == SENT:
                sent += 1
                planned += len(p.input_ids)
                waiting += not p.started
        if waiting >= self.window or len(self.inflight) >= 3 * self.window:
            return True
        return not self._dump_room(planned, sent)

    def _dump_room(self, planned_tokens: int, sent: int) -> bool:
        """The dump area's free space holds the dumps still to come and one more (of the
        mean size in flight): a busy node's /dev/shm slows the run instead of failing it."""
        if sent == 0:
            return True
        bpt = self.bytes_per_token
        free = self._dump_free_now(time.monotonic())
        return envfault.dump_room(
            free, int(planned_tokens * bpt), int(planned_tokens / sent * bpt), sent
        )

    def _dump_free_now(self, now: float) -> int:
        when, free = self._dump_free
        if now - when > 0.25:
            free = guard.free_bytes(self.dump_dir)
            self._dump_free = (now, free)
            if envfault.dump_area_full(free, self.largest_dump):
                self._dump_full_at = now
        return free

    def _dump_area_was_full(self, now: float) -> bool:
        self._dump_free = (0.0, 0)  # read it now
        self._dump_free_now(now)
        return now - self._dump_full_at < DUMP_FULL_MEMORY_S

    def _send(self, p: Pending) -> None:
        assert self.producer is not None
        if p.recount:
            p.attempt += 1
        p.recount = True
        p.sends += 1
        p.rid = f"{self.rid_prefix}{self.session}-{p.idx}-{p.sends}"
        p.stage = SENT
        p.started = False
        p.sent_at = time.monotonic()
        self.inflight[p.rid] = p
        self.by_idx[p.idx] = p
        self._append(
            ev.SampleSent(idx=p.idx, rid=p.rid, attempt=p.attempt, tokens=len(p.input_ids))
        )
        self.producer.submit(Request(p.rid, p.idx, p.input_ids, p.attempt, p.sent_at))

    # -- dumps and commits ---------------------------------------------------------------------

    def _on_dump(self, path: str) -> None:
        rid = rid_of(path)
        if rid is None or not rid.startswith(self.rid_prefix):
            return  # another shard's dump in a shared dump area: not ours to judge
        p = self.inflight.get(rid)
        if self.producer is not None:
            self.producer.dump_arrived(rid)
        if p is None or p.stage != SENT:
            if p is None and os.path.exists(path):
                self._orphan(path, "unknown or abandoned request")
            return
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            # Its dump was complete (only a final name is reported) and is gone before the
            # daemon read it: the dump area was removed or cleaned under the run. Nothing
            # will bring it back, so resend now; waiting would cost the request timeout.
            self._fail_attempt(p, "DumpLost", str(vanished(path)), _VANISHED)
            return
        p.stage = DUMPED
        self.wake.set()  # a slot at the producer is free
        p.dump_path = path
        self.largest_dump = max(self.largest_dump, size)
        ratio = size / max(1, len(p.input_ids))
        # The first dump replaces the estimate (fp32 of every state); then the largest seen.
        self.bytes_per_token = max(self._bpt_seen, ratio)
        self._bpt_seen = self.bytes_per_token
        self._append(ev.SampleDumped(idx=p.idx, rid=rid, bytes=size))
        self._submit_commit(p)

    def _orphan(self, path: str, reason: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            self.orphans += 1
            self._append(ev.DumpOrphan(rid=rid_of(path) or "", path=path, reason=reason))

    def _submit_commit(self, p: Pending) -> None:
        self.commit_queue.append(p)
        self._start_commits()

    def _start_commits(self) -> None:
        """Hand queued dumps to idle commit threads, several at a time.

        Dumps arrive in bursts (a worker writes a whole batch's at once). A thread takes its
        share of what is queued, up to ``COMMIT_BATCH``, and commits it with one directory
        sync, one journal sync and one wakeup of this loop for all of it, instead of one of
        each per sample: on a CPU producer every wakeup and syscall here is taken from the
        forward beside it. While threads are busy, the queue fills, so the batches grow with
        the load and stay single samples when the daemon keeps up.
        """
        while self.commit_queue and self.commit_busy < self.commit_threads:
            if self.commits_closed:
                return
            free = self.commit_threads - self.commit_busy
            take = min(COMMIT_BATCH, -(-len(self.commit_queue) // free))
            batch = [self.commit_queue.popleft() for _ in range(take)]
            self.commit_busy += 1
            fut = self.loop.run_in_executor(self.commit_pool, self._commit_batch, batch)
            fut.add_done_callback(lambda f, b=batch: self._batch_done(b, f.result()))  # type: ignore[misc]

    def _batch_done(self, batch: list[Pending], results: list[tuple[str, str, int]]) -> None:
        self.commit_busy -= 1
        for p, result in zip(batch, results, strict=True):
            self._committed(p, result)
        self._start_commits()

    def _commit_batch(self, batch: list[Pending]) -> list[tuple[str, str, int]]:
        """Commit thread: validate, write, journal. One (outcome, message, errno) per sample.

        Outcomes: saved; lost (the dump vanished); bad_dump; io (writing the output failed);
        journal (appending the records failed); gone (the output is not where it was:
        nothing was written); error (a bug).
        """
        assert self.journal is not None and self.identity is not None
        gone = self.lost or self.identity.check()
        if gone:  # never commit into a directory nobody sees, nor recreate one
            return [("gone", gone, 0)] * len(batch)
        results: list[tuple[str, str, int]] = [("error", "not committed", 0)] * len(batch)
        try:
            written = self.committer.commit_files(
                [(p.idx, p.input_ids, p.loss_mask, p.dump_path) for p in batch],
                self.hidden_size,
                self.layers,
            )
            saved: list[tuple[int, ev.SampleSaved]] = []
            for k, (p, done) in enumerate(zip(batch, written, strict=True)):
                if isinstance(done, BadDump):
                    lost = isinstance(done, DumpVanished)
                    results[k] = ("lost" if lost else "bad_dump", str(done), 0)
                    continue
                if isinstance(done, CommitError):
                    results[k] = ("io", f"CommitError: {done}", done.errno or 0)
                    continue
                faults.kill_point("before_journal_append")
                rec = ev.SampleSaved(
                    idx=p.idx,
                    path=done.relpath,
                    bytes=done.nbytes,
                    tokens=len(p.input_ids),
                    checksum=done.checksum,
                    truncated=p.truncated,
                )
                saved.append((k, rec))
                self.largest_sample = max(self.largest_sample, done.nbytes)
            try:
                self.journal.append_many([rec for _, rec in saved])
            except JournalError as err:
                for k, _ in saved:
                    results[k] = ("journal", f"JournalError: {err}", err.errno or 0)
                return results
            for k, _ in saved:
                results[k] = ("saved", "", 0)
            for k, _ in saved:  # journaled: a dump that will not go is an orphan, no failure
                with contextlib.suppress(OSError):
                    os.unlink(batch[k].dump_path)
        except Exception as e:  # a bug must not wedge the samples forever
            log.exception("commit of samples %s failed", [p.idx for p in batch])
            return [
                r if r[0] == "saved" else ("error", f"{type(e).__name__}: {e}", 0) for r in results
            ]
        return results

    def _committed(self, p: Pending, result: tuple[str, str, int]) -> None:
        outcome, message, err = result
        if self.inflight.get(p.rid) is not p:
            return
        if outcome == "saved":
            del self.inflight[p.rid]
            self.by_idx.pop(p.idx, None)
            self.status[p.idx] = SAVED
            self.last_progress = time.monotonic()
            self._after_completion()
        elif outcome == "gone":
            self._lose(message)
        elif outcome == "journal":  # one policy with the loop thread's appends
            self.retry_commits.append(p)
            self._journal_error(err, message)
        elif outcome == "io" and envfault.env_errno(err):
            # The environment's, never the sample's: wait for the area, then commit again.
            where = os.path.dirname(os.path.join(self.output, paths.sample_relpath(p.idx)))
            self.retry_commits.append(p)
            self._pause(EnvFault(OUTPUT, where, err, message))
        elif outcome == "io" and err == errno.ENOENT:
            # A directory vanished under the commit: the output itself (the run stops), or a
            # row directory someone removed (made again, and the sample committed again).
            gone = self.identity.check() if self.identity is not None else ""
            if gone:
                self._lose(gone)
            elif not p.commit_retried:
                p.commit_retried = True
                self.committer.forget_dirs()
                self._submit_commit(p)
            else:
                self._fail_attempt(p, "CommitError", message)
        elif outcome == "lost":  # the dump area was cleaned under the run
            self._fail_attempt(p, "DumpLost", message, _VANISHED)
        elif outcome == "bad_dump":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p.dump_path)
            self._fail_attempt(p, "BadDump", message)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p.dump_path)
            self._fail_attempt(p, "CommitError" if outcome == "io" else "InternalError", message)

    def _fail_attempt(
        self, p: Pending, error: str, message: str, verdict: envfault.Verdict = envfault.SAMPLE
    ) -> None:
        """An attempt failed. The sample's own failure (``verdict.counted``) is retried while
        attempts remain, else recorded failed for good. The environment's counts no attempt:
        the sample is sent again (after the pause on ``verdict.pause``, if any). During a
        stop nothing is sent and nothing fails: the sample is pending for the next run."""
        assert self.producer is not None
        self.inflight.pop(p.rid, None)
        if self.stopping:
            self._append(
                ev.SampleFailed(
                    idx=p.idx,
                    error=error,
                    message=f"{message} (during the stop: pending for the next run)",
                    attempt=p.attempt,
                    retry=True,
                    environment=True,
                )
            )
            self.by_idx.pop(p.idx, None)
            self._after_completion()
            return
        if not verdict.counted:
            self._append(
                ev.SampleFailed(
                    idx=p.idx,
                    error=error,
                    message=message,
                    attempt=p.attempt,
                    retry=True,
                    environment=True,
                )
            )
            log.warning(
                "sample %d: %s: %s; not the sample's fault (%s): sent again, no attempt counted",
                p.idx,
                error,
                message,
                verdict.why,
            )
            p.recount = False
            if verdict.pause is not None:
                self.requeue.append(p)
                self._pause(verdict.pause)
            else:
                self._send(p)
            return
        retry = p.attempt < self.cfg.max_attempts
        self._append(
            ev.SampleFailed(idx=p.idx, error=error, message=message, attempt=p.attempt, retry=retry)
        )
        if retry:
            log.warning(
                "sample %d attempt %d failed (%s: %s); retrying", p.idx, p.attempt, error, message
            )
            self._send(p)
            return
        log.warning(
            "sample %d failed for good after %d attempt(s): %s: %s",
            p.idx,
            p.attempt,
            error,
            message,
        )
        self.status[p.idx] = FAILED
        self.by_idx.pop(p.idx, None)
        self.last_progress = time.monotonic()
        self._after_completion()

    def _after_completion(self) -> None:
        self.wake.set()
        self._check_done()

    def _check_done(self) -> None:
        if self.inflight or self.done.is_set() or self._finishing is not None:
            return
        if self.feed_done and not self.stopping and not self.requeue:
            self._finishing = asyncio.ensure_future(self._finish())
        elif self.stopping:
            self._append(ev.RunStopped(reason=self.stopping, exit_code=self._exit_code))
            saved, failed = self._counts()
            left = self.total - saved - failed
            log.info(
                "stopped (%s): %s, %d left; resumable: rerun the same command",
                self.stopping,
                job.describe_counts(saved, failed, self.total),
                left,
            )
            self.done.set()

    async def _finish(self) -> None:
        """Every sample is done: a last stats record with fresh producer numbers, then
        ``run_finished`` (the journal's last word on a finished job)."""
        assert self.producer is not None
        try:  # a last reading is a nicety; finishing is not
            await asyncio.wait_for(self.producer.refresh(), 5.0)
            self._append(self._stats("finished"))
        except Exception:
            log.exception("the last stats record before run_finished failed")
        if self.lost:
            return  # never say finished into a journal nobody can see
        saved, failed = self._counts()
        code = job.finish_code(saved, failed, self.total, self.cfg.max_failed_fraction)
        self._append(ev.RunFinished(saved=saved, failed=failed, exit_code=code))
        log.info("finished: %s", job.describe_counts(saved, failed, self.total))
        self._say_outcome(code, failed)
        self._exit_code = code
        self.done.set()

    # -- pause on the environment's faults ---------------------------------------------------

    def _pause(self, fault: EnvFault) -> None:
        """A write to ``fault.area`` was refused (full, unwritable, failing): pause until a
        probe write there succeeds (every PROBE_EVERY_S, or at once on SIGHUP)."""
        known = fault.area in self.faults
        self.faults[fault.area] = fault
        self._next_probe = time.monotonic() + PROBE_EVERY_S
        if self.paused or known:
            return
        reason = fault.reason
        self.paused = reason
        log.error("paused: %s; resumes by itself once it can write there again (or send SIGHUP)",
                  reason)  # fmt: skip
        state = ev.RunState(state="paused", reason=reason)
        if not self._append(state) and self._release_reserve():
            self._append(state)  # the journal's own disk is full: spend the reserve on it
        self._notify("status", f"PAUSED: {reason}")

    def _lose(self, what: str) -> None:
        """The output is not where the daemon opened it: stop at once, journal nothing more
        (into a file nobody would see), and never say finished. Exit 4."""
        if self.lost:
            return
        self.lost = what
        log.error(
            "%s: stopping at once (exit %d); nothing more is journaled and the run is not"
            " finished. Put the output back where it was and rerun the same command, or"
            " start again with a new --output",
            what,
            EXIT_OUTPUT,
        )
        self._exit_code = EXIT_OUTPUT
        self.stopping = self.stopping or f"output lost: {what}"
        self._feed_stop.set()
        self.inflight.clear()
        self.requeue.clear()
        self.retry_commits.clear()
        self.done.set()

    # A small file beside the journal, given back on a full disk so that the paused state
    # can always be journaled (and so seen by monitors); made again after the resume.
    RESERVE_BYTES = 64 << 10

    def _reserve_path(self) -> str:
        return os.path.join(paths.journal_dir(self.output, self.shard), ".reserve")

    def _make_reserve(self) -> None:
        path = self._reserve_path()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                os.posix_fallocate(fd, 0, self.RESERVE_BYTES)
            finally:
                os.close(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path)  # no room for it now: try again after the next resume

    def _release_reserve(self) -> bool:
        try:
            os.unlink(self._reserve_path())
        except OSError:
            return False
        return True

    def _maybe_resume(self, now: float, force: bool = False) -> None:
        """Probe each paused area; resume when every one takes writes again."""
        if not self.faults or (now < self._next_probe and not force):
            return
        self._next_probe = now + PROBE_EVERY_S
        # Room for the largest waiting sample, not for all of them: with many dumps waiting,
        # twice their sum can exceed what the operator frees (or the whole disk) and the run
        # would never resume. Commits retry one by one; one that hits the wall pauses again.
        need = max(
            2 * self.largest_sample,
            2 * max((_size(p.dump_path) for p in self.retry_commits), default=0),
            1 << 20,
        )
        for area, fault in list(self.faults.items()):
            directory = self.dump_dir if area == DUMPS else fault.path
            area_need = max(2 * self.largest_dump, 1 << 20) if area == DUMPS else need
            error = guard.probe_write(directory)
            free = guard.free_bytes(directory)
            if not envfault.may_resume(fault, error is None, free, area_need):
                if force:
                    why = (
                        f"{envfault.name(error.errno or 0)}: {error.strerror}"
                        if error
                        else f"{free} bytes free"
                    )
                    log.warning("still paused: %s (%s)", fault.reason, why)
                return
        full = all(f.disk_full for f in self.faults.values())
        areas = " and ".join(f"the {a}" for a in self.faults)
        self.faults.clear()
        self.paused = ""
        log.info("%s can be written again; resuming", areas)
        reason = "disk space freed" if full else f"{areas} writable again"
        self._append(ev.RunState(state="running", reason=reason))
        self._make_reserve()
        retry, self.retry_commits = self.retry_commits, []
        for p in retry:
            self._submit_commit(p)
        self.wake.set()

    # -- the 1-second tick ---------------------------------------------------------------------

    def _stats(self, state: str, producer_rss: bool = False) -> ev.Stats:
        """One stats record: disk, GPUs, this process, and the producer's health."""
        from .telemetry import Telemetry

        assert self.producer is not None
        if self._telemetry is None:
            self._telemetry = Telemetry(self.output, self.dump_dir)
        stats = self._telemetry.sample(
            producer_health=self.producer.health(),
            inflight=len(self.inflight),
            orphans=self.orphans,
            producer_rss=producer_rss,
        )
        stats.state = state
        return stats

    async def _tick(self) -> None:
        n = 0
        while True:
            await asyncio.sleep(1.0)
            n += 1
            now = time.monotonic()
            gone = self.identity.check() if self.identity is not None else ""
            if gone:
                self._lose(gone)
                return
            self._check_timeouts(now)
            self._maybe_resume(now)
            self._dump_free_now(now)
            self.wake.set()  # the dump area's room may have grown: the window is asked again
            if n % 5 == 0:
                if self.watcher.rearm():
                    log.warning("dump area %s was removed or replaced: watching it again",
                                self.dump_dir)  # fmt: skip
                for path in self.watcher.scan():
                    self._on_dump(path)  # safety net for a lost inotify event
            state = "paused" if self.paused else ("draining" if self.stopping else "running")
            self._append(self._stats(state))
            self._heartbeat(now)
            name_threads()  # the commit pool starts its threads as work comes
            self._progress_tick()

    def _check_timeouts(self, now: float) -> None:
        assert self.producer is not None
        limit = self.cfg.request_timeout
        if not self.producer.health().up:
            # A down producer is not the sample's fault: restart the clocks instead of
            # burning attempts; the producer resends (or reports) when it is back.
            for p in self.inflight.values():
                if p.stage == SENT:
                    p.sent_at = now
            return
        for p in [p for p in self.inflight.values() if p.stage == SENT and now - p.sent_at > limit]:
            self.producer.cancel(p.rid)
            self._fail_attempt(p, "Timeout", f"no dump within {limit:.0f} s")

    def _heartbeat(self, now: float) -> None:
        view = reducer.view(self.state, time.time())
        if self.notifier is None:
            return
        from .notify import format_status

        phase = "paused" if self.paused else ("draining" if self.stopping else None)
        self.notifier.status(format_status(view, phase))
        assert self.producer is not None
        idle = bool(self.paused) or (not self.inflight and not self.feed_done)
        ping = self.watchdog_policy.should_ping(now, self.last_progress, len(self.inflight), idle)
        if ping and not self.producer.is_stuck(now):
            self.notifier.watchdog()

    def _progress_tick(self) -> None:
        """The live progress line on a terminal; a log line every 10 s otherwise."""
        if self._progress is None:
            from .progress import ProgressLine

            self._progress = ProgressLine.for_daemon()
        self._progress.update(self.state, time.time())

    # -- publishing ----------------------------------------------------------------------------

    def _append(self, event: ev.Event) -> bool:
        """Append from the loop thread. Returns whether the record is in the journal.

        The one policy for journal errors, as for the commit threads' (see _committed): an
        environment errno (full, unwritable, failing) pauses while the journal is still
        open (a failed write is cut back to the last good frame); a journal closed by a
        failed fdatasync cannot be trusted again in this process (the kernel may have
        dropped what it said it wrote), so the run stops and a restart replays what is
        durable; anything else stops. Nothing is appended once the output is lost.
        """
        assert self.journal is not None
        if self.lost:
            return False
        try:
            self.journal.append(event)
            return True
        except JournalError as e:
            self._journal_error(e.errno or 0, str(e))
            return False

    def _journal_error(self, err: int, message: str) -> None:
        """A journal append failed (on this thread or a commit thread): pause or stop."""
        assert self.journal is not None
        if envfault.env_errno(err) and self.journal.segment()[1] >= 0:
            jdir = paths.journal_dir(self.output, self.shard)
            self._pause(EnvFault(JOURNAL, jdir, err, message))
        elif not self.stopping:
            log.error("journal failure, stopping (rerun to resume from what is durable): %s",
                      message)  # fmt: skip
            self._exit_code = EXIT_INTERNAL
            self.stopping = f"journal failure: {message}"
            self._feed_stop.set()
            self.inflight.clear()
            self.done.set()

    def _published_threadsafe(self, e: ev.Event) -> None:
        """The journal's listener (any thread): pass ``e`` to the loop, in seq order.

        Records are published in bursts (a commit batch, a flush of chatty records); the
        loop is woken once per burst, not once per record.
        """
        pub = self._pub
        if pub is not None:
            pub.put(e)

    def _drain_published(self, events: list[ev.Event]) -> None:
        for e in events:
            self._published(e)

    def _published(self, e: ev.Event) -> None:
        reducer.apply(self.state, e)
        if self.server is not None:
            self.server.publish(e)

    # -- stopping ------------------------------------------------------------------------------

    def _on_hup(self) -> None:
        """SIGHUP: probe a paused area now instead of at the next interval."""
        if not self.faults:
            log.info("SIGHUP: nothing is paused")
            return
        log.info("SIGHUP: trying the paused area(s) again now")
        self._maybe_resume(time.monotonic(), force=True)

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self.stopping:
            log.warning("%s again: stopping now, abandoning %d in flight", name, len(self.inflight))
            self.inflight.clear()
            self._check_done()
            return
        self.stopping = f"signal {name}"
        self._feed_stop.set()
        self._notify("stopping")
        if not self._pipeline_started:
            log.info("%s before the pipeline started: stopping", name)
            self.done.set()
            return
        # What waits for a paused area (or to be sent again) is pending for the next run.
        for p in [*self.retry_commits, *self.requeue]:
            self.inflight.pop(p.rid, None)
            self.by_idx.pop(p.idx, None)
        self.retry_commits.clear()
        self.requeue.clear()
        log.info("%s: stopping; draining %d sample(s) in flight", name, len(self.inflight))
        self._append(ev.RunState(state="draining", reason=self.stopping))
        self.wake.set()
        self.loop.call_later(self.drain_timeout, self._abandon)
        self._check_done()

    def _abandon(self) -> None:
        if self.inflight:
            log.warning(
                "drain timeout: abandoning %d sample(s); they are redone on resume",
                len(self.inflight),
            )
            self.inflight.clear()
        self._check_done()

    async def _shutdown(self) -> None:
        if self._progress is not None:
            self._progress.close(self.state, time.time())
        if self.producer is not None:
            with contextlib.suppress(Exception):
                await self.producer.stop()
        if getattr(self, "watcher", None) is not None:
            self.watcher.stop()
        if getattr(self, "commit_pool", None) is not None:
            self.commits_closed = True  # what is still queued is redone on resume
            self.commit_pool.shutdown(wait=True)
        if self.journal is not None:
            if self.lost:
                self.journal.abandon()
            else:
                with contextlib.suppress(JournalError):
                    self.journal.close()
        if self.identity is not None:
            self.identity.close()
        self._remove_empty_dump_dir()
        # Let the listener's last call_soon_threadsafe callbacks reach subscribers.
        await asyncio.sleep(0)
        if self.server is not None:
            with contextlib.suppress(Exception):
                await self.server.close()
        if self._lock is not None:
            self._lock.release()

    def _remove_empty_dump_dir(self) -> None:
        """The run's own dump folder (the default, named after the job) goes when it is
        empty; a --dump-dir the operator chose is theirs (a server may share it)."""
        if self.cfg.dump_dir or not self.dump_dir:
            return
        for d in (self.dump_dir, os.path.dirname(self.dump_dir)):
            try:
                os.rmdir(d)
            except OSError:
                return  # not empty (dumps of another shard or job), or already gone


class _Callbacks:
    """ProducerEvents for the daemon: hop onto the loop thread."""

    def __init__(self, d: Daemon) -> None:
        self.d = d

    def request_failed(self, rid: str, error: str, message: str, retryable: bool) -> None:
        self.d.loop.call_soon_threadsafe(self._failed, rid, error, message, retryable)

    def _failed(self, rid: str, error: str, message: str, retryable: bool) -> None:
        d = self.d
        p = d.inflight.get(rid)
        if p is None or p.stage != SENT:
            return
        full = error == "DumpMissing" and d._dump_area_was_full(time.monotonic())
        verdict = envfault.producer_failure(
            error, message, stopping=bool(d.stopping), dump_dir=d.dump_dir, dump_area_full=full
        )
        if verdict.counted and not retryable:
            p.attempt = max(p.attempt, d.cfg.max_attempts)
        d._fail_attempt(p, error, message, verdict)

    def producer_state(self, state: str, message: str = "") -> None:
        self.d.loop.call_soon_threadsafe(self._state, state, message)

    def requests_started(self, rids: list[str]) -> None:
        self.d.loop.call_soon_threadsafe(self._started, rids)

    def _started(self, rids: list[str]) -> None:
        for rid in rids:
            p = self.d.inflight.get(rid)
            if p is not None and p.stage == SENT:
                p.started = True
        self.d.wake.set()  # room in the window: the dispatcher sends replacements

    def _state(self, state: str, message: str) -> None:
        log.log(
            logging.INFO if state == "up" else logging.WARNING, "producer %s: %s", state, message
        )
        self.d._append(ev.ProducerEvent(state=state, message=message))


def _starting_words(cfg: config.JobConfig) -> tuple[str, str]:
    """The run state while the producer starts, and what it is doing, in words."""
    if cfg.backend == "hf":
        return "loading", f"loading model {cfg.model} (hf, device {cfg.device})"
    if cfg.backend == "sglang":
        return "starting", f"connecting to the SGLang server at {cfg.server}"
    return "starting", f"starting the {cfg.backend} producer"


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _default_dump_dir(run_id: str, shard: Shard) -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else "/tmp"
    return os.path.join(base, f"eagle3d-{os.getuid()}", f"{run_id[:8]}-{shard.name}")


# -- command line ----------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "run",
        help="run (or resume) an extraction job in the foreground",
        description="Extract EAGLE-3 hidden states for every sample of a shard. "
        "Rerun the same command to resume; a finished job is a no-op.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    config.add_job_arguments(p)
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from .logsetup import setup_logging

    setup_logging()
    try:
        cfg = config.from_args(args)
        faults.parse(os.environ.get("EAGLE3D_FAULT", ""))
    except (config.ConfigError, ValueError) as e:
        log.error("%s", e)
        return EXIT_CONFIG
    try:
        code = asyncio.run(Daemon(cfg).run())
    except Fatal as e:
        log.error("%s", e)
        return e.code
    except KeyboardInterrupt:
        return EXIT_OK
    # The run is over and its exit status decided: a stop that arrives while the interpreter
    # winds down (the loop's handlers are gone) has nothing left to stop, and must not turn
    # a finished run into a death by signal (exit -15, or a KeyboardInterrupt traceback).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    return code


def run_job(cfg: config.JobConfig) -> int:
    """Run a job in this process (used by ``eagle3d demo`` and benchmarks)."""
    return asyncio.run(Daemon(cfg).run())


__all__ = ["Daemon", "cmd_run", "register", "run_job"]
