"""eagle3d.run.reaper: committed dumps removed off the commit threads, once each, bounded."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from eagle3d.run import reaper as rp
from eagle3d.run.reaper import Reaper, limit_for


def _dumps(d: Path, n: int, size: int = 4096) -> list[tuple[str, int]]:
    out = []
    for i in range(n):
        p = d / f"dump-{i}.safetensors"
        p.write_bytes(b"x" * size)
        out.append((str(p), size))
    return out


def test_every_dump_handed_over_is_removed_by_the_reaper_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dumps = _dumps(tmp_path, 20)
    seen: list[tuple[str, str]] = []
    real = rp._unlink

    def spy(path: str) -> None:
        seen.append((path, threading.current_thread().name))
        real(path)

    monkeypatch.setattr(rp, "_unlink", spy)  # the module's own seam: every removal, by whom
    r = Reaper(limit=1 << 20)
    r.remove(dumps[:12])
    r.remove(dumps[12:])
    r.close()  # what is queued is removed before close returns
    assert not list(tmp_path.iterdir())
    assert sorted(p for p, _ in seen) == sorted(p for p, _ in dumps)  # once each
    assert {who for _, who in seen} == {"dump-reaper"}
    assert (r.removed, r.inline, r.pending) == (20, 0, 0)


def test_past_the_bound_the_caller_removes_its_own_dumps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the reaper is held up, at most ``limit`` bytes wait; the rest is removed at once
    by the committing thread, so the dump area cannot fill with committed dumps."""
    dumps = _dumps(tmp_path, 10, size=1000)
    release = threading.Event()
    busy = threading.Event()
    real = rp._unlink
    by_caller: list[str] = []

    def slow(path: str) -> None:
        if threading.current_thread().name == "dump-reaper":
            busy.set()
            release.wait(30)
        else:
            by_caller.append(path)
        real(path)

    monkeypatch.setattr(rp, "_unlink", slow)
    r = Reaper(limit=3500)
    try:
        r.remove(dumps[:1])
        assert busy.wait(10)  # the reaper is stuck on the first dump (1000 bytes pending)
        r.remove(dumps[1:])
        assert r.pending <= 3500
        # Two more fit under the bound; the other seven were removed by this thread.
        assert by_caller == [p for p, _ in dumps[3:]]
        assert all(not os.path.exists(p) for p in by_caller)
        assert all(os.path.exists(p) for p, _ in dumps[:3])
        assert r.inline == 7
    finally:
        release.set()
        r.close()
    assert not list(tmp_path.iterdir())
    assert (r.removed, r.inline, r.pending) == (3, 7, 0)


def test_after_close_dumps_are_removed_at_once_and_a_gone_one_is_no_error(
    tmp_path: Path,
) -> None:
    dumps = _dumps(tmp_path, 2)
    r = Reaper()
    r.close()
    os.unlink(dumps[0][0])  # removed by someone else meanwhile
    r.remove(dumps)
    assert not list(tmp_path.iterdir())
    assert r.inline == 2


def test_the_bound_is_a_share_of_a_small_dump_area(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    assert limit_for(str(tmp_path)) == min(rp.LIMIT_BYTES, st.f_blocks * st.f_frsize // 8)
    assert limit_for(str(tmp_path / "missing")) == rp.LIMIT_BYTES


def test_the_reaper_runs_at_the_lowest_priority(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dumps = _dumps(tmp_path, 1)
    prio: list[int] = []
    real = rp._unlink

    def spy(path: str) -> None:
        prio.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        real(path)

    monkeypatch.setattr(rp, "_unlink", spy)
    r = Reaper()
    r.remove(dumps)
    r.close()
    assert prio == [19]
