"""The whole story of one shard's job, folded from its journal (pure: records in, facts out).

:class:`ShardStory` is fed the journal's records in order (``feed``, a
:func:`eagle3proto.journalread.replay` sink). It keeps the reducer's state (the counters every
monitor shows, :mod:`eagle3proto.reducer`) and adds what a monitor only shows the end of:

* every sample failed for good (row, reason, attempts, message), the latest record of a
  sample winning as in the reducer (a later save or retry takes it off the list);
* the pauses, each with its cause and its end (none while it lasts);
* the sessions (each ``run_started``) and how each ended: finished, stopped (with its
  reason and exit code), or died without a word (the next session found it so);
* a time series, one point per ``stats`` record (about one a second) and per change of state:
  saved, failed, tokens/s (the live rate of :mod:`eagle3proto.views`), in flight, committing,
  the output disk's used and free bytes, the GPUs' mean utilisation.

``eagle3d report`` (:mod:`eagle3d.tools.report`) prints it; time is never read here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle3proto import events as ev
from eagle3proto import reducer, views


@dataclass(slots=True)
class Failure:
    idx: int
    reason: str
    attempts: int
    message: str
    ts: float


@dataclass(slots=True)
class Pause:
    start: float
    cause: str
    end: float | None = None  # None: still paused at the journal's end


@dataclass(slots=True)
class Session:
    session: int
    start: float
    host: str = ""
    pid: int = 0
    already_saved: int = 0
    end: float | None = None
    how: str = "running"  # running | finished | stopped | died
    reason: str = ""
    exit_code: int | None = None


@dataclass(slots=True)
class Point:
    """The shard at one moment (a ``stats`` record or a change of state)."""

    t: float
    state: str
    saved: int
    failed: int
    tokens: int
    samples_s: float
    tokens_s: float
    in_flight: int
    committing: int
    disk_used: int | None = None  # the output filesystem's, bytes
    disk_free: int | None = None
    gpu_util: float | None = None  # the mean over the devices, percent


@dataclass(slots=True)
class ShardStory:
    name: str
    state: reducer.ShardState = field(default_factory=reducer.new_state)
    failures: dict[int, Failure] = field(default_factory=dict)
    pauses: list[Pause] = field(default_factory=list)
    sessions: list[Session] = field(default_factory=list)
    points: list[Point] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    #: the shard count that took over the rest of its rows (0: its layout is the current one)
    closed_by: int = 0

    def feed(self, batch: list[ev.AnyEvent]) -> None:
        """Fold a batch of records (in journal order)."""
        for e in batch:
            self._before(e)
            reducer.apply(self.state, e)
            # Where the reducer folded it: the session's timeline (docs/monitor.md), so
            # that a wall clock stepped mid-run moves no pause, session or point.
            self._after(e, self.state.newest_ts)

    def _before(self, e: ev.AnyEvent) -> None:
        if isinstance(e, ev.RunStarted) and self.sessions and self.sessions[-1].how == "running":
            last = self.sessions[-1]  # it ended without a word: killed, or the machine died
            last.how, last.end = "died", self.state.newest_ts or last.start
            self._end_pause(last.end)

    def _after(self, e: ev.AnyEvent, t: float) -> None:
        match e:
            case ev.RunStarted():
                self.sessions.append(
                    Session(e.session, t, e.host, e.pid, e.already_saved + e.already_failed)
                )
            case ev.SampleFailed() if not e.retry:
                self.failures[e.idx] = Failure(e.idx, e.error, e.attempt, e.message, t)
            case ev.SampleFailed() | ev.SampleSaved():
                self.failures.pop(e.idx, None)
            case ev.RunState():
                if e.state == "paused":
                    if not self.pauses or self.pauses[-1].end is not None:
                        self.pauses.append(Pause(t, e.reason))
                else:
                    self._end_pause(t)
                self._point(t)
            case ev.RunStopped() | ev.RunFinished():
                self._end_pause(t)
                if self.sessions:
                    s = self.sessions[-1]
                    s.end, s.exit_code = t, e.exit_code
                    s.how = "finished" if isinstance(e, ev.RunFinished) else "stopped"
                    s.reason = e.reason if isinstance(e, ev.RunStopped) else ""
                self._point(t)
            case ev.Stats():
                self._point(t, own_stats=True)
            case ev.Recovered():
                self.problems.append(f"{e.segment}@{e.offset}: {e.reason}")
            case _:
                pass

    def _end_pause(self, ts: float) -> None:
        if self.pauses and self.pauses[-1].end is None:
            self.pauses[-1].end = ts

    def _point(self, ts: float, own_stats: bool = False) -> None:
        s = self.state
        r = views.working_rates(s, ts, 10.0)
        p = Point(
            t=ts,
            state=s.state,
            saved=s.saved,
            failed=s.failed,
            tokens=s.tokens_saved,
            samples_s=r.samples_s,
            tokens_s=r.tokens_s,
            in_flight=s.in_flight,
            committing=s.committing,
        )
        st = s.stats
        if st is not None and own_stats:  # this point's own stats record
            out = next((d for d in st.disk if d.label == "output"), None)
            if out is not None:
                p.disk_used, p.disk_free = out.used_bytes, out.free_bytes
            if st.gpus:
                p.gpu_util = sum(g.util_percent for g in st.gpus) / len(st.gpus)
        self.points.append(p)

    # -- what it adds up to --------------------------------------------------------------

    @property
    def left(self) -> int:
        s = self.state
        return max(s.total - s.saved - s.failed, 0) if s.total >= 0 else 0

    @property
    def first_ts(self) -> float:
        return self.state.first_ts

    @property
    def last_ts(self) -> float:
        return self.state.newest_ts

    @property
    def wall_s(self) -> float:
        return max(self.last_ts - self.first_ts, 0.0)

    @property
    def working_s(self) -> float:
        return views.working_seconds(self.state, self.last_ts)

    @property
    def rate(self) -> views.Rates:
        """The rate over the working span (every session)."""
        return views.span_rates(self.state, self.last_ts)

    @property
    def paused_s(self) -> float:
        return sum((p.end if p.end is not None else self.last_ts) - p.start for p in self.pauses)


def by_reason(failures: list[Failure]) -> dict[str, list[Failure]]:
    """Failures grouped by reason (the largest group first), each group in row order."""
    groups: dict[str, list[Failure]] = {}
    for f in sorted(failures, key=lambda f: f.idx):
        groups.setdefault(f.reason, []).append(f)
    return dict(sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])))


__all__ = ["Failure", "Pause", "Point", "Session", "ShardStory", "by_reason"]
