"""Ages, rates and ETAs against wall-clock jumps (issue 26, situation 6): pure tables.

A journal's records carry the wall clock (``ts``) and, from the session's ``run_started`` on,
the boot clock (``bt``, CLOCK_BOOTTIME). Each case below writes a session whose daemon's wall
clock is moved (``daemon``: offset in seconds as a function of the true time) and reads it
with a monitor whose own wall clock is moved (``monitor``), on the same boot or another one.
The age, the health, the rate and the ETA must be the true ones on the same boot, whatever
either wall clock did; on another boot the wall clock is all there is, and the row says so.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import msgspec
import pytest
from eagle3proto import events as ev
from eagle3proto import reducer, views
from eagle3proto.journal import JournalWriter
from eagle3proto.journalread import replay
from eagle3top.model import OK, UNKNOWN, WARNING, Row, health, stamp_clocks

T0 = 1_800_000_000.0  # the true wall time of the session's start
B0 = 5_000.0  # the boot clock then
BOOT = "b0a7-1"
H = 3600.0

Offset = Callable[[float], float]


def session(n_saved: int, every: float, daemon: Offset, bt: bool = True) -> reducer.ShardState:
    """A session of 2 * ``n_saved`` rows that saved ``n_saved`` samples, one each ``every``
    true seconds from true time 10 on; the daemon's wall clock reads true + ``daemon(true)``."""

    def stamp(e: ev.Event, x: float) -> ev.Event:
        e.ts, e.bt = T0 + x + daemon(x), (B0 + x if bt else 0.0)
        return e

    events: list[ev.Event] = [
        stamp(ev.RunStarted(total=2 * n_saved, boot_id=BOOT, pid=1), 0.0),
        stamp(ev.RunState(state="running"), 5.0),
    ]
    for i in range(n_saved):
        x = 10.0 + i * every
        events.append(stamp(ev.SampleSent(idx=i), x - 0.5))
        events.append(
            stamp(ev.SampleSaved(idx=i, path=f"p{i}", bytes=10, tokens=5, checksum=""), x)
        )
    for seq, e in enumerate(events):
        e.seq = seq
    return reducer.apply_all(reducer.new_state(), events)


def judged(s: reducer.ShardState, at: float, monitor: float, boot: str = BOOT) -> Row:
    """The row as a monitor sees it at true time ``at``, its wall clock ``monitor`` off."""
    row = Row(label="s", state=s, alive=True, source="journal", conn="journal")
    stamp_clocks([row], boot, B0 + at)
    return row


def none(x: float) -> float:
    return 0.0


def back_1h(x: float) -> float:
    return -H


def back_2h(x: float) -> float:
    return -2 * H


def ahead_3h_at_60(x: float) -> float:
    return 3 * H if x >= 60.0 else 0.0


def back_1h_at_60(x: float) -> float:
    return -H if x >= 60.0 else 0.0


# (case, the daemon's clock, the monitor's offset): 60 saves, one every 2 s (0.5/s) from true
# time 10 to 128; judged at true time 130: the newest record is 2 s old, 60 are left, the ETA
# is 120 s; judged again at 170 (42 s without a record): stalled.
CASES = [
    ("no jump", none, 0.0),
    ("daemon set back 1 h", back_1h, 0.0),
    ("daemon set back 2 h", back_2h, 0.0),
    ("daemon stepped forward 3 h mid-run", ahead_3h_at_60, 0.0),
    ("daemon stepped back 1 h mid-run", back_1h_at_60, 0.0),
    ("monitor set back 1 h", none, -H),
    ("monitor set forward 3 h", none, 3 * H),
    ("both moved apart", back_2h, 3 * H),
]


@pytest.mark.parametrize(("case", "daemon", "monitor"), CASES, ids=[c[0] for c in CASES])
def test_ages_rates_and_eta_are_boot_clock_differences(
    case: str, daemon: Offset, monitor: float
) -> None:
    s = session(60, 2.0, daemon)
    wall = T0 + 130.0 + monitor
    row = judged(s, 130.0, monitor)
    assert not row.by_wall_clock()
    v = row.view(wall)
    assert v.age_s == pytest.approx(2.0)
    assert v.remaining == 60
    # The ETA's window is the 60 s before now: 30 saves over 60 working seconds.
    assert v.rate_eta.samples_s == pytest.approx(0.5, rel=0.05)
    assert v.eta_s == pytest.approx(120.0, rel=0.05)
    h = health(row, wall)
    assert (h.state, h.level) == ("running", OK), h
    later = judged(s, 170.0, monitor)
    h = health(later, T0 + 170.0 + monitor)
    assert (h.state, h.level) == ("stalled", WARNING), h
    assert "no record for 42 s" in h.reason


def test_another_boot_falls_back_to_the_wall_clock_and_says_so() -> None:
    """A journal of another boot (or host): the wall clock is all there is."""
    s = session(60, 2.0, none)
    row = judged(s, 130.0, 0.0, boot="another-boot")
    assert row.by_wall_clock()
    v = row.view(T0 + 130.0)
    assert v.age_s == pytest.approx(2.0)
    assert v.eta_s == pytest.approx(120.0, rel=0.05)
    from eagle3top import once

    doc, _ = once.build([row], T0 + 130.0)
    assert any("wall clock" in n for n in doc.shards[0].notes), doc.shards[0].notes


def test_a_journal_without_boot_clock_stamps_reads_as_before() -> None:
    """An older daemon's records (no ``bt``): ages are wall-clock differences, and a monitor
    whose clock lies behind them judges them unknown, never OK."""
    s = session(60, 2.0, none, bt=False)
    assert s.anchor_bt == 0.0
    row = judged(s, 130.0, 0.0)
    assert not row.by_wall_clock()  # there was no boot clock to use
    assert row.view(T0 + 130.0).age_s == pytest.approx(2.0)
    h = health(row, T0 + 130.0 - H)
    assert h.level == UNKNOWN and "set back" in h.reason, h


def test_an_impossible_boot_clock_reading_is_unknown_never_ok() -> None:
    """A boot-clock reading before the session's start on the same boot cannot be: the ages
    it gives are negative, and the row is judged unknown."""
    s = session(10, 2.0, none)
    row = Row(label="s", state=s, alive=True, source="journal", conn="journal")
    stamp_clocks([row], BOOT, B0 - 100.0)
    h = health(row, T0 + 40.0)
    assert h.level == UNKNOWN, h


# (case, wall time, boot id, boot clock) -> the timeline's now; the session started at T0
# on boot BOOT at boot clock B0.
NOW_CASES = [
    ("same boot, wall in step", T0 + 50, BOOT, B0 + 50, T0 + 50),
    ("same boot, wall 1 h back", T0 + 50 - H, BOOT, B0 + 50, T0 + 50),
    ("same boot, wall 3 h ahead", T0 + 50 + 3 * H, BOOT, B0 + 50, T0 + 50),
    ("another boot", T0 + 50 - H, "other", 12.0, T0 + 50 - H),
    ("no boot id", T0 + 50 - H, "", B0 + 50, T0 + 50 - H),
]


@pytest.mark.parametrize(
    ("case", "wall", "boot", "bt", "want"), NOW_CASES, ids=[c[0] for c in NOW_CASES]
)
def test_timeline_now(case: str, wall: float, boot: str, bt: float, want: float) -> None:
    s = session(1, 1.0, none)
    assert views.timeline_now(s, wall, boot, bt) == pytest.approx(want)


def test_the_writer_stamps_the_boot_clock_from_run_started_on() -> None:
    """Records before a session's ``run_started`` (a recovery note) carry no ``bt``: they
    would be read against the previous session's boot. Old records without ``bt`` decode."""
    clock = iter(range(100, 200))
    with tempfile.TemporaryDirectory() as d:
        w = JournalWriter(d, boottime=lambda: float(next(clock)), background=False)
        w.open(lambda batch: None)
        w.append(ev.Recovered(reason="before"))
        w.append(ev.RunStarted(boot_id=BOOT))
        w.append(ev.Stats())
        w.close()
        got: list[ev.AnyEvent] = []
        replay(os.path.join(d), got.extend)
    assert [(e.kind, e.bt) for e in got] == [
        ("recovered", 0.0),
        ("run_started", 100.0),
        ("stats", 101.0),
    ]
    old = msgspec.msgpack.encode({"kind": "stats", "seq": 3, "ts": 1.0, "run": "r"})
    assert ev.decode(old).bt == 0.0


def test_a_gpus_last_xid_is_placed_on_the_timeline_by_the_boot_clock() -> None:
    """The daemon saw an XID at true time 40 (its wall clock true), then its clock was set
    1 h back at 60; a stats record at 70 names the XID: folded, it is 30 s before the
    record on the session's timeline, not 1 h off either way."""
    s = session(3, 1.0, back_1h_at_60)
    gpu = ev.GpuInfo(index=0, xid_errors=1, last_xid=79, last_xid_ts=T0 + 40.0)
    gpu.last_xid_bt = B0 + 40.0
    stats = ev.Stats(gpus=[gpu])
    stats.ts, stats.bt, stats.seq = T0 + 70.0 - H, B0 + 70.0, 99
    reducer.apply(s, stats)
    assert s.stats is not None
    assert s.stats.gpus[0].last_xid_ts == pytest.approx(T0 + 40.0)
    assert s.stats.gpus[0].last_xid == 79


def test_the_reports_story_measures_pauses_and_sessions_on_the_timeline() -> None:
    """``eagle3d report``'s story of a session whose daemon clock was set 1 h back at true
    time 60, during a pause from 50 to 80, stopped at 100: the pause lasted 30 s and the
    session 100 s, not an hour less."""
    from eagle3d.tools.story import ShardStory

    def stamp(e: ev.Event, x: float) -> ev.Event:
        e.ts, e.bt = T0 + x + back_1h_at_60(x), B0 + x
        return e

    events: list[ev.Event] = [
        stamp(ev.RunStarted(total=10, boot_id=BOOT, pid=1, session=1), 0.0),
        stamp(ev.RunState(state="running"), 5.0),
        stamp(ev.RunState(state="paused", reason="disk full"), 50.0),
        stamp(ev.RunState(state="running", reason="space again"), 80.0),
        stamp(ev.RunStopped(reason="signal SIGTERM", exit_code=0), 100.0),
    ]
    for seq, e in enumerate(events):
        e.seq = seq
    story = ShardStory("s")
    story.feed(list(events))
    assert [p.end - p.start for p in story.pauses if p.end is not None] == [30.0]
    (session,) = story.sessions
    assert session.end is not None and session.end - session.start == pytest.approx(100.0)
    assert story.wall_s == pytest.approx(100.0) and story.paused_s == pytest.approx(30.0)
