"""Whitebox kill points: the daemon dies abruptly at a named point, a rerun ends consistent.

``EAGLE3D_FAULT=kill:<point>:<n>`` makes the daemon ``os._exit(137)`` the n-th time it reaches
``<point>`` (see :mod:`eagle3d.remote.faults`), mid-run. After each death the output is checked from
the outside (the crash-loop reader); then the same command without the fault must finish with
every valid sample saved exactly once and ``eagle3d verify`` passing.
"""

from __future__ import annotations

from pathlib import Path

import crashcheck
import pytest
import runkit
from eagle3d.run.commits import COMMIT_BATCH

# (point, n): n is chosen so that the kill lands mid-run, after some samples are saved.
POINTS = {
    "after_tmp_write": 20,  # n-th commit (of 25 valid samples)
    "after_rename": 20,
    "before_journal_append": 20,
    "after_append_before_sync": 15,  # n-th journal fdatasync
    "mid_frame": 12,  # n-th journal write
    "before_dump_removal": 3,  # n-th journaled batch, its dumps not yet handed to the reaper
}


@pytest.mark.parametrize("point", list(POINTS))
def test_kill_point(point: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    valid, malformed = runkit.dataset(data, 25)
    n = POINTS[point]

    r = runkit.run(tiny_model_dir, data, out, fault=f"kill:{point}:{n}")
    assert r.returncode == 137, (r.returncode, r.stderr[-2000:])
    assert "finished:" not in r.stderr  # it died, it did not finish

    c = runkit.check(out)
    assert not c.bad, c.bad  # consistent even right after the death
    assert not c.finished
    if point == "after_tmp_write":
        assert c.temp_files >= 1  # the temp file is there, under no final name
    if point in ("after_rename", "before_journal_append"):
        assert c.leftovers, "a renamed file with no saved record should be left"
    if point == "mid_frame":
        assert c.torn_tail, "half a frame should be at the end of the journal"
    dumps = Path(f"{out}.dumps")
    if point == "before_dump_removal":
        left = sorted(p.name for p in dumps.iterdir() if not p.name.startswith("."))
        assert left, "the journaled batch's dumps should still be in the dump area"
    if point in ("after_tmp_write", "after_rename", "before_journal_append"):
        # Earlier commits stand: at most two batches were running (2 commit threads), the
        # dying one and one other, and every sample of an earlier batch was saved.
        assert len(c.saved) >= n - 1 - (2 * COMMIT_BATCH - 1)

    r2 = runkit.run(tiny_model_dir, data, out)
    assert r2.returncode == 0, r2.stderr[-2000:]
    final = runkit.assert_complete(out, valid, malformed)
    assert c.saved <= final.saved  # nothing saved before the crash was lost
    saved_recs = runkit.records(out, "sample_saved")
    assert len(saved_recs) == len(valid)  # exactly once each
    if point == "mid_frame":
        rec = runkit.records(out, "recovered")
        assert rec and rec[0]["reason"] == "torn" and rec[0]["dropped_bytes"] > 0, rec
        kept = list(Path(crashcheck.journal_dirs(str(out))[0]).glob("*.broken-*"))
        assert kept, "the torn bytes should be kept aside as evidence"
    if point in ("after_rename", "before_journal_append"):
        assert set(c.leftovers) <= final.saved  # the leftover was redone and committed
    if point == "before_dump_removal":
        # The rerun removed what the death left (journaled as orphans of an earlier run),
        # and nothing journaled before the death was committed again (exactly once above).
        assert not [p for p in dumps.iterdir() if not p.name.startswith(".")]
        orphans = {r["path"] for r in runkit.records(out, "dump_orphan")}
        assert {str(dumps / name) for name in left} <= orphans, (left, orphans)
