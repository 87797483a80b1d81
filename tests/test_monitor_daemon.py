"""The monitor against the real daemon (``eagle3d run`` on the tiny model): a slow model load
stays healthy, and a paused run shows PAUSED with its reason and a frozen ETA, on the real
TUI (its own feeds, under Pilot) and in the real ``eagle3-top --once``."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import runkit
from eagle3top import fmt
from eagle3top.app import Eagle3Top, build_feeds
from eagle3top.cli import build_parser
from monitor_helpers import shown_reason, top
from textual.widgets import Static

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def app_for(out: Path) -> Eagle3Top:
    args = build_parser().parse_args(["--output", str(out), "--interval", "0.5"])
    feeds, watch = build_feeds(args, time.time)
    return Eagle3Top(feeds, interval=0.5, watch=watch)


def shown(app: Eagle3Top, wid: str) -> str:
    return str(app.query_one(f"#{wid}", Static).content)


async def once(out: Path) -> tuple[dict, int]:  # type: ignore[type-arg]
    p = await asyncio.to_thread(top, "--once", "--json", "--output", str(out))
    return json.loads(p.stdout), p.returncode


async def until(pred: Callable[[], bool], timeout: float, what: str, pilot: object) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        await pilot.pause(0.25)  # type: ignore[attr-defined]
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


async def test_a_slow_model_load_stays_healthy(tiny_model_dir: Path, tmp_path: Path) -> None:
    """45 s of model load: past the 30 s that read as a stall ("STALLED: no record for 31 s",
    "STALE for 5 s"), --once says loading, OK, exit 0 and the header the same."""
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    valid, malformed = runkit.dataset(data, 20)
    proc = runkit.start(
        tiny_model_dir,
        data,
        out,
        "--workers",
        "1",
        fault="worker_slow_load:45000",
        log=tmp_path / "log",
    )
    with runkit.reaped(proc):
        runkit.wait_for(
            lambda: any(r.get("state") == "loading" for r in runkit.records(out, "run_state")),
            60,
            "a run_state loading record",
        )
        loading = next(r for r in runkit.records(out, "run_state") if r["state"] == "loading")
        assert loading["reason"].startswith(f"loading model {tiny_model_dir} (hf")
        app = app_for(out)
        async with app.run_test(size=(120, 40)) as pilot:
            await until(lambda: time.time() - loading["ts"] > 33, 60, "33 s of loading", pilot)
            doc, rc = await once(out)
            assert (doc["state"], doc["level"], rc) == ("loading", "OK", 0), doc
            assert doc["reason"].startswith("loading model ") and " for 3" in doc["reason"]
            app.tick()
            header, line = shown(app, "header"), shown(app, "verdict")
            assert " LOADING  OK " in header, header
            assert shown_reason(line).startswith(f"loading model {tiny_model_dir}"), line
            assert shown(app, "conn").startswith("● live (socket)")  # the heartbeat: not STALE
            assert "ETA —" in shown(app, "pipeline")
            assert "loading model" in shown(app, "producer")
            beats = [r for r in runkit.records(out, "stats") if r.get("state") == "loading"]
            assert len(beats) >= 25  # one a second while loading
            assert runkit.exit_code(proc, 150, tmp_path / "log") == 0
            await until(lambda: "FINISHED" in shown(app, "header"), 30, "FINISHED", pilot)
    doc, rc = await once(out)
    assert (doc["state"], rc, doc["saved"]) == ("finished", 0, len(valid))
    runkit.assert_complete(out, valid, malformed)


def _mount(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    return r.returncode == 0


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (skipped where this process may not mount)."""
    mnt = tmp_path / "small"
    if os.geteuid() != 0 or not _mount(mnt, "1m"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        for _ in range(50):
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode == 0:
                break
            time.sleep(0.2)


def _eta(pipeline: str) -> str:
    m = re.search(r"^ETA (.+?)  frozen: (.*)$", pipeline, re.M)
    assert m, pipeline
    return m.group(1)


async def test_a_paused_run_shows_paused_its_reason_and_a_frozen_eta(
    tiny_model_dir: Path, small_fs: Path, tmp_path: Path
) -> None:
    data, out = tmp_path / "data.jsonl", small_fs / "out"
    valid, malformed = runkit.dataset(data, 30)  # ~2.5 MB of samples for a 1 MiB filesystem
    # --no-space-check: the job does not fit on purpose (eagle3d plan would refuse it).
    proc = runkit.start(
        tiny_model_dir,
        data,
        out,
        "--dump-dir",
        str(tmp_path / "dumps"),
        "--no-space-check",
        log=tmp_path / "log",
    )
    with runkit.reaped(proc):
        app = app_for(out)
        async with app.run_test(size=(120, 40)) as pilot:
            await until(
                lambda: any(f.row.state and f.row.state.state == "paused" for f in app.feeds),
                120,
                "the TUI to see the pause",
                pilot,
            )
            await pilot.pause(2.0)  # commits already under way when the disk filled end
            app.tick()
            header, line, pipe = shown(app, "header"), shown(app, "verdict"), shown(app, "pipeline")
            assert " PAUSED  CRITICAL " in header, header
            reason = shown_reason(line)
            # The reason names the errno and the output; a long path wraps (at a hyphen), so
            # the path is compared without whitespace.
            assert reason.startswith("disk full (ENOSPC) writing to the output "), line
            assert str(out) in "".join(reason.split()), line
            frozen = _eta(pipe)
            assert "  frozen: paused" in pipe
            doc, rc = await once(out)
            assert (doc["state"], doc["level"], rc) == ("paused", "CRITICAL", 2), doc
            # The same reason as --once, which has room for all of it (the TUI cuts with "…").
            seen, full = "".join(reason.split()), "".join(doc["reason"].split())
            assert seen == full or (seen.endswith("…") and full.startswith(seen[:-1])), (
                line,
                doc["reason"],
            )
            assert doc["finish_ts"] is None
            assert doc["eta_frozen"] == "paused"
            assert fmt.duration(doc["eta_s"]) == frozen
            await pilot.pause(3.0)  # the clock moves on; a frozen ETA does not
            app.tick()
            assert _eta(shown(app, "pipeline")) == frozen
            assert (await once(out))[0]["eta_s"] == doc["eta_s"]
            subprocess.run(["mount", "-o", "remount,size=64m", str(small_fs)], check=True)
            assert runkit.exit_code(proc, 150, tmp_path / "log") == 0
            await until(lambda: "FINISHED" in shown(app, "header"), 30, "FINISHED", pilot)
    states = [r.get("state") for r in runkit.records(out, "run_state")]
    assert states[:2] == ["loading", "running"] and "paused" in states, states
    runkit.assert_complete(out, valid, malformed)
