"""The ledger: every sample of a shard, and the rules that move it. Pure.

One object owns the per-sample state of a running shard: each row's status (pending, saved,
failed for good, skipped), the samples in flight (sent, or dumped and committing), their
attempts and request ids, the queue of tokenized rows the feeder handed over, what waits for
a pause to end, and where the run stands from the journal's replay on (the producer
starting, ``run_started`` journaled, the producer up, stopping, lost, done). Every outside
event is one message (:data:`eagle3d.core.messages.Msg`) handed to :meth:`Ledger.handle`
with the time as an argument; each answers with :mod:`eagle3d.core.effects` for the shell to
carry out. Nothing here reads a clock, touches a file or knows a thread.

The rules:

* **Lifecycle.** A replayed shard with nothing left to do finishes at once (``run_finished``
  once, the exit status of its counts). The producer's reports wait for ``run_started``;
  every other message of the samples waits (the pre-run hold) until the producer is up, the
  feeder's rows in the queue they go to anyway. Nothing is sent before the producer is up.
  A signal before then stops the run at once: ``run_stopped`` ("... while starting") when
  ``run_started`` is journaled, nothing when it is not. A producer that fails to start
  stops the run with its exit status.

* **Window.** A request is sent while fewer than ``window`` sent requests wait at the
  producer (one it says it started no longer waits), fewer than three windows are in flight
  in all (committing included), and the dump area's free space holds the dumps still to
  come plus one more (:func:`eagle3d.core.envfault.dump_room`).
* **Order.** Samples sent again after an uncounted failure go first, then the feeder's rows
  in dataset order.
* **Attempts.** Only a sample's own failure counts an attempt (:mod:`eagle3d.core.envfault`
  judges); it is retried until ``max_attempts``, then failed for good. The environment's
  failures are sent again at once, or after the pause they caused. A request is named
  ``<run>-<shard>-<session>-<idx>-<send>``: unique per send, so a late dump of an earlier
  send is never taken for this one.
* **Timeouts.** A request with no dump after ``request_timeout`` seconds fails (counted),
  except while the producer is down: its clock then starts again.
* **Pause.** A write the environment refused pauses the run on that area (output, journal,
  dump area): nothing is sent; commits that hit it wait; the run resumes when a probe write
  into every paused area succeeds (and, for a full disk, there is room for the largest
  sample waiting). A failure the journal refused to record waits too.
* **Stop.** After a signal nothing is sent; what is in flight is drained for up to
  ``drain_timeout`` seconds; whatever fails meanwhile is pending for the next run; what waits
  for a pause is dropped (pending). A second signal abandons what is in flight.
* **Done.** The run finishes when the feed has ended and nothing is in flight, waiting to
  be sent again, paused or unrecorded; it stops when stopping and nothing is in flight.
"""

from __future__ import annotations

import dataclasses
import posixpath
from typing import assert_never

from eagle3proto import events as ev

from eagle3d.core import effects as fx
from eagle3d.core import messages as m
from eagle3d.core import outcome as oc
from eagle3d.core.book import (
    DUMP_FULL_MEMORY_S,
    ERROR,
    INFO,
    MIB,
    REAPER_GRACE_S,
    VANISHED,
    WARNING,
    Book,
    Fed,
    Rules,
)
from eagle3d.core.envfault import OUTPUT, SAMPLE, EnvFault, dump_area_full, producer_failure
from eagle3d.core.pauses import Probe, ProbeResult
from eagle3d.core.resume import describe_counts, finish_code, outcome_words
from eagle3d.core.sample import DUMPED, FAILED, PENDING, SAVED, SENT, CommitJob
from eagle3d.exitcodes import EXIT_FINGERPRINT, EXIT_INTERNAL, EXIT_OK, EXIT_PRODUCER

#: What waits for the producer to be up (the pre-run hold); the feeder's rows wait in the
#: queue, and the rest means something at any stage.
HELD = (m.Started, m.Dumped, m.RequestFailed, m.Committed, m.FeedFailed, m.Pause)

__all__ = ["Ledger", "Probe", "ProbeResult", "Rules"]


class Ledger(Book):
    """The per-sample state of one shard's run, fed one event at a time (see above)."""

    def handle(self, msg: m.Msg, now: float) -> list[fx.Effect]:
        """The one way in: what ``msg``, at ``now``, asks of the shell, in order."""
        if isinstance(msg, HELD) and not (self.running or self.done):
            self.held.append(msg)
            return []
        match msg:
            case m.Replayed(finished_last=last):
                return self.replayed(last, now)
            case m.ProducerStarting():
                return self.producer_starting(msg, now)
            case m.Announced():
                return self.announce(now)
            case m.ProducerUp(backend=backend, window=window):
                return self.producer_up(backend, window, now)
            case m.ProducerFailed(message=message, code=code):
                return self.producer_failed(message, code, now)
            case m.ProducerReport():
                return self.producer_report(msg, now)
            case m.Stop(why=why):
                return self.stop(why, now)
            case m.Hangup():
                return self.hangup(now)
            case m.LastReading():
                return self.finish(now)
            case _:
                return self._sample_event(msg, now)

    def _sample_event(self, msg: m.Work, now: float) -> list[fx.Effect]:
        match msg:
            case m.Fed(item=item):
                return self.fed(item, now)
            case m.Started(rids=rids):
                return self.started(rids, now)
            case m.Dumped(rid=rid, path=path, size=size):
                return self.dumped(rid, path, size, now)
            case m.RequestFailed(rid=rid, error=error, message=message, retryable=retryable):
                return self.request_failed(rid, error, message, retryable, now)
            case m.Committed(results=results):
                return [e for rid, r in results.items() for e in self.committed(rid, r, now)]
            case m.FeedFailed(message=message, changed=True):
                return self.dataset_changed(message, now)
            case m.FeedFailed(message=message):
                return self.abort(f"reading the dataset failed: {message}", now)
            case m.DatasetChanged(what=what):
                return self.dataset_changed(what, now)
            case m.Tick(producer_up=up):
                return self.tick(now, up)
            case m.DumpArea(free=free):
                return self.observe_dump_area(free, now)
            case m.Pause(fault=fault):
                return self.pause(fault, now)
            case m.Probed(results=results, force=force):
                return self.probed(results, now, force)
            case m.Refused(event=event):
                return self.refused(event, now)
            case m.JournalFailed(message=message):
                return self.journal_failed(message, now)
            case m.Lose(what=what):
                return self.lose(what, now)
            case _:
                assert_never(msg)

    # -- the lifecycle -----------------------------------------------------------------------

    def replayed(self, finished_last: bool, now: float) -> list[fx.Effect]:
        """The journal is replayed: with no row of the shard pending, the run is over."""
        if PENDING in self.own_status():
            return []
        saved, failed = self.counts()
        code = finish_code(saved, failed, self.total, self.rules.max_failed_fraction)
        if not finished_last:
            self._emit(fx.Record(ev.RunFinished(saved=saved, failed=failed, exit_code=code)))
        self._say_finished(code, already=True)
        # A Type=notify unit that exits 0 before READY=1 fails with 'protocol' and is
        # restarted: a finished job started again at boot must be a clean no-op.
        self._emit(fx.NotifyReady(), fx.NotifyStatus("finished: nothing to do"))
        self.exit_code = code
        self._set_done()
        return self._end(now)

    def producer_starting(self, msg: m.ProducerStarting, now: float) -> list[fx.Effect]:
        """The producer's start began (journaled, so that a monitor shows a load and for how
        long, not a stall)."""
        if self.done:
            return []
        self._emit(
            fx.NotifyExtendTimeout(600_000_000),
            fx.NotifyStatus(f"starting producer {msg.backend}"),
        )
        self._log(INFO, msg.what)
        self._emit(fx.Record(ev.RunState(state=msg.phase, reason=msg.what)))
        return self._end(now)

    def announce(self, now: float) -> list[fx.Effect]:
        """``run_started`` is in the journal: the producer's reports from before it follow."""
        self.announced = True
        early, self.early = self.early, []
        for r in early:
            self._report(r)
        return self._end(now)

    def producer_report(self, msg: m.ProducerReport, now: float) -> list[fx.Effect]:
        """Logged and journaled; one from before ``run_started`` waits for it."""
        if not self.announced:
            self.early.append(msg)
            return []
        self._report(msg)
        return self._end(now)

    def _report(self, r: m.ProducerReport) -> None:
        self._log(INFO if r.state == "up" else WARNING, f"producer {r.state}: {r.message}")
        self._emit(fx.Record(ev.ProducerEvent(state=r.state, message=r.message)))

    def producer_up(self, backend: str, window: int, now: float) -> list[fx.Effect]:
        """The producer is up: the run begins, and what waited for it is handled, in order."""
        if self.done or self.running:
            return []
        self.running = True
        self.rules = dataclasses.replace(self.rules, window=window)
        self.last_progress = now
        self._emit(
            fx.NotifyReady(),
            fx.Record(ev.RunState(state="running", reason=f"producer {backend} up")),
        )
        self._log(INFO, f"producer {backend} up; window {window}; dumps in {self.rules.dump_dir}")
        self._emit(fx.Running(window))
        out = self._end(now)
        held, self.held = self.held, []
        for msg in held:
            out += self.handle(msg, now)
        return out

    def producer_failed(self, message: str, code: int, now: float) -> list[fx.Effect]:
        """The producer's start failed: the run stops with ``code``."""
        if self.done:
            return []
        self._log(ERROR, message)
        self.stopping, self.exit_code = message, code
        self._emit(fx.StopFeed(), fx.Record(ev.RunStopped(reason=message, exit_code=code)))
        self._set_done()
        return self._end(now)

    def hangup(self, now: float) -> list[fx.Effect]:
        """SIGHUP: the paused areas are probed now instead of at the next interval."""
        if not self.running or not self.faults or self.done:
            self._log(INFO, "SIGHUP: nothing is paused")
            return self._end(now)
        self._log(INFO, "SIGHUP: trying the paused area(s) again now")
        self._emit(fx.Probe(self.probes_due(now, force=True), force=True))
        return self._end(now)

    # -- events ----------------------------------------------------------------------------------

    def fed(self, item: Fed, now: float) -> list[fx.Effect]:
        """The feeder handed over a tokenized row, a rejected one, or the end of the shard."""
        self.queue.append(item)
        return self._end(now)

    def started(self, rids: list[str], now: float) -> list[fx.Effect]:
        """The producer began computing these requests: they no longer wait in the window."""
        for rid in rids:
            p = self.inflight.get(rid)
            if p is not None and p.stage == SENT:
                p.started = True
        return self._end(now)

    def observe_dump_area(self, free: int, now: float) -> list[fx.Effect]:
        """The dump area's free space, read at ``now``."""
        self.dump_free = free
        if dump_area_full(free, self.largest_dump):
            self.dump_full_at = now
        return self._end(now)

    def dumped(self, rid: str, path: str, size: int | None, now: float) -> list[fx.Effect]:
        """A complete dump appeared in the dump area (``size`` None: gone before it was read)."""
        if not self.owns(rid):
            return []  # another shard's dump in a shared dump area: not ours to judge
        self._emit(fx.SeenDump(rid))
        p = self.inflight.get(rid)
        if p is None or p.stage != SENT:
            if p is None and size is not None and rid not in self.reaping:
                self._emit(fx.Orphan(path, "unknown or abandoned request"))
            return self._end(now)
        if size is None:
            # Its dump was complete (only final names are reported) and is gone before the
            # daemon read it: nothing will bring it back, so it is resent now.
            why = f"{posixpath.basename(path)} vanished before it was read"
            self._fail(p, "DumpLost", why, VANISHED, now)
            return self._end(now)
        p.stage = DUMPED
        p.dump_path, p.dump_bytes = path, size
        self.largest_dump = max(self.largest_dump, size)
        # The first dump replaces the estimate (fp32 of every state); then the largest seen.
        self.bytes_per_token = self._bpt_seen = max(self._bpt_seen, size / max(1, len(p.input_ids)))
        self._emit(
            fx.Record(ev.SampleDumped(idx=p.idx, rid=rid, bytes=size)), fx.Commit(CommitJob.of(p))
        )
        return self._end(now)

    def request_failed(
        self, rid: str, error: str, message: str, retryable: bool, now: float
    ) -> list[fx.Effect]:
        """The producer says a request will produce no dump."""
        p = self.inflight.get(rid)
        if p is None or p.stage != SENT:
            return []
        full = error == "DumpMissing" and now - self.dump_full_at < DUMP_FULL_MEMORY_S
        verdict = producer_failure(
            error,
            message,
            stopping=bool(self.stopping),
            dump_dir=self.rules.dump_dir,
            dump_area_full=full,
        )
        if verdict.counted and not retryable:
            p.attempt = max(p.attempt, self.rules.max_attempts)
        self._fail(p, error, message, verdict, now)
        return self._end(now)

    def committed(self, rid: str, result: oc.AnyOutcome, now: float) -> list[fx.Effect]:
        """What a commit thread's work on request ``rid``'s dump came to."""
        p = self.inflight.get(rid)
        if p is None or p.stage != DUMPED:
            return []  # abandoned meanwhile (a second signal, a lost output)
        if isinstance(result, oc.Saved):
            del self.inflight[p.rid]
            self.reaping[p.rid] = now
            self.by_idx.pop(p.idx, None)
            self.status[p.idx] = SAVED
            self.largest_sample = max(self.largest_sample, result.nbytes)
            self.last_progress = now
            self._check_done()
        elif isinstance(result, oc.OutputGone):
            self._lose(result.message)
        elif isinstance(result, oc.ContractBroken):
            self._emit(fx.RemoveDump(p.dump_path))
            self._producer_broken(result.message)
        elif isinstance(result, oc.NotRecorded):
            # The recorder reported why (a pause, or a stop) before this outcome arrived.
            self.retry_commits.append(p)
        elif isinstance(result, oc.WriteRefused):
            self.retry_commits.append(p)
            self._pause(EnvFault(OUTPUT, result.directory, result.errno, result.message), now)
        elif isinstance(result, oc.DirGone) and not p.commit_retried:
            p.commit_retried = True  # a row directory removed under the run: made again
            self._emit(fx.Commit(CommitJob.of(p), forget_dirs=True))
        elif isinstance(result, oc.DumpLost):
            self._fail(p, "DumpLost", result.message, VANISHED, now)
        else:
            error = {oc.BadDump: "BadDump", oc.Internal: "InternalError"}.get(type(result))
            if not isinstance(result, oc.DirGone):
                self._emit(fx.RemoveDump(p.dump_path))
            self._fail(p, error or "CommitError", result.message, SAMPLE, now)
        return self._end(now)

    def tick(self, now: float, producer_up: bool) -> list[fx.Effect]:
        """The 1 s tick: request timeouts, the drain's deadline, and the window asked again
        (the dump area's room may have grown)."""
        if self.done:
            return []
        reaping = self.reaping
        while reaping and now - next(iter(reaping.values())) > REAPER_GRACE_S:
            del reaping[next(iter(reaping))]
        if self.stopping and now >= self.drain_deadline and self.inflight:
            self._log(
                WARNING,
                f"drain timeout: abandoning {len(self.inflight)} sample(s); they are redone on resume",
            )
            self.inflight.clear()
            self._check_done()
        limit = self.rules.request_timeout
        sent = [p for p in self.inflight.values() if p.stage == SENT]
        if not producer_up:
            # A down producer is not the sample's fault: the clocks start again instead of
            # burning attempts; the producer resends (or reports) when it is back.
            for p in sent:
                p.sent_at = now
        else:
            for p in sent:
                if now - p.sent_at > limit and self.inflight.get(p.rid) is p:
                    self._emit(fx.Cancel(p.rid))
                    self._fail(p, "Timeout", f"no dump within {limit:.0f} s", SAMPLE, now)
        probes = self.probes_due(now)
        if probes:
            self._emit(fx.Probe(probes))
        return self._end(now)

    def refused(self, event: ev.Event, now: float) -> list[fx.Effect]:
        """The journal refused ``event`` (the recorder reported why). A failure for good
        that nobody recorded is not counted: it is recorded again after the pause."""
        if isinstance(event, ev.SampleFailed) and not event.retry and not self.lost:
            self.status[event.idx] = PENDING
            self.unrecorded[event.idx] = event
        return self._end(now)

    # -- pause and resume ------------------------------------------------------------------

    def pause(self, fault: EnvFault, now: float) -> list[fx.Effect]:
        """A write to ``fault.area`` was refused by the environment (the recorder's report
        for the journal; the ledger's own judgement does this for the other areas)."""
        self._pause(fault, now)
        return self._end(now)

    def probes_due(self, now: float, force: bool = False) -> list[Probe]:
        """The probe writes to make now (every few seconds while paused, or at once)."""
        # Room for the largest waiting sample, not for all of them: with many dumps waiting,
        # twice their sum can exceed what the operator frees (or the whole disk) and the run
        # would never resume. Commits retry one by one; one that hits the wall pauses again.
        waiting = max((p.dump_bytes for p in self.retry_commits), default=0)
        need = max(2 * self.largest_sample, 2 * waiting, MIB)
        dumps_need = max(2 * self.largest_dump, MIB)
        return self.pauses.due(now, force, self.rules.dump_dir, need, dumps_need)

    def probed(
        self, results: list[ProbeResult], now: float, force: bool = False
    ) -> list[fx.Effect]:
        """The outcome of :meth:`probes_due`'s probes: resume when every area is back."""
        back, why = self.pauses.judge(results)
        if not back:
            if force and why:
                self._log(WARNING, f"still paused: {why}")
            return self._end(now)
        self._log(INFO, f"{self.pauses.areas()} can be written again; resuming")
        self._emit(fx.Resumed(self.pauses.clear()))
        retry, self.retry_commits = self.retry_commits, []
        self._emit(*(fx.Commit(CommitJob.of(p)) for p in retry))
        for idx, rec in list(self.unrecorded.items()):
            del self.unrecorded[idx]
            self.status[idx] = FAILED
            self._emit(fx.Record(rec))
        return self._end(now)

    # -- stopping --------------------------------------------------------------------------

    def stop(self, why: str, now: float) -> list[fx.Effect]:
        """A signal (``why``: its name) asks the run to stop; a second one abandons what is
        in flight."""
        if self.done:
            return []
        if not self.running:
            return self._stop_before_running(why, now)
        if self.stopping:
            self._log(
                WARNING, f"{why} again: stopping now, abandoning {len(self.inflight)} in flight"
            )
            self.inflight.clear()
            self._check_done()
            return self._end(now)
        self.stopping = f"signal {why}"
        self._emit(fx.StopFeed(), fx.NotifyStopping())
        # What waits for a paused area (or to be sent again) is pending for the next run.
        for p in [*self.retry_commits, *self.requeue]:
            self.inflight.pop(p.rid, None)
            self.by_idx.pop(p.idx, None)
        self.retry_commits.clear()
        self.requeue.clear()
        self._log(INFO, f"{why}: stopping; draining {len(self.inflight)} sample(s) in flight")
        self._emit(fx.Record(ev.RunState(state="draining", reason=self.stopping)))
        self.drain_deadline = now + self.rules.drain_timeout
        self._check_done()
        return self._end(now)

    def _stop_before_running(self, why: str, now: float) -> list[fx.Effect]:
        """A signal before the producer is up: nothing was sent, so the run stops at once
        (``run_stopped`` only when ``run_started`` is journaled: a refused start writes
        nothing)."""
        self.stopping = f"signal {why}"
        self._emit(fx.StopFeed(), fx.NotifyStopping())
        self._log(INFO, f"{why} before the pipeline started: stopping")
        if self.announced:
            reason = f"{self.stopping} while starting"
            self._emit(fx.Record(ev.RunStopped(reason=reason, exit_code=EXIT_OK)))
        self._set_done()
        return self._end(now)

    def lose(self, what: str, now: float) -> list[fx.Effect]:
        """The output is not where it was opened (removed, moved, replaced)."""
        self._lose(what)
        return self._end(now)

    def journal_failed(self, message: str, now: float) -> list[fx.Effect]:
        """The journal failed in a way no pause can cure (the recorder's report): stop at
        once; a restart replays what is durable."""
        said = f"journal failure, stopping (rerun to resume from what is durable): {message}"
        if not self.running:
            said = f"journal failure before the run started: {message}"
        return self.abort(f"journal failure: {message}", now, said)

    def abort(self, why: str, now: float, said: str = "") -> list[fx.Effect]:
        """Stop at once with exit 1 (``why`` is the stop's reason): what is in flight is
        abandoned, and redone on resume."""
        if self.stopping or self.done:
            return []
        self._log(ERROR, said or f"{why}; stopping (rerun to resume)")
        self.exit_code = EXIT_INTERNAL
        self.stopping = why
        self.inflight.clear()
        self._emit(fx.StopFeed())
        self._set_done()
        return self._end(now)

    def dataset_changed(self, what: str, now: float) -> list[fx.Effect]:
        """The dataset is not the file the run pinned at its start (``what`` names it and
        says how): stop at once with exit 6, never finished. What is in flight was read
        from the pinned content; it is abandoned (pending), as nothing new may be read."""
        if self.done:
            return []
        self._log(
            ERROR,
            f"{what}: stopping at once (exit {EXIT_FINGERPRINT}); the run is not finished."
            " Put the file back as it was and rerun the same command, or start again with"
            " a new --output for the new content",
        )
        self.exit_code = EXIT_FINGERPRINT
        self.stopping = what
        self.inflight.clear()
        self.requeue.clear()
        self.retry_commits.clear()
        self._emit(fx.StopFeed())
        self._emit(fx.Record(ev.RunStopped(reason=what, exit_code=EXIT_FINGERPRINT)))
        self._set_done()
        return self._end(now)

    def _producer_broken(self, what: str) -> None:
        """The producer's dumps break the job's capture contract (``what``: the layers or
        hidden size expected and found): every dump it writes would be refused alike, so the
        run stops at once with exit 8, never finished, and no sample is charged (what is in
        flight is pending again)."""
        if self.done:
            return
        who = self.rules.producer or "the producer"
        said = f"{who} writes dumps that break the job's capture contract: {what}"
        self._log(
            ERROR,
            f"{said}. Stopping at once (exit {EXIT_PRODUCER}); no sample was charged. Start"
            " the producer with the job's layers (for SGLang: the arguments of `eagle3d"
            " sglang-args --model-path MODEL`) and rerun the same command",
        )
        self.exit_code = EXIT_PRODUCER
        self.stopping = said
        self.inflight.clear()
        self.requeue.clear()
        self.retry_commits.clear()
        self._emit(fx.StopFeed())
        self._emit(fx.Record(ev.RunStopped(reason=said, exit_code=EXIT_PRODUCER)))
        self._set_done()

    def finish(self, now: float) -> list[fx.Effect]:
        """After :class:`~eagle3d.core.effects.Finish` (the last reading is taken):
        ``run_finished``, the journal's last word on a finished job, and the exit status."""
        if self.lost or self.done:
            return []
        saved, failed = self.counts()
        code = finish_code(saved, failed, self.total, self.rules.max_failed_fraction)
        self._emit(fx.Record(ev.RunFinished(saved=saved, failed=failed, exit_code=code)))
        self._say_finished(code, already=False)
        self.exit_code = code
        self._set_done()
        return self._end(now)

    def _say_finished(self, code: int, already: bool) -> None:
        """The one wording of a finished shard: its counts, and why it fails if it does."""
        saved, failed = self.counts()
        counts = describe_counts(saved, failed, self.total)
        self._log(INFO, f"{'nothing to do: job already ' if already else ''}finished: {counts}")
        words = outcome_words(code, failed, self.total, self.rules.max_failed_fraction)
        if words:
            self._log(ERROR, words)
