"""The daemon's event socket: live journal records fanned out to subscribers.

Protocol (:mod:`eagle3proto.wire`, same framing as the journal):

1. the client sends ``hello{since_seq, mode}`` within :attr:`EventServer.hello_timeout`;
2. the server answers ``snapshot{state}`` (the daemon's reducer state, ``state.seq`` says
   what it includes), then every record after ``since_seq`` when ``0 <= since_seq <
   state.seq`` (catch-up, read from the in-memory tail or the journal), otherwise every
   record after ``state.seq``; then live records. Records never repeat and never skip a seq.
   A client folds only records with ``seq > state.seq`` into the snapshot.
3. ``mode == "once"``: the snapshot, then ``bye``.

Every subscriber has a bounded queue that :meth:`EventServer.publish` fills with
``put_nowait`` only, so a slow subscriber can never slow the daemon. When it overflows the
subscriber gets ``resync`` and a fresh snapshot; one that overflows
:attr:`EventServer.max_resyncs` times in a minute, or stops reading for
:attr:`EventServer.write_timeout`, is dropped with ``bye``. Garbage or an oversize length
prefix from a client closes that client only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from eagle3proto import events as ev
from eagle3proto import wire
from eagle3proto.codec import encode_frame
from eagle3proto.journalread import read_frames
from eagle3proto.paths import Shard
from eagle3proto.reducer import ShardState

from eagle3d.serve.sockets import bind_socket

log = logging.getLogger("eagle3d.serve.server")

#: A client message is a hello; anything bigger than this is not one of ours.
MAX_CLIENT_FRAME = 64 << 10


@dataclass(eq=False)
class _Subscriber:
    writer: asyncio.StreamWriter
    queue: asyncio.Queue[tuple[int, _Frame] | None]
    next_seq: int = 0  # the next record seq this subscriber needs
    resync: bool = False
    resyncs: deque[float] = field(default_factory=deque)
    closing: str = ""  # why it is being closed ("" while healthy)
    task: asyncio.Task[None] | None = None
    peer: str = ""


class EventServer:
    """Serves a shard's journal records on a Unix stream socket.

    Args:
        path: socket path (its directory is created, mode 0750).
        journal_dir: the shard's journal directory, read for catch-up older than the tail.
        snapshot: returns the daemon's current reducer state; called on the event loop.
        shard, output, host: copied into every snapshot message.
        queue_size: per-subscriber bound, in records.
        tail_size: records kept in memory for catch-up without reading the journal.
    """

    def __init__(
        self,
        path: str,
        *,
        journal_dir: str,
        snapshot: Callable[[], ShardState],
        shard: Shard,
        output: str,
        host: str,
        queue_size: int = 4096,
        tail_size: int = 8192,
        hello_timeout: float = 5.0,
        write_timeout: float = 10.0,
        max_resyncs: int = 3,
        max_catchup: int = 200_000,
        clock: Callable[[], float] = time.monotonic,
        gid: int = -1,
    ) -> None:
        self.path = path
        self.gid = gid  # --group's gid: the socket belongs to it (-1: none)
        self.journal_dir = journal_dir
        self.snapshot = snapshot
        self.shard = shard
        self.output = output
        self.host = host
        self.queue_size = queue_size
        self.hello_timeout = hello_timeout
        self.write_timeout = write_timeout
        self.max_resyncs = max_resyncs
        self.max_catchup = max_catchup
        self.clock = clock
        self._tail: deque[tuple[int, _Frame]] = deque(maxlen=tail_size)
        self._last_seq = -1  # newest published seq
        self._subs: set[_Subscriber] = set()
        self._server: asyncio.Server | None = None
        self._inode: tuple[int, int] | None = None
        self._closed = False
        self.stats = {"connected": 0, "resyncs": 0, "dropped": 0, "bad_clients": 0}

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind and listen. A stale socket file is replaced; a live one raises SocketInUse."""
        sock = bind_socket(self.path, self.gid)
        st = os.stat(self.path)
        self._inode = (st.st_dev, st.st_ino)
        self._server = await asyncio.start_unix_server(
            self._handle, sock=sock, limit=MAX_CLIENT_FRAME
        )

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    async def close(self, reason: str = "daemon stopping") -> None:
        """Send ``bye`` to every subscriber, close them, stop listening, remove the socket."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        for sub in list(self._subs):
            self._finish(sub, reason, drain=True)
        tasks = [s.task for s in self._subs if s.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        for sub in list(self._subs):
            sub.writer.transport.abort()
        self._unlink_own_socket()

    def _unlink_own_socket(self) -> None:
        # Only remove the path if it is still ours: a successor may have replaced it.
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    # -- publishing (event-loop thread, seq order, never blocks) ----------------------------

    def publish(self, event: ev.Event) -> None:
        """Hand one journal record to every subscriber. Never blocks, never raises."""
        if event.seq <= self._last_seq:
            return  # a duplicate (e.g. published twice during shutdown): ignore
        item = (event.seq, _Frame(event))
        self._last_seq = event.seq
        self._tail.append(item)
        for sub in self._subs:
            if sub.resync or sub.closing:
                continue
            try:
                sub.queue.put_nowait(item)
            except asyncio.QueueFull:
                self._overflow(sub)

    def _overflow(self, sub: _Subscriber) -> None:
        now = self.clock()
        while sub.resyncs and sub.resyncs[0] < now - 60.0:
            sub.resyncs.popleft()
        if len(sub.resyncs) >= self.max_resyncs:
            self.stats["dropped"] += 1
            self._finish(sub, "too slow: dropped after repeated resyncs", drain=False)
            return
        sub.resyncs.append(now)
        self.stats["resyncs"] += 1
        sub.resync = True
        _clear(sub.queue)
        sub.queue.put_nowait(None)  # wake the sender

    def _finish(self, sub: _Subscriber, reason: str, drain: bool) -> None:
        if sub.closing:
            return
        sub.closing = reason
        _clear(sub.queue)
        sub.queue.put_nowait(None)
        if not drain and sub.task is not None:
            sub.task.cancel()

    # -- one client --------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats["connected"] += 1
        sub: _Subscriber | None = None
        try:
            hello = await self._read_hello(reader, writer)
            if hello is None or self._closed:
                return
            sub = _Subscriber(writer, asyncio.Queue(self.queue_size))
            sub.peer = hello.client
            sub.task = asyncio.current_task()
            state = self._send_snapshot(sub)
            if hello.mode == "once":
                writer.write(wire.encode(wire.Bye(reason="once", last_seq=state.seq)))
                await asyncio.wait_for(writer.drain(), self.write_timeout)
                return
            if 0 <= hello.since_seq < state.seq and state.seq - hello.since_seq <= self.max_catchup:
                sub.next_seq = hello.since_seq + 1
            self._subs.add(sub)
            watcher = asyncio.create_task(self._watch_client(reader, sub))
            try:
                await self._send_loop(sub)
            finally:
                watcher.cancel()
        except (ConnectionError, TimeoutError, asyncio.CancelledError, OSError):
            pass
        except Exception:  # a bug here must never take the daemon down
            log.exception("subscriber failed")
        finally:
            if sub is not None:
                self._subs.discard(sub)
            if _closing_badly(sub):
                writer.transport.abort()
            else:
                writer.close()

    async def _read_hello(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> wire.Hello | None:
        frames = wire.FrameReader(MAX_CLIENT_FRAME)
        deadline = self.clock() + self.hello_timeout
        while True:
            left = deadline - self.clock()
            if left <= 0:
                self._reject(writer, "no hello within timeout")
                return None
            try:
                data = await asyncio.wait_for(reader.read(65536), left)
            except TimeoutError:
                self._reject(writer, "no hello within timeout")
                return None
            if not data:
                return None
            try:
                msgs = frames.feed_messages(data)
            except wire.ProtocolError as e:
                self._reject(writer, str(e))
                return None
            if msgs:
                first = msgs[0]
                if not isinstance(first, wire.Hello):
                    self._reject(writer, "expected hello")
                    return None
                if first.proto != wire.PROTO:
                    self._reject(writer, f"protocol {first.proto} not supported ({wire.PROTO})")
                    return None
                return first

    def _reject(self, writer: asyncio.StreamWriter, message: str) -> None:
        self.stats["bad_clients"] += 1
        with contextlib.suppress(Exception):
            writer.write(wire.encode(wire.Error(message=message)))

    def _send_snapshot(self, sub: _Subscriber) -> ShardState:
        state = self.snapshot()
        msg = wire.Snapshot(
            shard_index=self.shard.index,
            shard_count=self.shard.count,
            host=self.host,
            output=self.output,
            state=state,
        )
        try:
            frame = wire.encode(msg)
        except ValueError:
            # Over the frame limit (e.g. millions of failed samples listed by index): send
            # the counters without the per-sample maps rather than no snapshot at all.
            msg.state = msgspec.structs.replace(state, failed_idx={}, stage={}, history=[])
            frame = wire.encode(msg)
        sub.writer.write(frame)
        sub.next_seq = state.seq + 1
        return state

    async def _watch_client(self, reader: asyncio.StreamReader, sub: _Subscriber) -> None:
        """Read what the client sends after hello: EOF or garbage ends the subscription."""
        frames = wire.FrameReader(MAX_CLIENT_FRAME)
        reason = "client closed"
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                frames.feed(data)  # anything valid after hello is ignored
        except wire.ProtocolError as e:
            self.stats["bad_clients"] += 1
            reason = f"protocol error: {e}"
        except (ConnectionError, OSError):
            pass
        self._finish(sub, reason, drain=False)

    async def _send_loop(self, sub: _Subscriber) -> None:
        writer = sub.writer
        await self._fill(sub, self._last_seq)
        await asyncio.wait_for(writer.drain(), self.write_timeout)
        while True:
            item = await sub.queue.get()
            if writer.transport.is_closing():
                return  # the peer is gone; writing on would only make asyncio log about it
            if sub.closing:
                if sub.closing != "client closed":
                    bye = wire.Bye(reason=sub.closing, last_seq=sub.next_seq - 1)
                    writer.write(wire.encode(bye))
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(writer.drain(), 1.0)
                return
            if sub.resync:
                sub.resync = False
                writer.write(wire.encode(wire.Resync(reason="subscriber fell behind")))
                self._send_snapshot(sub)
                await self._fill(sub, self._last_seq)
                await asyncio.wait_for(writer.drain(), self.write_timeout)
                continue
            batch = [item] if item is not None else []
            while len(batch) < 512:
                try:
                    nxt = sub.queue.get_nowait()
                except asyncio.QueueEmpty:
                    break
                if nxt is None:
                    sub.queue.put_nowait(None)  # handle the control marker next round
                    break
                batch.append(nxt)
            for seq, frame in batch:
                if seq < sub.next_seq:
                    continue
                if seq > sub.next_seq:
                    await self._fill(sub, seq - 1)
                writer.write(frame.data)
                sub.next_seq = seq + 1
            await asyncio.wait_for(writer.drain(), self.write_timeout)
            await asyncio.sleep(0)  # drain() may not yield (cpython gh-75279)

    async def _fill(self, sub: _Subscriber, upto: int) -> None:
        """Send records ``sub.next_seq .. upto`` from the tail, or the journal before it."""
        if upto < sub.next_seq:
            return
        tail_first = self._tail[0][0] if self._tail else self._last_seq + 1
        if sub.next_seq < tail_first:
            frames = await asyncio.to_thread(
                read_frames, self.journal_dir, sub.next_seq, min(upto, tail_first - 1)
            )
            for seq, raw in frames:
                if seq == sub.next_seq:
                    sub.writer.write(raw)
                    sub.next_seq = seq + 1
            if sub.next_seq < tail_first:
                # The journal does not have them (yet): the snapshot covers state; skip ahead.
                sub.next_seq = tail_first
        for seq, frame in list(self._tail):
            if seq > upto:
                break
            if seq == sub.next_seq:
                sub.writer.write(frame.data)
                sub.next_seq = seq + 1


class _Frame:
    """A journal record's frame on the wire, encoded when a subscriber first needs it (most
    records reach none: the daemon publishes every record it journals)."""

    __slots__ = ("_data", "event")

    def __init__(self, event: ev.Event) -> None:
        self.event = event
        self._data: bytes | None = None

    @property
    def data(self) -> bytes:
        if self._data is None:
            self._data = encode_frame(ev.encode(self.event))
        return self._data


def _closing_badly(sub: _Subscriber | None) -> bool:
    return sub is not None and ("dropped" in sub.closing or "protocol" in sub.closing)


def _clear(q: asyncio.Queue[tuple[int, _Frame] | None]) -> None:
    while True:
        try:
            q.get_nowait()
        except asyncio.QueueEmpty:
            return
