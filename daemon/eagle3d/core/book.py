"""The ledger's state and the rules that move a sample; :mod:`eagle3d.core.ledger` feeds it
events. Pure: see :mod:`eagle3d.core.ledger` for the rules in words."""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass

from eagle3proto import events as ev

from eagle3d.core import effects as fx
from eagle3d.core.envfault import EnvFault, Verdict
from eagle3d.core.messages import Msg, ProducerReport
from eagle3d.core.pauses import Pauses
from eagle3d.core.resume import describe_counts
from eagle3d.core.sample import FAILED, SAVED, SENT, Ended, Rejected, Request, Sample
from eagle3d.core.window import room
from eagle3d.exitcodes import EXIT_OK, EXIT_OUTPUT

DUMP_FULL_MEMORY_S = 60.0  # a dump that never arrives this long after the area was full
#: How long a committed sample's dump is the reaper's to remove: a scan that sees it
#: meanwhile does not call it an orphan (the reaper runs at the lowest priority, behind).
REAPER_GRACE_S = 120.0
VANISHED = Verdict(counted=False, why="its dump was removed before it was read")
MIB = 1 << 20
INFO, WARNING, ERROR = logging.INFO, logging.WARNING, logging.ERROR

Fed = Sample | Rejected | Ended


@dataclass(frozen=True, slots=True)
class Rules:
    """The settings the ledger's rules depend on."""

    window: int
    max_attempts: int = 3
    request_timeout: float = 600.0
    drain_timeout: float = 60.0
    max_failed_fraction: float = 0.05
    dump_dir: str = ""
    dataset: str = ""  # named in the warning for a rejected row
    producer: str = (
        ""  # named when its dumps break the capture contract ("the SGLang server at URL")
    )


class Book:
    """The per-sample state of one shard's run (the rules: :mod:`eagle3d.core.ledger`).

    ``status`` holds a byte per dataset row (:mod:`eagle3d.core.sample`), as resumed from
    the journal; ``ids`` are this shard's rows; ``total`` its samples (blank rows are none).
    """

    def __init__(
        self,
        status: bytearray,
        ids: range,
        total: int,
        rules: Rules,
        *,
        rid_prefix: str,
        session: int,
        bytes_per_token: float,
        now: float = 0.0,
    ) -> None:
        self.status = status
        self.ids = ids
        self.total = total
        self.rules = rules
        self.rid_prefix = rid_prefix
        self.session = session
        self.inflight: dict[str, Sample] = {}
        #: rids of samples saved within REAPER_GRACE_S, oldest first: their dumps are the
        #: reaper's (a scan seeing one is no orphan)
        self.reaping: dict[str, float] = {}
        self.by_idx: dict[int, Sample] = {}
        self.queue: deque[Fed] = deque()  # handed over by the feeder, not yet taken
        self.requeue: deque[Sample] = deque()  # uncounted failures waiting for a pause to end
        self.retry_commits: list[Sample] = []  # commits waiting for a pause to end
        self.unrecorded: dict[int, ev.SampleFailed] = {}  # failures the journal refused
        self.pauses = Pauses()  # the paused areas
        self.announced = False  # run_started is in the journal
        self.running = False  # the producer is up: requests may be sent
        self.early: list[ProducerReport] = []  # the producer's reports before run_started
        self.held: list[Msg] = []  # what came before the producer was up, handled once it is
        self.stopping = ""  # why the run stops, '' while it does not
        self.lost = ""  # the output is not where it was: what happened
        self.feed_done = False
        self.finishing = False
        self.done = False
        self.exit_code = EXIT_OK
        self.last_progress = now  # when a sample was last saved or failed for good
        self.drain_deadline = math.inf
        self.dump_free = -1  # the dump area's free bytes as last observed (-1: unknown)
        self.dump_full_at = -math.inf  # when the dump area was last seen full
        self.bytes_per_token = bytes_per_token  # of a dump: an estimate, then the largest seen
        self._bpt_seen = 0.0
        self.largest_dump = 0
        self.largest_sample = 0
        self._out: list[fx.Effect] = []

    # -- what the shell asks -------------------------------------------------------------------

    def counts(self) -> tuple[int, int]:
        """(saved, failed) samples of this shard."""
        own = self.own_status()
        return own.count(SAVED), own.count(FAILED)

    def own_status(self) -> bytearray:
        """This shard's rows' statuses, in order (a copy: counted at memory speed)."""
        ids = self.ids
        return self.status[ids.start : ids.stop : ids.step]

    @property
    def paused(self) -> str:
        """The pause's reason ('' while running)."""
        return self.pauses.reason

    @property
    def faults(self) -> dict[str, EnvFault]:
        return self.pauses.faults

    @property
    def idle(self) -> bool:
        """Legitimately quiet: paused, or nothing in flight before the feed has ended."""
        return bool(self.paused) or (not self.inflight and not self.feed_done)

    @property
    def phase(self) -> str:
        return "paused" if self.paused else ("draining" if self.stopping else "running")

    def owns(self, rid: str) -> bool:
        """Whether ``rid`` names a request of this run and shard."""
        return rid.startswith(self.rid_prefix)

    def room(self) -> bool:
        """Whether the window allows one more request now (:func:`eagle3d.core.window.room`)."""
        inflight = self.inflight
        w = self.rules.window
        return room(inflight.values(), len(inflight), w, self.dump_free, self.bytes_per_token)

    # -- the rules -------------------------------------------------------------------------

    def _emit(self, *effects: fx.Effect) -> None:
        self._out.extend(effects)

    def _log(self, level: int, message: str) -> None:
        self._out.append(fx.Log(level, message))

    def _end(self, now: float) -> list[fx.Effect]:
        self._pump(now)
        out, self._out = self._out, []
        return out

    def _pump(self, now: float) -> None:
        """Send what the window allows: samples sent again first, then the feeder's rows."""
        while self.running and not (self.done or self.stopping or self.paused) and self.room():
            if self.requeue:
                self._send(self.requeue.popleft(), now)
                continue
            if not self.queue:
                return
            item = self.queue.popleft()
            self._emit(fx.Taken())
            if isinstance(item, Ended):
                self.feed_done = True
                self._check_done()
            elif isinstance(item, Rejected):
                self._reject(item)
            elif item.idx in self.by_idx:  # a bug, said loudly, not a wedge
                self._log(ERROR, f"sample {item.idx} handed over while already in flight; ignored")
            else:
                self._send(item, now)

    def _reject(self, r: Rejected) -> None:
        # Said in the foreground too, naming the file: the record alone is only visible to
        # someone who already knows to look at the journal.
        self._log(WARNING, f"{self.rules.dataset}: {r.message}")
        self.status[r.idx] = FAILED
        self._emit(
            fx.Record(ev.SampleFailed(idx=r.idx, error=r.error, message=r.message, attempt=0))
        )

    def _send(self, p: Sample, now: float) -> None:
        if p.recount:
            p.attempt += 1
        p.recount = True
        p.sends += 1
        p.rid = f"{self.rid_prefix}{self.session}-{p.idx}-{p.sends}"
        p.stage, p.started, p.sent_at = SENT, False, now
        self.inflight[p.rid] = p
        self.by_idx[p.idx] = p
        tokens = len(p.input_ids)
        self._emit(
            fx.Record(ev.SampleSent(idx=p.idx, rid=p.rid, attempt=p.attempt, tokens=tokens)),
            fx.Submit(Request(p.rid, p.idx, p.input_ids, p.attempt, now)),
        )

    def _fail(self, p: Sample, error: str, message: str, verdict: Verdict, now: float) -> None:
        """An attempt failed. The sample's own failure (``verdict.counted``) is retried while
        attempts remain, else failed for good. The environment's counts no attempt: the
        sample is sent again (after the pause on ``verdict.pause``, if any). During a stop
        nothing is sent and nothing fails: the sample is pending for the next run."""
        self.inflight.pop(p.rid, None)
        p.stage = 0
        if self.stopping:
            message = f"{message} (during the stop: pending for the next run)"
            self._emit(fx.Record(_failed(p, error, message, retry=True, environment=True)))
            self.by_idx.pop(p.idx, None)
            self._check_done()
            return
        if not verdict.counted:
            self._emit(fx.Record(_failed(p, error, message, retry=True, environment=True)))
            self._log(
                WARNING,
                f"sample {p.idx}: {error}: {message}; not the sample's fault ({verdict.why}): sent again, no attempt counted",
            )
            p.recount = False
            self.requeue.append(p)
            if verdict.pause is not None:
                self._pause(verdict.pause, now)
            return
        retry = p.attempt < self.rules.max_attempts
        self._emit(fx.Record(_failed(p, error, message, retry=retry)))
        if retry:
            self._log(
                WARNING, f"sample {p.idx} attempt {p.attempt} failed ({error}: {message}); retrying"
            )
            self.requeue.append(p)
            return
        self._log(
            WARNING,
            f"sample {p.idx} failed for good after {p.attempt} attempt(s): {error}: {message}",
        )
        self.status[p.idx] = FAILED
        self.by_idx.pop(p.idx, None)
        self.last_progress = now
        self._check_done()

    def _pause(self, fault: EnvFault, now: float) -> None:
        if self.pauses.add(fault, now):
            self._log(
                ERROR,
                f"paused: {fault.reason}; resumes by itself once it can write there again (or send SIGHUP)",
            )
            self._emit(fx.Paused(fault))

    def _lose(self, what: str) -> None:
        """Stop at once, journal nothing more (into a file nobody would see), and never say
        finished."""
        if self.lost:
            return
        self.lost = what
        self._log(
            ERROR,
            f"{what}: stopping at once (exit {EXIT_OUTPUT}); nothing more is journaled and the run is not finished. Put the output back where it was and rerun the same command, or start again with a new --output",
        )
        self.exit_code = EXIT_OUTPUT
        self.stopping = self.stopping or f"output lost: {what}"
        self.inflight.clear()
        self.requeue.clear()
        self.retry_commits.clear()
        self._emit(fx.StopFeed())
        self._set_done()

    def _check_done(self) -> None:
        if self.inflight or self.done or self.finishing:
            return
        if self.stopping:
            self._emit(fx.Record(ev.RunStopped(reason=self.stopping, exit_code=self.exit_code)))
            saved, failed = self.counts()
            left = self.total - saved - failed
            counts = describe_counts(saved, failed, self.total)
            self._log(
                INFO,
                f"stopped ({self.stopping}): {counts}, {left} left; resumable: rerun the same command",
            )
            self._set_done()
        elif self.feed_done and not (self.requeue or self.faults or self.unrecorded):
            self.finishing = True
            self._emit(fx.Finish())

    def _set_done(self) -> None:
        self.done = True
        self._emit(fx.Done(self.exit_code))


def _failed(
    p: Sample, error: str, message: str, *, retry: bool, environment: bool = False
) -> ev.SampleFailed:
    """The ``sample_failed`` record of ``p``'s attempt."""
    return ev.SampleFailed(
        idx=p.idx,
        error=error,
        message=message,
        attempt=p.attempt,
        retry=retry,
        environment=environment,
    )
