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


async def test_a_file_moved_out_of_the_dump_area_does_not_hold_back_the_next_dump(
    tmp_path,
) -> None:
    # A watcher that paired moves (as watchdog did, holding an IN_MOVED_FROM for half a
    # second at the head of its queue) delayed every dump behind a move out of the area.
    # The watch asks for IN_MOVED_TO only: the move out is never seen.
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


def test_inotify_events_are_parsed_with_their_padded_names() -> None:
    """``struct inotify_event`` records as the kernel packs them: names NUL-padded, an
    event without a name (the watch's own) among them."""
    import struct

    from eagle3d.dumps import watcher

    def record(wd: int, mask: int, name: bytes, pad: int) -> bytes:
        raw = name + b"\0" * pad
        return struct.pack("iIII", wd, mask, 0, len(raw)) + raw

    data = (
        record(1, watcher._IN_MOVED_TO, b"r1.e3dump", 7)
        + record(1, watcher._IN_IGNORED, b"", 0)
        + record(2, watcher._IN_CREATE, "é.e3dump".encode(), 5)
    )
    assert list(watcher.events(data)) == [
        (1, watcher._IN_MOVED_TO, "r1.e3dump"),
        (1, watcher._IN_IGNORED, ""),
        (2, watcher._IN_CREATE, "é.e3dump"),
    ]


def test_an_overflow_reports_what_is_there_and_an_ended_watch_reports_nothing(tmp_path) -> None:
    """Events lost to a full queue (``IN_Q_OVERFLOW``): every dump present is reported.
    Events of a watch that ended (its folder deleted, or replaced at the same path) are
    of another folder: not reported, and the watch counts as ended for :meth:`rearm`."""
    import struct

    from eagle3d.dumps import watcher

    d = tmp_path / "dumps"
    got: list[str] = []
    w = DumpWatcher(str(d), got.append)
    w.start()
    try:
        (d / "a1.e3dump").write_bytes(b"x")
        (d / "notes.txt").write_bytes(b"x")
        got.clear()
        w._handle(struct.pack("iIII", -1, watcher._IN_Q_OVERFLOW, 0, 0))
        assert got == [str(d / "a1.e3dump")]
        got.clear()
        old = w._wd
        name = b"b2.e3dump\0\0\0"
        w._handle(struct.pack("iIII", old + 1, watcher._IN_MOVED_TO, 0, len(name)) + name)
        assert got == []  # not the current watch
        w._handle(struct.pack("iIII", old, watcher._IN_IGNORED, 0, 0))
        assert w.rearm() is True and w._wd != -1
        assert w.rearm() is False
    finally:
        w.stop()
