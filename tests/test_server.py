"""The event socket: real journal, real Unix socket, real asyncio clients."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import struct

import pytest
from eagle3d.serve.server import EventServer
from eagle3d.serve.sockets import SocketInUse
from eagle3proto import events as ev
from eagle3proto import reducer, wire
from eagle3proto.journal import JournalWriter
from eagle3proto.journalread import read_frames as read_journal_frames
from eagle3proto.paths import Shard

pytestmark = pytest.mark.timeout(60)


class Daemon:
    """The daemon's side of the contract: journal listener -> state + publish, in order."""

    def __init__(self, tmp: str, **server_kw: object) -> None:
        self.jdir = os.path.join(tmp, "journal")
        self.path = os.path.join(tmp, "run", "e.sock")
        self.state = reducer.new_state()
        self.loop = asyncio.get_running_loop()
        self.writer = JournalWriter(self.jdir, listener=self._listener, background=False)
        self.writer.open(sink=lambda b: reducer.apply_all(self.state, b))
        self.server = EventServer(
            self.path,
            journal_dir=self.jdir,
            snapshot=lambda: self.state,
            shard=Shard(0, 1),
            output=tmp,
            host="testhost",
            **server_kw,  # type: ignore[arg-type]
        )

    def _listener(self, e: ev.Event) -> None:
        # Appends happen on the loop thread in these tests; the daemon uses
        # call_soon_threadsafe, which we mirror so ordering is the same.
        self.loop.call_soon_threadsafe(self._on_event, e)

    def _on_event(self, e: ev.Event) -> None:
        reducer.apply(self.state, e)
        self.server.publish(e)

    async def emit(self, n: int, start_idx: int = 0, pad: int = 0, every: int = 50) -> None:
        for i in range(n):
            self.writer.append(ev.SampleSent(idx=start_idx + i, rid="x" * pad))
            self.writer.flush()
            if i % every == every - 1:
                await asyncio.sleep(0)
        await asyncio.sleep(0)

    async def close(self) -> None:
        await self.server.close()
        self.writer.close()


class Client:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.frames = wire.FrameReader()
        self.msgs: list[object] = []

    @classmethod
    async def connect(cls, path: str, since: int = -1, mode: str = "live") -> Client:
        r, w = await asyncio.open_unix_connection(path)
        w.write(wire.encode(wire.Hello(since_seq=since, mode=mode)))
        await w.drain()
        return cls(r, w)

    async def read_until(self, pred, timeout: float = 10.0) -> list[object]:  # type: ignore[no-untyped-def]
        async def go() -> None:
            while not pred(self.msgs):
                data = await self.reader.read(65536)
                if not data:
                    return
                self.msgs.extend(self.frames.feed_messages(data))

        await asyncio.wait_for(go(), timeout)
        return self.msgs

    def seqs(self) -> list[int]:
        return [m.seq for m in self.msgs if isinstance(m, ev.Event)]

    def close(self) -> None:
        self.writer.close()


def last_seq_is(n: int):  # type: ignore[no-untyped-def]
    """Until the client has everything up to seq ``n`` (in a snapshot or as a record)."""

    def seen(m: object) -> int:
        if isinstance(m, wire.Snapshot):
            return m.state.seq
        return m.seq if isinstance(m, ev.Event) else -1

    return lambda msgs: any(seen(m) >= n for m in msgs)


def record_seq_is(n: int):  # type: ignore[no-untyped-def]
    """Until the client received the record with seq ``n``."""
    return lambda msgs: any(isinstance(m, ev.Event) and m.seq >= n for m in msgs)


async def test_snapshot_then_live_records(tmp_path) -> None:
    d = Daemon(str(tmp_path))
    await d.server.start()
    await d.emit(5)
    c = await Client.connect(d.path)
    await c.read_until(lambda m: len(m) >= 1)
    snap = c.msgs[0]
    assert isinstance(snap, wire.Snapshot)
    assert snap.host == "testhost"
    assert snap.state.seq == d.state.seq == 4
    assert snap.state.in_flight == 5
    await d.emit(3, start_idx=100)
    await c.read_until(record_seq_is(7))
    assert c.seqs() == [5, 6, 7]
    c.close()
    await d.close()


async def test_catch_up_from_seq_uses_tail_then_journal(tmp_path) -> None:
    d = Daemon(str(tmp_path), tail_size=10)
    await d.server.start()
    await d.emit(100)
    c = await Client.connect(d.path, since=20)
    await c.read_until(record_seq_is(99))
    assert isinstance(c.msgs[0], wire.Snapshot)
    assert c.msgs[0].state.seq == 99
    assert c.seqs() == list(range(21, 100))  # 21..89 from the journal, 90..99 from the tail
    await d.emit(2, start_idx=500)
    await c.read_until(record_seq_is(101))
    assert c.seqs()[-2:] == [100, 101]
    c.close()
    await d.close()


async def test_records_nobody_needs_are_never_encoded_and_the_tail_sends_the_journals_frames(
    tmp_path, monkeypatch
) -> None:
    """Publishing costs no encoding until a subscriber needs a record; what the tail then
    sends is byte for byte the journal's frame of it."""
    from eagle3d.serve import server

    encoded: list[bytes] = []
    real = server.encode_frame

    def counted(payload: bytes) -> bytes:
        encoded.append(payload)
        return real(payload)

    monkeypatch.setattr(server, "encode_frame", counted)
    d = Daemon(str(tmp_path), tail_size=10)
    await d.server.start()
    await d.emit(30)
    assert encoded == []  # thirty records published to nobody
    c = await Client.connect(d.path, since=24)
    await c.read_until(record_seq_is(29))
    assert c.seqs() == list(range(25, 30))
    assert len(encoded) == 5  # the five the subscriber needed, from the tail
    journal = dict(read_journal_frames(d.jdir, 25, 29))
    assert [real(p) for p in encoded] == [journal[seq] for seq in range(25, 30)]
    c.close()
    await d.close()


async def test_once_mode_gets_snapshot_and_bye(tmp_path) -> None:
    d = Daemon(str(tmp_path))
    await d.server.start()
    await d.emit(3)
    c = await Client.connect(d.path, mode="once")
    await c.read_until(lambda m: False)  # until EOF
    assert [type(m) for m in c.msgs] == [wire.Snapshot, wire.Bye]
    assert c.msgs[1].last_seq == 2
    await d.close()


async def test_reconnect_from_seq_has_no_gap_and_no_duplicate(tmp_path) -> None:
    d = Daemon(str(tmp_path))
    await d.server.start()
    c = await Client.connect(d.path)
    await d.emit(10)
    await c.read_until(last_seq_is(9))
    c.close()
    await d.emit(10, start_idx=10)  # seq 10..19 while disconnected
    c2 = await Client.connect(d.path, since=9)
    await d.emit(5, start_idx=20)
    await c2.read_until(record_seq_is(24))
    assert c2.seqs() == list(range(10, 25))
    c2.close()
    await d.close()


async def test_slow_consumer_is_resynced_or_dropped_and_others_unaffected(tmp_path) -> None:
    d = Daemon(str(tmp_path), queue_size=64, write_timeout=2.0)
    await d.server.start()
    slow_r, slow_w = await asyncio.open_unix_connection(d.path)
    slow_w.write(wire.encode(wire.Hello()))
    fast = await Client.connect(d.path)
    await fast.read_until(lambda m: len(m) >= 1)
    reader_task = asyncio.create_task(fast.read_until(record_seq_is(2999), timeout=40))
    await d.emit(
        3000, pad=2000, every=1
    )  # ~6 MB: far beyond socket buffers for a client that sleeps
    await reader_task
    assert fast.seqs() == list(range(3000))
    assert d.server.stats["resyncs"] + d.server.stats["dropped"] >= 1
    # The slow client now reads: whatever it got is consistent (snapshot, then contiguous
    # records, and a resync+snapshot wherever it fell behind), or it was told bye.
    slow = Client(slow_r, slow_w)
    closing = asyncio.create_task(d.close())
    await slow.read_until(lambda m: False, timeout=20)
    await closing
    kinds = {type(m) for m in slow.msgs}
    assert wire.Resync in kinds or wire.Bye in kinds or len(slow.msgs) < 3000
    expect = None
    for m in slow.msgs:
        if isinstance(m, wire.Snapshot):
            expect = m.state.seq + 1
        elif isinstance(m, ev.Event):
            assert m.seq == expect
            expect += 1


async def test_garbage_and_huge_length_prefix_close_only_that_client(tmp_path) -> None:
    d = Daemon(str(tmp_path))
    await d.server.start()
    good = await Client.connect(d.path)
    await good.read_until(lambda m: len(m) >= 1)
    for payload in (
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 4,
        struct.pack("<II", 0, 0xFFFFFFF0),  # a 4 GiB frame: refused without waiting for it
        wire.encode(wire.Hello()) + b"\x01" * 64,  # a valid hello, then garbage
    ):
        r, w = await asyncio.open_unix_connection(d.path)
        w.write(payload)
        await w.drain()
        data = await asyncio.wait_for(r.read(), 5.0)  # EOF comes: the server hung up
        assert data is not None
        w.close()
    await d.emit(3)
    await good.read_until(last_seq_is(2))
    assert good.seqs() == [0, 1, 2]
    assert d.server.stats["bad_clients"] >= 3
    assert d.server.subscribers == 1
    await d.close()


async def test_silent_client_is_closed_after_hello_timeout(tmp_path) -> None:
    d = Daemon(str(tmp_path), hello_timeout=0.3)
    await d.server.start()
    r, w = await asyncio.open_unix_connection(d.path)
    data = await asyncio.wait_for(r.read(), 5.0)
    msgs = wire.FrameReader().feed_messages(data)
    assert isinstance(msgs[0], wire.Error) and "hello" in msgs[0].message
    w.close()
    await d.close()


async def test_hundred_clients_come_and_go_while_records_flow(tmp_path) -> None:
    d = Daemon(str(tmp_path))
    await d.server.start()
    steady = await Client.connect(d.path)
    await steady.read_until(lambda m: len(m) >= 1)

    async def visitor(i: int) -> list[int]:
        c = await Client.connect(d.path, since=max(d.state.seq - 5, -1))
        await c.read_until(lambda m: len(m) >= 3, timeout=20)
        c.close()
        snap = c.msgs[0]
        assert isinstance(snap, wire.Snapshot)
        return c.seqs()

    async def emitter() -> None:
        for k in range(20):
            await d.emit(25, start_idx=k * 25)
            await asyncio.sleep(0.01)

    results = await asyncio.gather(emitter(), *(visitor(i) for i in range(100)))
    for seqs in results[1:]:
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else True
    await steady.read_until(last_seq_is(499), timeout=20)
    assert steady.seqs() == list(range(500))
    for _ in range(100):
        if d.server.subscribers == 1:
            break
        await asyncio.sleep(0.02)
    assert d.server.subscribers == 1
    await d.close()


async def test_close_sends_bye_and_removes_socket(tmp_path) -> None:
    d = Daemon(str(tmp_path))
    await d.server.start()
    c = await Client.connect(d.path)
    await c.read_until(lambda m: len(m) >= 1)
    await d.close()
    await c.read_until(lambda m: False)
    assert isinstance(c.msgs[-1], wire.Bye)
    assert c.msgs[-1].reason == "daemon stopping"
    assert not os.path.exists(d.path)


async def test_socket_mode_stale_replaced_live_refused(tmp_path) -> None:
    d = Daemon(str(tmp_path))
    os.makedirs(os.path.dirname(d.path))
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(d.path)  # a dead daemon's socket file: bound, never listening
    stale.close()
    await d.server.start()
    assert stat.S_IMODE(os.stat(d.path).st_mode) == 0o660
    other = EventServer(
        d.path,
        journal_dir=d.jdir,
        snapshot=reducer.new_state,
        shard=Shard(0, 1),
        output=str(tmp_path),
        host="h",
    )
    with pytest.raises(SocketInUse, match="live daemon"):
        await other.start()
    c = await Client.connect(d.path)  # the live one still serves
    await c.read_until(lambda m: len(m) >= 1)
    c.close()
    await d.close()
    with open(os.path.join(tmp_path, "plain"), "w"):
        pass
    plain = EventServer(
        os.path.join(tmp_path, "plain"),
        journal_dir=d.jdir,
        snapshot=reducer.new_state,
        shard=Shard(0, 1),
        output=str(tmp_path),
        host="h",
    )
    with pytest.raises(SocketInUse, match="not a socket"):
        await plain.start()


def test_read_journal_frames_spans_segments(tmp_path) -> None:
    jdir = str(tmp_path / "j")
    w = JournalWriter(jdir, segment_bytes=400, background=False)
    w.open()
    for i in range(50):
        w.append(ev.SampleSent(idx=i))
        w.flush()
    w.close()
    assert len(os.listdir(jdir)) > 3
    got = read_journal_frames(jdir, 7, 41)
    assert [s for s, _ in got] == list(range(7, 42))
    assert all(ev.decode(f[8:]).seq == s for s, f in got)


async def test_snapshot_over_the_frame_limit_drops_per_sample_maps(tmp_path) -> None:
    d = Daemon(str(tmp_path))
    d.state.failed_idx = {i: "ValueError" for i in range(700_000)}  # ~10 MB as msgpack
    d.state.failed = len(d.state.failed_idx)
    await d.server.start()
    c = await Client.connect(d.path, mode="once")
    await c.read_until(lambda m: False)
    snap = c.msgs[0]
    assert isinstance(snap, wire.Snapshot)
    assert snap.state.failed == 700_000 and snap.state.failed_idx == {}
    assert isinstance(c.msgs[1], wire.Bye)
    await d.close()


async def test_catch_up_beyond_the_limit_gets_the_snapshot_only(tmp_path) -> None:
    d = Daemon(str(tmp_path), max_catchup=10)
    await d.server.start()
    await d.emit(100)
    c = await Client.connect(d.path, since=5)  # 94 records behind: more than allowed
    await c.read_until(lambda m: len(m) >= 1)
    await d.emit(2, start_idx=500)
    await c.read_until(record_seq_is(101))
    assert c.msgs[0].state.seq == 99
    assert c.seqs() == [100, 101]
    c.close()
    await d.close()


async def test_socket_path_at_the_sun_path_limit(tmp_path) -> None:
    """A 107-byte path (the most sun_path holds) works; the temporary name must fit too."""
    base = str(tmp_path)
    pad = 107 - len(base) - len("/s.sock") - 1
    assert pad > 2
    deep = os.path.join(base, "d" * pad)
    path = os.path.join(deep, "s.sock")
    assert len(path) == 107
    d = Daemon(str(tmp_path))
    d.server.path = path
    await d.server.start()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    c = await Client.connect(path, mode="once")
    await c.read_until(lambda m: False)
    assert isinstance(c.msgs[0], wire.Snapshot)
    await d.close()
    assert not os.path.exists(path)
