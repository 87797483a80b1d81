"""The monitor over a job of several sessions: the real daemon (synthetic producer) stopped
with SIGTERM or killed with SIGKILL between them, the TUI's real feed attached throughout.

* The producer panel's counts (and ``--once --json``'s) equal the journal's own, read by the
  independent reader: the last session's on the row labelled "this session", every
  session's on the row labelled "whole job" (issue #29: "dumps 10,257" of one session stood
  beside "requests 313,509" of all).
* The feed holds a bounded amount across the restarts: when the socket is back it keeps no
  journal fall-back, so the read after the next stop takes the checkpoint's tail, not the
  whole session the socket showed (a long session's records decoded at once: memory the
  TUI kept, 41 to 130 MB over three restarts).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import os
import random
import re
import signal
import time
from pathlib import Path
from typing import Any

import runkit
from eagle3proto import reducer
from eagle3top import hostpanels
from eagle3top.feeds import LocalFeed
from eagle3top.model import Row
from eagle3top.sources import discover
from monitor_helpers import top

#: Checkpoints every this many records: the most a fall-back after a kill must read.
CHECKPOINT_EVERY = 500
#: Requests each session makes before it is stopped (each is 3+ records).
PER_SESSION = 2500


def tokens_dataset(path: Path, n: int) -> Path:
    r = random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            ids = [r.randrange(1, 900) for _ in range(16)]
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 4 + [1] * 12}) + "\n")
    return path


async def until(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def journal_counts(out: Path) -> list[dict[str, int]]:
    """Per session (split at each ``run_started``), the journal's own counts."""
    sessions: list[dict[str, int]] = []
    for r in runkit.records(out):
        kind = r.get("kind")
        if kind == "run_started":
            sessions.append({"requests": 0, "retries": 0, "dumps": 0, "orphans": 0})
        elif not sessions:
            continue
        elif kind == "sample_sent":
            sessions[-1]["requests"] += 1
            sessions[-1]["retries"] += int(r.get("attempt", 1) > 1)
        elif kind == "sample_dumped":
            sessions[-1]["dumps"] += 1
        elif kind == "dump_orphan":
            sessions[-1]["orphans"] += 1
    return sessions


def panel_rows(text: str) -> dict[str, list[int]]:
    """The producer panel's counter table: its span label -> its four numbers."""
    rows = {}
    for line in text.splitlines():
        for span in ("this session", "whole job"):
            if line.startswith(span):
                rows[span] = [int(x.replace(",", "")) for x in line[len(span) :].split()]
    return rows


def live_in(row: Row, session: int) -> bool:
    """The row shows session ``session`` live, with its first ``PER_SESSION`` requests."""
    s = row.state
    return (
        row.conn == "live"
        and s is not None
        and s.session == session
        and s.session_requests >= PER_SESSION
    )


def on_journal(row: Row) -> bool:
    return row.conn == "journal" and row.alive is False


def live_objects() -> int:
    gc.collect()
    return sum(type(o) is reducer.ShardState for o in gc.get_objects())


async def test_panel_counts_per_session_and_in_all_and_the_feed_stays_bounded(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = tokens_dataset(tmp_path / "d.jsonl", 200_000)
    out = tmp_path / "out"
    env = {"EAGLE3D_CHECKPOINT_EVERY": str(CHECKPOINT_EVERY)}
    feed: LocalFeed | None = None
    task: asyncio.Task[None] | None = None
    objects: list[int] = []
    try:
        for k, sig in enumerate((signal.SIGTERM, signal.SIGKILL, signal.SIGTERM, signal.SIGKILL)):
            proc = runkit.start(tiny_model_dir, data, out, "--backend", "synthetic", env=env)
            with runkit.reaped(proc):
                if feed is None:
                    await until(lambda: (out / ".eagle3d").is_dir(), 60, "the state folder")
                    feed = LocalFeed(discover(str(out), None)[0], time.time, interval=0.25)
                    task = asyncio.create_task(feed.run())
                row = feed.row
                await until(
                    functools.partial(live_in, row, k + 1),
                    120,
                    f"session {k + 1} live with {PER_SESSION} requests",
                )
                # Live: the journal's stand-in is gone, and the state's buffers are bounded.
                assert feed._jstate is None and feed._follower is None
                s = row.state
                assert len(s.history) <= reducer.HISTORY_SECONDS
                assert len(s.errors) <= reducer.MAX_ERRORS
                assert len(s.stage) <= 64
                objects.append(live_objects())
                os.killpg(proc.pid, sig)
                await asyncio.to_thread(proc.wait, 60)
            await until(functools.partial(on_journal, row), 30, "the journal fall-back")
            # The read after a stop takes the checkpoint's tail (a SIGTERM's final checkpoint
            # leaves none; a kill, what came after the newest one), never the session whole.
            assert feed.largest_read <= 4 * CHECKPOINT_EVERY, (k, feed.largest_read)
        # No state is kept per session (other tests' states may be alive in this process).
        assert max(objects) <= objects[0], objects
        assert feed is not None and feed.row.state is not None
        sessions = journal_counts(out)
        assert len(sessions) == 4
        assert all(x["requests"] >= PER_SESSION for x in sessions)
        whole = {k: sum(x[k] for x in sessions) for k in sessions[0]}
        order = ("requests", "dumps", "retries", "orphans")
        # The panel as the TUI draws it, from the feed's own state.
        text = hostpanels.producer([feed.row], time.time()).plain
        rows = panel_rows(text)
        assert rows["this session"] == [sessions[-1][k] for k in order], text
        assert rows["whole job"] == [whole[k] for k in order], text
        assert re.search(r"requests\s+dumps\s+retries\s+orphan dumps", text)
        assert "its own uptime" in text and "dumps it made this session" in text
        assert "restarts 0 this session" in text
    finally:
        if task is not None:
            task.cancel()
    # --once --json, from the journal (the daemon is down): the same counts, named by span.
    r = top("--once", "--json", "--output", str(out))
    doc = json.loads(r.stdout)
    for k in order:
        assert doc[k] == whole[k] and doc[f"session_{k}"] == sessions[-1][k], (k, doc)
