"""What the monitor knows about each shard, and the pure judgement of its health.

A :class:`Row` is one shard of one daemon as a source delivered it: the reducer state, where
it came from (socket, journal, ssh relay), whether the daemon is known to be alive, and when
the source last said anything. :func:`health` turns a row into one word of
``running | finished | stalled | stopped | down`` plus a reason. Time is an argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle3proto.reducer import ShardState, View, combine, view

#: No saved sample for this long while work is left and the daemon runs: "stalled".
STALL_AFTER_S = 120.0
#: No record at all (stats come every ~1 s) for this long from a live source: "stalled".
SILENT_AFTER_S = 30.0
#: A connected socket that said nothing for this long is shown as STALE.
STALE_AFTER_S = 5.0

HEALTH_STATES = ("running", "finished", "stalled", "stopped", "down")


@dataclass
class Row:
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
    notes: list[str] = field(default_factory=list)

    def view(self, now: float) -> View:
        if self.state is None:
            return View(label=self.label, state="unknown")
        return view(self.state, now, label=self.label)


@dataclass(frozen=True, slots=True)
class Health:
    state: str  # one of HEALTH_STATES, or "unknown" when nothing could be read
    reason: str = ""


def health(row: Row, now: float) -> Health:
    """Judge one shard. Pure: the row and ``now`` in, a word and a reason out."""
    s = row.state
    if s is None:
        return Health("unknown", row.error or "no socket and no journal")
    v = view(s, now)
    if s.state == "finished":
        return Health("finished", f"{v.saved} saved, {v.failed} failed")
    if row.alive is False:
        if s.state == "stopped":
            why = s.state_reason or "stopped"
            if s.stop_code:
                return Health("stopped", f"run failed (exit {s.stop_code}): {why}")
            return Health("stopped", f"{why}; resumable, {v.remaining} left")
        return Health("down", f"daemon not running, {v.remaining} samples left")
    if s.state == "stopped":
        return Health("stopped", s.state_reason or "stopped")
    if s.state == "paused":
        return Health("stalled", f"paused: {s.state_reason}" if s.state_reason else "paused")
    if s.state == "empty":
        return Health("running", "starting")
    if v.age_s is not None and v.age_s > SILENT_AFTER_S:
        return Health("stalled", f"no record for {int(v.age_s)} s")
    if v.remaining > 0 and s.session_start_ts and now - s.session_start_ts > STALL_AFTER_S:
        last_save = s.changed.get("saved", s.session_start_ts)
        since = now - max(last_save, s.session_start_ts)
        if since > STALL_AFTER_S:
            return Health("stalled", f"nothing saved for {int(since)} s")
    return Health("running", s.state_reason if s.state == "draining" else "")


def worst(states: list[str]) -> str:
    """The state of several shards together: the most alarming one wins."""
    order = ("down", "stalled", "unknown", "running", "stopped", "finished")
    for st in order:
        if st in states:
            return st
    return "unknown"


def totals(rows: list[Row], now: float) -> View:
    """Sum of the shards that have a state."""
    return combine([r.view(now) for r in rows if r.state is not None])
