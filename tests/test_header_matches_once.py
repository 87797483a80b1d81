"""The TUI's header states the same verdict ``eagle3-top --once`` computes, in every state of
``tests/test_once.py``: the real console script for ``--once``, the real TUI (its own feeds,
under Pilot) for the screen, both on the same journals, locks and live sources."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator

import pytest
from eagle3proto import events as ev
from eagle3proto import paths
from eagle3proto.journal import list_segments
from eagle3top.app import Eagle3Top, build_feeds
from eagle3top.cli import build_parser
from monitor_helpers import (
    event_source,
    hold_lock,
    run_events,
    shown_reason,
    stats,
    top,
    wait_for,
    write_journal,
)

pytestmark = pytest.mark.timeout(120)


@contextlib.contextmanager
def nothing() -> Iterator[None]:
    yield


def running(out: str) -> contextlib.AbstractContextManager[object]:
    src = event_source(out, "--total", "100000", "--rate", "300", "--bytes", "1000")

    @contextlib.contextmanager
    def live() -> Iterator[None]:
        with src:
            assert wait_for(lambda: json.loads(top("--once", "--json", "-o", out).stdout)["saved"])
            yield

    return live()


def finished(out: str) -> contextlib.AbstractContextManager[object]:
    t0 = time.time() - 100
    write_journal(out, [*run_events(t0, 3, 3), ev.RunFinished(ts=t0 + 4, saved=3)])
    return nothing()


def stopped(code: int) -> Callable[[str], contextlib.AbstractContextManager[object]]:
    def setup(out: str) -> contextlib.AbstractContextManager[object]:
        t0 = time.time() - 50
        events = run_events(t0, total=10, saved=4)
        events.append(
            ev.RunStopped(ts=t0 + 5, reason="signal" if not code else "x", exit_code=code)
        )
        write_journal(out, events)
        return nothing()

    return setup


def down(out: str) -> contextlib.AbstractContextManager[object]:
    write_journal(out, run_events(time.time() - 30, total=10, saved=4))
    return nothing()


def stalled(out: str) -> contextlib.AbstractContextManager[object]:
    write_journal(out, run_events(time.time() - 1000, total=10, saved=4))
    return hold_lock(out)


def unknown(out: str) -> contextlib.AbstractContextManager[object]:
    return nothing()


def torn(out: str) -> contextlib.AbstractContextManager[object]:
    jdir = write_journal(out, run_events(time.time() - 20, total=10, saved=5))
    seg = list_segments(jdir)[-1]
    with open(seg, "r+b") as f:
        f.truncate(os.path.getsize(seg) - 7)
    return nothing()


def disk(free: int) -> Callable[[str], contextlib.AbstractContextManager[object]]:
    def setup(out: str) -> contextlib.AbstractContextManager[object]:
        now = time.time()
        events = run_events(now - 30, total=1000, saved=20, step=1.0, bytes_each=10**9)
        events.append(stats(now - 1, free=free))
        write_journal(out, events)
        return hold_lock(out)

    return setup


def failures(out: str) -> contextlib.AbstractContextManager[object]:
    write_journal(out, run_events(time.time() - 10, total=100, saved=5, failed=2))
    return hold_lock(out)


def shards(out: str) -> contextlib.AbstractContextManager[object]:
    t0 = time.time() - 100
    for i in range(2):
        events = run_events(t0, total=5, saved=5 if i == 0 else 2)
        if i == 0:
            events.append(ev.RunFinished(ts=t0 + 6, saved=5))
        write_journal(out, events, paths.Shard(i, 2))
    return nothing()


SCENARIOS = {
    "running": (running, "running", "OK"),
    "finished": (finished, "finished", "OK"),
    "stopped-clean": (stopped(0), "stopped", "WARNING"),
    "stopped-failed": (stopped(3), "stopped", "CRITICAL"),
    "down": (down, "down", "CRITICAL"),
    "stalled": (stalled, "stalled", "WARNING"),
    "unknown": (unknown, "unknown", "UNKNOWN"),
    "torn-tail": (torn, "down", "CRITICAL"),
    "disk-full": (disk(1 << 20), "running", "CRITICAL"),
    "disk-short": (disk(500 * 10**9), "running", "WARNING"),
    "failures-rising": (failures, "running", "WARNING"),
    "several-shards": (shards, "down", "CRITICAL"),
}


def _numbers_out(text: str) -> str:
    """Ages and counts move between two reads a second apart: compare the words (a long
    reason wraps on screen, and may end cut short with an ellipsis)."""
    return re.sub(r"\d[\d,.]*", "N", " ".join(text.split())).removesuffix("…")


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_header_states_the_once_verdict(tmp_path, name: str) -> None:
    setup, state, level = SCENARIOS[name]
    out = str(tmp_path / "out")
    with setup(out):
        p = top("--once", "--json", "--output", out)
        doc = json.loads(p.stdout)
        assert (doc["state"], doc["level"], p.returncode) == (
            state,
            level,
            {"OK": 0, "WARNING": 1, "CRITICAL": 2, "UNKNOWN": 3}[level],
        ), doc["messages"]
        args = build_parser().parse_args(["--output", out, "--interval", "0.25"])
        feeds, watch = build_feeds(args, time.time)
        app = Eagle3Top(feeds, interval=0.25, watch=watch)
        async with app.run_test(size=(120, 40)) as pilot:
            for _ in range(100):
                if all(f.row.state is not None or f.row.error for f in feeds):
                    break
                await pilot.pause(0.05)
            await pilot.pause(0.3)
            app.tick()
            from textual.widgets import Static

            header = str(app.query_one("#header", Static).content)
            line = str(app.query_one("#verdict", Static).content)
    word = state.replace("_", " ").upper()
    assert f" {word}  {level} " in header, (header, doc)
    if doc["reason"]:
        want, got = _numbers_out(doc["reason"]), _numbers_out(shown_reason(line))
        assert len(got) >= min(len(want), 100), (line, doc)  # whole, or cut after two lines
        assert want.startswith(got), (line, doc)
