"""The progress line of ``eagle3d run`` / ``demo``: its words (pure) and when it is written.

The live, in-place line on a real terminal is tested in ``tests/test_tmux.py``.
"""

from __future__ import annotations

import io

from eagle3d.progress import ProgressLine, describe
from eagle3proto import events as ev
from eagle3proto import reducer

T = 1_800_000_000.0


def fold(*events: ev.Event) -> reducer.ShardState:
    s = reducer.new_state()
    for i, e in enumerate(events):
        e.seq = i
        reducer.apply(s, e)
    return s


def saves(n: int, t0: float, step: float = 0.5) -> list[ev.Event]:
    out: list[ev.Event] = []
    for i in range(n):
        out.append(ev.SampleSent(ts=t0 + i * step, idx=i, tokens=100))
        out.append(
            ev.SampleSaved(
                ts=t0 + i * step + 0.1, idx=i, path="p", bytes=1, tokens=100, checksum=""
            )
        )
    return out


def test_the_words_for_each_state() -> None:
    assert describe(reducer.new_state(), T) == "starting"  # no "saved 0/-1", no "ETA 0s"
    loading = fold(
        ev.RunStarted(ts=T - 20, total=500),
        ev.RunState(ts=T - 12, state="loading", reason="loading model /m (hf, device auto)"),
    )
    assert describe(loading, T) == "loading model /m (hf, device auto) · 12 s"
    waiting = fold(
        ev.RunStarted(ts=T - 40, total=500),
        ev.ProducerEvent(
            ts=T - 30, state="waiting", message="waiting for SGLang at http://h (30 s)"
        ),
    )
    assert describe(waiting, T) == "waiting for SGLang at http://h (30 s) · 30 s"
    run = fold(
        ev.RunStarted(ts=T - 60, total=500),
        ev.RunState(ts=T - 40, state="running", reason="producer hf up"),
        *saves(50, T - 30),
        ev.SampleFailed(ts=T - 2, idx=900, error="E"),
    )
    # The rate is since the producer came up (50 in 40 s), not since the session began (60 s);
    # the failed sample is counted on its own, not as progress.
    assert describe(run, T) == (
        "saved 50/500 (10.0%) · 1 failed · in flight 0 · 1.25 samples/s · 125 tok/s · ETA 5 m 59 s"
    )
    paused = fold(
        ev.RunStarted(ts=T - 60, total=500),
        *saves(50, T - 30),
        ev.RunState(ts=T - 5, state="paused", reason="disk full writing to /o"),
    )
    line = describe(paused, T + 600)
    assert line.startswith("PAUSED: disk full writing to /o · saved 50/500 (10.0%)")
    assert line.endswith("(frozen)")
    done = fold(ev.RunStarted(ts=T - 9, total=2), *saves(2, T - 5), ev.RunFinished(ts=T - 1))
    assert describe(done, T) == "finished: saved 2/2 (100.0%)"


def test_plain_lines_on_a_change_of_state_and_every_ten_seconds() -> None:
    out = io.StringIO()
    line = ProgressLine.for_stream(out, every=10.0)
    assert not line.live  # not a terminal
    s = fold(
        ev.RunStarted(ts=T - 2, total=10),
        ev.RunState(ts=T - 1, state="loading", reason="loading model /m"),
    )
    for k in range(12):
        line.update(s, T + k)
    reducer.apply(s, ev.RunState(seq=9, ts=T + 12, state="running", reason="up"))
    line.update(s, T + 12)
    lines = out.getvalue().splitlines()
    assert lines == [
        "  loading model /m · 1 s",
        "  loading model /m · 11 s",
        "  saved 0/10 (0.0%) · in flight 0 · 0.00 samples/s · 0 tok/s · ETA unknown yet",
    ]
