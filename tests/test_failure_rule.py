"""One failure rule (issue 27, point 7): the daemon's exit code and the monitor's verdict
follow the run's own ``--max-failed-fraction`` (recorded in the journal); under it, no
warning; a warning names the rule; a model load after a restart carries no "rising" warning;
``verify`` is not OK on an output where every sample failed (its own exit code, 3)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from eagle3proto import events as ev
from eagle3proto import reducer
from eagle3top.model import Row
from eagle3top.report import OK, WARNING, Report
from monitor_helpers import EAGLE3_TOP
from runkit import ENV, conversations, records, run, write_jsonl

pytestmark = pytest.mark.timeout(300)
NOW = 1_800_000_000.0


def test_two_percent_bad_rows_under_the_default_rule_is_ok(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", [*conversations(49), "{not json"])
    out = tmp_path / "out"
    # runkit passes --max-failed-fraction 0.5 by default; this run uses the daemon's own default.
    args = ("--max-failed-fraction", "0.05")
    r = run(tiny_model_dir, data, out, *args)
    assert r.returncode == 0, r.stderr[-2000:]
    started = records(out, "run_started")[-1]
    assert started["max_failed_fraction"] == 0.05
    p = subprocess.run(
        [EAGLE3_TOP, "--once", "--json", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    doc = json.loads(p.stdout)
    assert doc["level"] == "OK" and p.returncode == 0, doc["messages"]
    assert not any("fail" in m for m in doc["messages"]), doc["messages"]


def _state(mff: float, failed: int, saved: int, state: str = "running") -> reducer.ShardState:
    evs: list[ev.Event] = [
        ev.RunStarted(ts=NOW - 100, total=1000, max_failed_fraction=mff),
        ev.RunState(ts=NOW - 90, state="running"),
    ]
    for i in range(saved):
        evs.append(
            ev.SampleSaved(ts=NOW - 60 + i * 0.1, idx=i, path="p", bytes=1, tokens=1, checksum="")
        )
    for k in range(failed):
        evs.append(ev.SampleFailed(ts=NOW - 30, idx=saved + k, error="bad_json", message="x"))
    if state == "loading":  # a restart: a new session loading its model
        evs.append(ev.RunStarted(ts=NOW - 5, total=1000, session=2, max_failed_fraction=mff))
        evs.append(ev.RunState(ts=NOW - 4, state="loading", reason="loading model m"))
    s = reducer.new_state()
    for i, e in enumerate(evs):
        e.seq = i
    reducer.apply_all(s, evs)
    return s


def _judge(s: reducer.ShardState) -> Report:
    row = Row(label="s0", host="h", output="/o", shard="s0", state=s, source="socket", alive=True)
    row.conn, row.last_msg = "live", NOW - 0.2  # type: ignore[assignment]
    return Report.judge([row], NOW)


def test_the_monitor_follows_the_run_s_own_rule() -> None:
    # 2 of 100 finished recently failed (2 %): under 5 %, nothing; over 1 %, a warning naming it.
    assert _judge(_state(0.05, failed=2, saved=98)).levels == [OK]
    r = _judge(_state(0.01, failed=2, saved=98))
    assert r.levels == [WARNING]
    assert any("more than --max-failed-fraction 0.01" in m for m in r.messages), r.messages


def test_over_the_job_s_limit_says_the_run_will_exit_9() -> None:
    r = _judge(_state(0.001, failed=2, saved=98))
    assert any(
        "too many failures: 2 of 1000 samples failed for good" in m and "exit 9" in m
        for m in r.messages
    ), r.messages


def test_a_model_load_after_a_restart_carries_no_rising_warning() -> None:
    r = _judge(_state(0.01, failed=2, saved=98, state="loading"))
    assert not any("failures rising" in m for m in r.messages), r.messages


def test_verify_is_not_ok_when_every_sample_failed(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", ["{not json", '{"messages": []}'])
    out = tmp_path / "out"
    r = run(tiny_model_dir, data, out)
    assert r.returncode == 9, r.stderr[-2000:]
    v = subprocess.run(
        [sys.executable, "-m", "eagle3d", "verify", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert v.returncode == 3, v.stdout
    assert "NOTHING SAVED" in v.stdout and "every sample failed (2)" in v.stdout
    assert "\nOK" not in v.stdout
    j = subprocess.run(
        [sys.executable, "-m", "eagle3d", "verify", "--output", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    doc = json.loads(j.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 3
