"""What the monitor knows about each shard, and the pure judgement of its health.

A :class:`Row` is one shard of one daemon as a source delivered it: the reducer state, where
it came from (socket, journal, ssh relay), whether the daemon is known to be alive, and when
the source last said anything. :func:`health` turns a row into a :class:`Health`: a state
word, a level (the monitoring-plugins code it is worth) and a reason. Time is an argument.

States (``HEALTH_STATES``) and their levels:

* ``running`` OK; ``stopping`` OK (draining after a signal); ``finished`` OK, but WARNING
  when more samples failed than the run's ``--max-failed-fraction`` allows and CRITICAL when
  every sample failed (the run's ``run_finished`` carries exit code 9);
* ``starting`` / ``loading`` (the producer is not up yet) OK for ``LOAD_LIMIT_S``, or longer
  while the load makes progress (the producer's memory grew within ``LOAD_PROGRESS_S``),
  else WARNING;
* ``waiting`` (for a producer that is not up yet at start) OK for ``LOAD_LIMIT_S``, then
  CRITICAL;
* ``producer_down`` (the producer went away mid-run) WARNING, CRITICAL after
  ``PRODUCER_CRITICAL_S``;
* ``paused`` WARNING, CRITICAL when the disk is full or unwritable;
* ``stalled`` (the producer is up but nothing is saved for ``STALL_AFTER_S``, or no record
  at all for ``SILENT_AFTER_S``) WARNING;
* ``stopped`` WARNING when clean with work left, CRITICAL when the run failed;
* ``down`` (the daemon is gone with work left) CRITICAL;
* ``unknown`` (nothing to read) UNKNOWN.
"""

from __future__ import annotations

import re

import msgspec
from eagle3proto import layouts, wire
from eagle3proto.reducer import ShardState
from eagle3proto.views import (
    SILENT_AFTER_S,
    STALL_AFTER_S,
    View,
    combine,
    on_boot_clock,
    timeline_now,
    view,
)

from .fmt import duration

OK, WARNING, CRITICAL, UNKNOWN = 0, 1, 2, 3
LEVEL_WORDS = {OK: "OK", WARNING: "WARNING", CRITICAL: "CRITICAL", UNKNOWN: "UNKNOWN"}
#: Worst first: CRITICAL, WARNING, UNKNOWN, OK (an unreachable shard is less alarming than
#: a failing one, and more than a healthy one).
SEVERITY = (CRITICAL, WARNING, UNKNOWN, OK)

#: A connected socket that said nothing for this long is shown as STALE.
STALE_AFTER_S = 5.0
#: Starting, loading the model or waiting for the producer is healthy for this long.
LOAD_LIMIT_S = 900.0
#: ... and a load stays healthy beyond it while it made progress this recently.
LOAD_PROGRESS_S = 60.0
#: A producer down mid-run is a warning, and critical after this long.
PRODUCER_CRITICAL_S = 300.0

HEALTH_STATES = (
    "running",
    "finished",
    "stopping",
    "starting",
    "loading",
    "waiting",
    "producer_down",
    "paused",
    "stalled",
    "stopped",
    "down",
)
#: Among shards of the same level, the state shown for all of them: the most telling first.
STATE_ORDER = (
    "down",
    "producer_down",
    "stalled",
    "paused",
    "waiting",
    "unknown",
    "loading",
    "starting",
    "stopping",
    "running",
    "stopped",
    "finished",
)


class Row(msgspec.Struct):
    """One shard as one source sees it."""

    label: str
    host: str = ""
    shard: str = ""
    output: str = ""
    state: ShardState | None = None
    source: str = ""  # socket | journal | ssh
    alive: bool | None = None  # the daemon process: True, False, or unknown
    conn: str = "connecting"  # live | journal | disconnected | connecting
    last_msg: float | None = None  # wall time the source last delivered anything
    retry_at: float | None = None
    attempts: int = 0
    error: str = ""
    notes: list[str] = []
    #: the shard count that took over this journal's rest (0: its layout is the current one;
    #: set by :func:`mark_layouts`)
    closed_by: int = 0
    #: a starting daemon's stage, from its start beacon (None: not from a beacon)
    start: wire.StartInfo | None = None
    #: the monitor's boot id and ``CLOCK_BOOTTIME`` when judged (:func:`stamp_clocks`):
    #: ages of a journal of this boot are boot-clock differences (:meth:`at`)
    boot_id: str = ""
    boottime: float = 0.0

    def at(self, now: float) -> float:
        """The wall time ``now`` on this row's timeline (:func:`eagle3proto.views.timeline_now`):
        what every age, rate and ETA of the row is measured from."""
        s = self.state
        return now if s is None else timeline_now(s, now, self.boot_id, self.boottime)

    def by_wall_clock(self) -> bool:
        """Whether this row's ages are wall-clock differences although its daemon stamped
        the boot clock: the journal is of another host or boot (or the monitor has no boot id)."""
        s = self.state
        return s is not None and bool(s.anchor_bt) and not on_boot_clock(s, self.boot_id)

    def shown(self) -> ShardState | None:
        """The state as the job counts it: a closed journal's total is what it settled."""
        s = self.state
        if s is None or not self.closed_by:
            return s
        return layouts.closed_view(s, self.closed_by)

    def gone(self) -> bool:
        """Whether the daemon behind this row is known not to run (its readings are old)."""
        s = self.state
        return self.alive is False or (s is not None and s.state in ("finished", "stopped"))

    def view(self, now: float) -> View:
        now = self.at(now)
        s = self.shown()
        if s is None:
            return View(label=self.label, state="unknown")
        frozen = None
        if self.alive is False and s.state not in ("finished", "stopped"):
            newest = max(s.last_ts.values()) if s.last_ts else now
            frozen = (newest, "daemon down")
        return view(s, now, label=self.label, frozen=frozen)


class Health(msgspec.Struct, frozen=True):
    state: str  # one of HEALTH_STATES, or "unknown" when nothing could be read
    level: int = OK
    reason: str = ""


_TRAILING_SECONDS = re.compile(r"\s*\(\d+(?:\.\d+)?\s*s\)\s*$")
#: Words of a pause reason that mean the disk refuses writes (the daemon names the errno).
_UNWRITABLE = ("permission denied", "read-only", "i/o error", "quota")


#: A record dated this far after the monitor's "now" means the clocks disagree (the wall
#: clock was set back, or the daemon's host runs ahead): no age can then be trusted.
CLOCK_SKEW_S = 5.0


def _future(s: ShardState, now: float) -> float:
    """How far the newest time the journal holds lies after ``now`` (<= 0: none does)."""
    stamps = [*s.last_ts.values(), s.state_since, s.producer_since, s.up_ts]
    return max(stamps, default=0.0) - now


def _clock_back(s: ShardState, now: float) -> Health | None:
    """UNKNOWN when an age would be negative (never judged OK, nor stalled), else None."""
    ahead = _future(s, now)
    if ahead <= CLOCK_SKEW_S:
        return None
    return Health(
        "unknown",
        UNKNOWN,
        f"the newest record is dated {_since(ahead)} after this clock (the clock was set"
        " back, or the daemon's runs ahead): ages, stalls and the ETA cannot be judged",
    )


def _since(seconds: float) -> str:
    return duration(max(seconds, 0.0))


def health(row: Row, now: float) -> Health:
    """Judge one shard. Pure: the row and ``now`` in, a word, a level and a reason out.
    Ages are taken on the row's timeline (:meth:`Row.at`): a wall clock stepped under the
    daemon or the monitor hides no stall and makes none."""
    now = row.at(now)
    s = row.shown()
    if s is None:
        return Health("unknown", UNKNOWN, row.error or "no socket and no journal")
    if row.closed_by:
        return Health("finished", OK, f"{s.saved:,} saved, {s.failed:,} failed; {s.state_reason}")
    total = s.total
    remaining = max(total - s.saved - s.failed, 0) if total >= 0 else 0
    if s.state == "finished":
        if s.finish_code:  # the daemon's own verdict (eagle3d run exit 9): not success
            what = f"{s.failed:,} of {total:,} samples failed ({s.saved:,} saved)"
            return Health("finished", CRITICAL if s.saved == 0 else WARNING, what)
        return Health("finished", OK, f"{s.saved:,} saved, {s.failed:,} failed")
    if row.alive is False:
        if s.state == "stopped":
            return _stopped(s, remaining)
        newest = max(s.last_ts.values()) if s.last_ts else None
        gone = f" (last record {_since(now - newest)} ago)" if newest is not None else ""
        return Health("down", CRITICAL, f"daemon not running{gone}, {remaining:,} samples left")
    skewed = _clock_back(s, now)
    if skewed is not None:
        return skewed
    if s.state == "stopped":
        level = CRITICAL if s.stop_code else WARNING
        return Health("stopped", level, s.state_reason or "stopped")
    if s.state == "paused":
        why = s.state_reason.lower()
        # A full or unwritable disk (the daemon's reason names it) needs an operator.
        disk = ("disk" in why and "full" in why) or any(w in why for w in _UNWRITABLE)
        return Health("paused", CRITICAL if disk else WARNING, s.state_reason or "no reason given")
    if s.producer == "waiting":
        waited = now - s.producer_since
        what = _TRAILING_SECONDS.sub("", s.producer_message) or "waiting for the producer"
        reason = f"{what} for {_since(waited)}"
        if waited > LOAD_LIMIT_S:
            return Health("waiting", CRITICAL, f"{reason} (limit {_since(LOAD_LIMIT_S)})")
        return Health("waiting", OK, reason)
    if s.state in ("empty", "starting", "loading"):
        return _loading(s, now)
    if s.producer == "down":
        down = now - s.producer_since
        why = f": {s.producer_message}" if s.producer_message else ""
        level = CRITICAL if down > PRODUCER_CRITICAL_S else WARNING
        return Health("producer_down", level, f"producer down for {_since(down)}{why}")
    newest = max(s.last_ts.values()) if s.last_ts else None
    if newest is not None and now - newest > SILENT_AFTER_S:
        return Health("stalled", WARNING, f"no record for {int(now - newest)} s")
    if remaining > 0 and s.up_ts:
        last_save = max(s.changed.get("saved", s.up_ts), s.up_ts)
        if now - last_save > STALL_AFTER_S:
            return Health("stalled", WARNING, f"nothing saved for {int(now - last_save)} s")
    if s.state == "draining":
        return Health("stopping", OK, s.state_reason or "draining")
    if s.producer == "restarting":
        return Health("running", OK, f"producer restarting: {s.producer_message}")
    return Health("running", OK, "")


def _stopped(s: ShardState, remaining: int) -> Health:
    """A stopped session whose daemon is gone: failed, not started, or resumable."""
    why = s.state_reason or "stopped"
    if s.stop_code:
        return Health("stopped", CRITICAL, f"run failed (exit {s.stop_code}): {why}")
    if not s.up_ts and s.saved == s.failed == 0:
        # Stopped before its producer was up, and nothing was ever done: the job has not
        # started (whatever its sessions count).
        return Health("stopped", WARNING, f"not started: {remaining:,} left ({why}); resumable")
    return Health("stopped", WARNING, f"{why}; resumable, {remaining:,} left")


def _loading(s: ShardState, now: float) -> Health:
    word = "loading" if s.state == "loading" else "starting"
    since = s.state_since or s.session_start_ts or now
    elapsed = now - since
    what = s.state_reason or ("loading the model" if word == "loading" else "starting")
    reason = f"{what} for {_since(elapsed)}"
    progress = now - s.load_progress_ts if s.load_progress_ts else None
    if elapsed <= LOAD_LIMIT_S or (progress is not None and progress <= LOAD_PROGRESS_S):
        return Health(word, OK, reason)
    quiet = f"no progress for {_since(progress)}" if progress is not None else "no progress seen"
    return Health(word, WARNING, f"{reason}, {quiet} (limit {_since(LOAD_LIMIT_S)})")


def stamp_clocks(rows: list[Row], boot_id: str, boottime: float) -> None:
    """Give every row the monitor's boot clock reading, taken just before a judgement."""
    for r in rows:
        r.boot_id, r.boottime = boot_id, boottime


def rank(level: int, state: str) -> tuple[int, int]:
    """Sort key: the most alarming (level, state) first."""
    order = STATE_ORDER.index(state) if state in STATE_ORDER else len(STATE_ORDER)
    return SEVERITY.index(level), order


def worst(states: list[str]) -> str:
    """The state of several shards together, by state alone: the most telling one wins."""
    for st in STATE_ORDER:
        if st in states:
            return st
    return "unknown"


def mark_layouts(rows: list[Row]) -> None:
    """Mark the rows of journals closed by a change of the shard count: per output (one
    monitor may watch several jobs), the newest session's layout is the current one
    (:mod:`eagle3proto.layouts`)."""
    jobs: dict[str, list[tuple[Row, ShardState]]] = {}
    for r in rows:
        r.closed_by = 0
        s = r.state
        if s is not None and s.job is not None:
            jobs.setdefault(r.output or s.job.output, []).append((r, s))
    for members in jobs.values():
        current = layouts.current_count(
            (s.job.shard_count, s.session_start_ts) for _, s in members if s.job is not None
        )
        for r, s in members:
            r.closed_by = layouts.closed_by(s, current)


def totals(rows: list[Row], now: float) -> View:
    """Sum of the shards that have a state (a closed journal counts what it settled)."""
    mark_layouts(rows)
    return combine([r.view(now) for r in rows if r.state is not None])
