""" "Disk full" only below the job's reserve (issue 27, point 7): ``run_started`` records the
run's ``--space-reserve`` in bytes; the monitor's verdict calls the output disk full
(CRITICAL) only while its free space is below that reserve, and a disk above it that the rest
of the job will not fit is a WARNING with the numbers. Before, any disk under 256 MiB free was
``output disk full`` CRITICAL while the run worked normally on it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import runkit
from eagle3proto import events as ev
from eagle3proto import reducer
from eagle3top.model import Row
from eagle3top.report import CRITICAL, OK, WARNING, Report
from monitor_helpers import EAGLE3_TOP
from runkit import ENV

pytestmark = pytest.mark.timeout(300)
NOW = 1_800_000_000.0
MB = 10**6


def _state(reserve: int, free: int, state: str = "running", saved: int = 10) -> reducer.ShardState:
    """A shard of 1000 samples of 1 MB each, ``saved`` of them saved, its output disk with
    ``free`` bytes free; ``reserve`` as ``run_started`` recorded it (-1: not recorded)."""
    evs: list[ev.Event] = [
        ev.RunStarted(ts=NOW - 100, total=1000, space_reserve_bytes=reserve),
        ev.RunState(ts=NOW - 90, state="running"),
    ]
    for i in range(saved):
        evs.append(
            ev.SampleSaved(ts=NOW - 60 + i, idx=i, path="p", bytes=MB, tokens=1, checksum="")
        )
    if state == "paused":
        evs.append(ev.RunState(ts=NOW - 5, state="paused", reason="disk full writing to /o"))
    disk = ev.DiskUsage(label="output", path="/o", total_bytes=10**12, free_bytes=free)
    evs.append(ev.Stats(ts=NOW - 1, state=state, disk=[disk]))
    s = reducer.new_state()
    for i, e in enumerate(evs):
        e.seq = i
    reducer.apply_all(s, evs)
    return s


def _judge(s: reducer.ShardState) -> Report:
    row = Row(label="s0", host="h", output="/o", shard="s0", state=s, source="socket", alive=True)
    row.conn, row.last_msg = "live", NOW - 0.2  # type: ignore[assignment]
    return Report.judge([row], NOW)


#: (reserve recorded, free bytes, daemon state, level, words the verdict says or "" for none)
CASES = [
    # 183.8 MB free above a 64 MB reserve, the rest (990 MB) does not fit: a warning, with
    # the numbers, never "full" (before: CRITICAL "output disk full (183.8 MB free)").
    (64 * MB, 183_800_000, "running", WARNING, "183.8 MB free, reserve 64.0 MB, the job needs"),
    # the same disk with room for the rest: nothing to say.
    (64 * MB, 2000 * MB, "running", OK, ""),
    # below the job's own reserve: full, naming the reserve.
    (256 * MB, 183_800_000, "running", CRITICAL, "output disk full: 183.8 MB free, below"),
    # a reserve of 0: never full by the monitor's word (the daemon's pause says so if it is).
    (0, 1 * MB, "running", WARNING, "reserve 0 B"),
    # a journal from before the reserve was recorded: the default reserve, 256 MiB.
    (-1, 183_800_000, "running", CRITICAL, "below the job's reserve 268.4 MB"),
    # paused on the full disk: the pause says it (CRITICAL); no second finding.
    (256 * MB, 1 * MB, "paused", CRITICAL, "disk full writing to /o"),
]


@pytest.mark.parametrize(("reserve", "free", "state", "level", "words"), CASES)
def test_disk_verdict(reserve: int, free: int, state: str, level: int, words: str) -> None:
    r = _judge(_state(reserve, free, state))
    assert r.levels == [level], r.messages
    said = " | ".join(r.messages)
    if words:
        assert words in said, said
    else:
        assert "disk" not in said, said
    if free >= max(reserve, 0) and reserve >= 0:
        assert "full" not in said, said


def test_a_run_above_its_reserve_on_a_small_disk_is_not_full(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A real run on a 64 MiB filesystem (far under the old 256 MiB "full" line) with a
    1 MiB reserve: while it works, ``--once`` says nothing of a full disk and its JSON
    carries the reserve the journal recorded."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        data, out = tmp_path / "data.jsonl", mnt / "out"
        runkit.write_jsonl(data, runkit.conversations(40))
        proc = runkit.start(
            tiny_model_dir,
            data,
            out,
            "--workers",
            "1",
            "--space-reserve",
            "1M",
            fault="worker_slow:300",
            log=tmp_path / "log",
        )
        with runkit.reaped(proc):
            started = {}

            def working() -> bool:
                nonlocal started
                runs = runkit.records(out, "run_started") if out.exists() else []
                saved = runkit.records(out, "sample_saved") if runs else []
                started = runs[-1] if runs else {}
                return len(saved) >= 2

            runkit.wait_for(working, 120, "two samples saved")
            assert started["space_reserve_bytes"] == 1 << 20, started
            p = subprocess.run(
                [EAGLE3_TOP, "--once", "--json", "--output", str(out)],
                capture_output=True,
                text=True,
                timeout=60,
                env=ENV,
            )
            doc = json.loads(p.stdout)
            assert proc.poll() is None, "the run ended before the monitor looked"
            assert doc["state"] == "running", doc
            disk = next(d for d in doc["disk"] if d["label"] == "output")
            assert disk["free_bytes"] < 256 << 20 and disk["reserve_bytes"] == 1 << 20, disk
            assert disk["full"] is False, disk
            assert not any("full" in m for m in doc["messages"]), doc["messages"]
            assert doc["level"] == "OK" and p.returncode == 0, doc["messages"]
            assert runkit.exit_code(proc, 200, tmp_path / "log") == 0
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
