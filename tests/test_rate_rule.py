"""One definition of each rate (issue 27, point 6), in ``eagle3proto.views``: the live rate is
what was saved over the last minute of *working* time (paused, loading, draining and the gaps
between sessions left out); a finished or stopped job shows its rate over its whole working
span, which time passing does not change; the status line, the text, the progress line and
the panels print the same figure."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from eagle3proto import events as ev
from eagle3proto import reducer, views
from monitor_helpers import EAGLE3_TOP
from runkit import ENV, conversations, events, run, write_jsonl

T0 = 1_800_000_000.0


def _saved(ts: float, idx: int) -> ev.SampleSaved:
    return ev.SampleSaved(ts=ts, idx=idx, path="p", bytes=100, tokens=10, checksum="")


def _fold(evs: list[ev.Event]) -> reducer.ShardState:
    s = reducer.new_state()
    for i, e in enumerate(evs):
        e.seq = i
    reducer.apply_all(s, evs)
    return s


def test_the_live_rate_leaves_a_pause_out() -> None:
    # 60 s working at 1 sample/s, paused 120 s, then 30 s at 2 samples/s.
    evs: list[ev.Event] = [
        ev.RunStarted(ts=T0, total=1000),
        ev.RunState(ts=T0 + 10, state="running"),
    ]
    evs += [_saved(T0 + 10 + i, i) for i in range(60)]
    evs.append(ev.RunState(ts=T0 + 70, state="paused", reason="disk full"))
    evs.append(ev.RunState(ts=T0 + 190, state="running", reason="resumed"))
    evs += [_saved(T0 + 190 + i / 2, 100 + i) for i in range(60)]
    s = _fold(evs)
    v = views.view(s, T0 + 220)
    # The last working minute: 30 s before the pause at 1/s and 30 s after it at 2/s.
    assert v.rate_1m.samples_s == pytest.approx(1.5)
    assert v.rate_eta.samples_s == v.rate_1m.samples_s  # the ETA uses the same figure
    assert v.work_s == pytest.approx(90.0)


def test_a_model_load_is_no_working_time() -> None:
    evs: list[ev.Event] = [
        ev.RunStarted(ts=T0, total=100),
        ev.RunState(ts=T0 + 1, state="loading", reason="loading model m"),
        ev.RunState(ts=T0 + 50, state="running"),
    ]
    evs += [_saved(T0 + 50 + i, i) for i in range(10)]
    v = views.view(_fold(evs), T0 + 60)
    assert v.rate_1m.samples_s == pytest.approx(1.0)


@pytest.mark.parametrize("end", ["finished", "stopped"])
def test_an_ended_job_s_rate_is_frozen_over_its_working_span(end: str) -> None:
    evs: list[ev.Event] = [ev.RunStarted(ts=T0, total=40), ev.RunState(ts=T0 + 5, state="running")]
    evs += [_saved(T0 + 5 + i / 4, i) for i in range(20)]  # 4/s for 5 s
    # A second session after a gap of an hour: the gap is no working time.
    evs.append(ev.RunStopped(ts=T0 + 10, reason="signal SIGTERM"))
    evs.append(ev.RunStarted(ts=T0 + 3600, total=40, session=2))
    evs.append(ev.RunState(ts=T0 + 3610, state="running"))
    evs += [_saved(T0 + 3610 + i / 2, 20 + i) for i in range(10)]  # 2/s for 5 s
    if end == "finished":
        evs.append(ev.RunFinished(ts=T0 + 3615, saved=30))
    else:
        evs.append(ev.RunStopped(ts=T0 + 3615, reason="signal SIGTERM"))
    s = _fold(evs)
    rates = {round(views.view(s, T0 + 3615 + dt).rate_1m.samples_s, 9) for dt in (0, 60, 86400)}
    assert rates == {30 / 10.0}  # 30 saved over 5 + 5 working seconds, whatever the time


@pytest.fixture(scope="module")
def finished(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("rates")
    data = write_jsonl(root / "data.jsonl", conversations(24))
    out = root / "out"
    r = run(tiny_model_dir, data, out)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _expected(out: Path) -> float:
    """Saved over working time, from the journal by hand: running until run_finished."""
    evs = events(out)
    up = next(e.ts for e in evs if isinstance(e, ev.RunState) and e.state == "running")
    end = next(e.ts for e in evs if isinstance(e, ev.RunFinished))
    saved = sum(isinstance(e, ev.SampleSaved) for e in evs)
    return saved / (end - up)


def _once(out: Path, *args: str) -> str:
    p = subprocess.run(
        [EAGLE3_TOP, "--once", "--output", str(out), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    return p.stdout


def test_every_surface_prints_the_finished_job_s_one_rate(finished: Path) -> None:
    want = _expected(finished)
    doc: dict[str, Any] = json.loads(_once(finished, "--json"))
    assert doc["rate_samples_s"] == pytest.approx(want, rel=1e-3)
    assert doc["eta_rate_samples_s"] == pytest.approx(want, rel=1e-3)
    text = _once(finished)
    status = text.splitlines()[0]
    perf = float(re.search(r" rate=([0-9.e+-]+);", status).group(1))  # type: ignore[union-attr]
    assert perf == pytest.approx(want, rel=1e-3)
    # The text rounds to what still says something (2 decimals under 10/s, none from 100/s).
    shown = float(re.search(r"\brate ([0-9.,]+) samples/s", text).group(1).replace(",", ""))  # type: ignore[union-attr]
    assert shown == pytest.approx(want, abs=0.5 if want >= 100 else 0.05), text
    prom = _once(finished, "--format", "prometheus")
    line = next(ln for ln in prom.splitlines() if ln.startswith("eagle3d_rate_samples_per_second{"))
    assert float(line.rsplit(" ", 1)[1]) == pytest.approx(want, rel=1e-3)


def test_the_tui_panels_print_the_same_rate(finished: Path) -> None:
    from test_tmux import Tmux

    want = _expected(finished)
    t = Tmux([EAGLE3_TOP, "--output", str(finished)])
    try:
        screen = t.wait_screen(
            lambda s: "FINISHED" in s and re.search(r"samples\s+[1-9]", s) is not None
        )
    finally:
        t.kill()
    row = next(ln for ln in screen.splitlines() if re.search(r"│?\s*samples\s+[0-9.]+/s", ln))
    figures = re.findall(r"([0-9.]+)/s", row)
    # 10 s and 1 min: frozen, equal; printed to 2 decimals, the hand-made rate within the
    # last one (a rate at ...5 may round either way after another order of float sums).
    assert figures[0] == figures[1], row
    assert float(figures[0]) == pytest.approx(want, abs=0.01), row
