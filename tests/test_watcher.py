"""The dump watcher on real inotify: complete dumps are reported, nothing else is."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from eagle3d.dumps.format import read_dump
from eagle3d.dumps.watcher import DumpWatcher
from eagle3d.remote.dumpfile import dump_path, write_dump
from eagle3d.run.inbox import DumpArrived, Inbox

pytestmark = pytest.mark.timeout(60)


async def _settle(got: list[str], want: int, seconds: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while len(got) < want and loop.time() < end:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)  # and nothing more arrives


def _started(d: str, got: list[str]) -> DumpWatcher:
    """A watcher on ``d`` reporting into ``got`` on the loop, through the daemon's inbox as
    the daemon wires it, started (call from the running loop)."""
    inbox = Inbox(lambda msgs: got.extend(m.path for m in msgs if isinstance(m, DumpArrived)))
    inbox.open(asyncio.get_running_loop())
    w = DumpWatcher(d, lambda path: inbox.put(DumpArrived(path)))
    w.start()
    return w


async def test_renamed_and_in_place_dumps_are_reported_reads_and_deletes_are_not(tmp_path) -> None:
    d = str(tmp_path / "dumps")
    got: list[str] = []
    w = _started(d, got)
    try:
        await asyncio.sleep(0.2)
        ids = torch.arange(5)
        renamed = await asyncio.to_thread(
            write_dump, d, "a1", ids, torch.zeros(5, 12), torch.zeros(5, 4), [1, 2, 3]
        )
        await _settle(got, 1)
        assert got == [renamed]  # the temp name was never reported
        got.clear()
        # The daemon's own work on it (read, delete) is no news.
        read_dump(renamed)
        os.unlink(renamed)
        # A producer that writes in place under the final name: reported when closed.
        in_place = dump_path(d, "b2")
        with open(in_place, "wb") as f:
            for _ in range(50):
                f.write(b"x" * 1000)
        # A stray file and a subdirectory are not dumps.
        with open(os.path.join(d, "notes.txt"), "w") as f:
            f.write("hi")
        os.mkdir(os.path.join(d, "sub"))
        await _settle(got, 1)
        assert set(got) == {in_place}
        assert len(got) <= 2  # created + closed at most; fifty writes are not fifty reports
    finally:
        w.stop()
    assert w.scan() == [in_place]


async def test_a_removed_dump_area_is_recreated_and_watched_again(tmp_path) -> None:
    import shutil

    d = str(tmp_path / "dumps")
    got: list[str] = []
    w = _started(d, got)
    try:
        assert w.rearm() is False  # nothing happened: the watch stands
        shutil.rmtree(d)  # a /dev/shm cleanup
        assert w.rearm() is True and os.path.isdir(d)
        assert w.rearm() is False
        await asyncio.sleep(0.2)
        ids = torch.arange(5)
        path = await asyncio.to_thread(
            write_dump, d, "c3", ids, torch.zeros(5, 12), torch.zeros(5, 4), [1, 2, 3]
        )
        await _settle(got, 1)
        assert got == [path]  # reported by inotify again, not only by the periodic scan
    finally:
        w.stop()


def _long_move_pairing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make watchdog hold an ``IN_MOVED_FROM`` for 60 s instead of 0.5 s (its pairing delay,
    wherever this watchdog version keeps it), so that a stall behind one cannot be missed."""
    import importlib

    for module, cls in (
        ("watchdog.observers.inotify_move_event_grouper", "InotifyMoveEventGrouper"),
        ("watchdog.observers.inotify_buffer", "InotifyBuffer"),
    ):
        try:
            monkeypatch.setattr(getattr(importlib.import_module(module), cls), "delay", 60.0)
        except (ImportError, AttributeError):
            continue
        return
    pytest.skip("this watchdog keeps no move-pairing delay")


async def test_a_file_moved_out_of_the_dump_area_does_not_hold_back_the_next_dump(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # watchdog holds an IN_MOVED_FROM at the head of its queue until its pair comes or the
    # delay ends; every event behind it waits. A move out of the area has no pair, and a
    # rename's pair can come late. The watch asks for IN_MOVED_TO only, so nothing is held.
    _long_move_pairing(monkeypatch)
    d = str(tmp_path / "dumps")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    got: list[str] = []
    w = _started(d, got)
    try:
        await asyncio.sleep(0.2)
        stray = os.path.join(d, "notes.txt")
        with open(stray, "w") as f:
            f.write("moved away by an operator")
        os.rename(stray, elsewhere / "notes.txt")
        ids = torch.arange(5)
        path = await asyncio.to_thread(
            write_dump, d, "e5", ids, torch.zeros(5, 12), torch.zeros(5, 4), [1, 2, 3]
        )
        await _settle(got, 1, seconds=10.0)
        assert got == [path]
    finally:
        w.stop()
