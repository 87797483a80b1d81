"""The start beacon: what a daemon says to monitors before its event socket is up.

From the daemon's first second until its event socket serves (or its exit), it listens on
a Linux abstract-namespace Unix socket (:func:`eagle3proto.paths.start_beacon_name`): it
writes no file, so a start that is refused or stopped leaves nothing under the output, and
the name goes away with the process. It speaks the event socket's protocol
(:mod:`eagle3proto.wire`): after ``hello`` a ``snapshot`` whose state is ``starting``, its
reason the stage's words and ``start`` the stage's numbers; ``mode == "once"`` then ``bye``,
otherwise a fresh snapshot every :attr:`StartBeacon.every` seconds and ``bye`` when the
beacon closes. Only a peer of the daemon's own user, or root, is answered (``SO_PEERCRED``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Callable

from eagle3proto import locks, wire
from eagle3proto.paths import Shard
from eagle3proto.reducer import ShardState

log = logging.getLogger("eagle3d.serve.beacon")

#: A client message is a hello; anything bigger than this is not one of ours.
MAX_CLIENT_FRAME = 64 << 10


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", raw)
    return int(uid)


def snapshot_state(info: wire.StartInfo) -> ShardState:
    """The state a monitor judges: ``starting``, since the stage began, with its words."""
    reason = f"{info.stage}: {info.detail}" if info.detail else info.stage
    return ShardState(
        state="starting",
        state_reason=reason,
        state_since=info.since,
        session_start_ts=info.since,
        pid=info.pid,
        pid_start=locks.start_time(info.pid),
        boot_id=locks.boot_id(),
    )


class StartBeacon:
    """Serves ``info()`` (the start's stage) on the abstract socket ``name``."""

    def __init__(
        self,
        name: str,
        info: Callable[[], wire.StartInfo],
        *,
        shard: Shard,
        output: str,
        host: str,
        every: float = 1.0,
        hello_timeout: float = 5.0,
    ) -> None:
        self.name = name
        self.info = info
        self.shard = shard
        self.output = output
        self.host = host
        self.every = every
        self.hello_timeout = hello_timeout
        self._server: asyncio.Server | None = None
        self._closed = asyncio.Event()
        self._clients: set[asyncio.Task[None]] = set()

    async def open(self) -> bool:
        """Listen; False (and a log line) when the name is taken: another daemon is
        starting on this shard (its lock refuses this one soon)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.name)
            sock.listen(16)
            sock.setblocking(False)
            self._server = await asyncio.start_unix_server(
                self._handle, sock=sock, limit=MAX_CLIENT_FRAME
            )
        except OSError as e:
            sock.close()
            log.warning("no start beacon (%s): monitors see this start once it is up", e)
            return False
        return True

    async def close(self) -> None:
        """Stop listening; every client gets ``bye`` (its monitor tries the event socket)."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._server is not None:
            self._server.close()
        if self._clients:
            await asyncio.wait(self._clients, timeout=2.0)
        for t in list(self._clients):
            t.cancel()

    def _snapshot(self) -> bytes:
        info = self.info()
        return wire.encode(
            wire.Snapshot(
                shard_index=self.shard.index,
                shard_count=self.shard.count,
                host=self.host,
                output=self.output,
                state=snapshot_state(info),
                start=info,
            )
        )

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._clients.add(task)
        try:
            uid = peer_uid(writer.get_extra_info("socket"))
            if uid not in (0, os.getuid()):
                writer.write(wire.encode(wire.Error(message=f"uid {uid} may not watch")))
                return
            hello = await asyncio.wait_for(_read_hello(reader), self.hello_timeout)
            if hello is None:
                return
            await self._serve(hello, writer)
        except (ConnectionError, TimeoutError, asyncio.CancelledError, OSError):
            pass
        except wire.ProtocolError:  # not one of ours: closed
            pass
        except Exception:  # a bug here must never take the daemon's start down
            log.exception("start beacon client failed")
        finally:
            self._clients.discard(task)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.drain(), 1.0)
            writer.close()

    async def _serve(self, hello: wire.Hello, writer: asyncio.StreamWriter) -> None:
        while True:
            writer.write(self._snapshot())
            if hello.mode == "once":
                writer.write(wire.encode(wire.Bye(reason="once")))
                return
            await asyncio.wait_for(writer.drain(), 10.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closed.wait(), self.every)
            if self._closed.is_set():
                writer.write(wire.encode(wire.Bye(reason="started: the event socket is up")))
                return


async def _read_hello(reader: asyncio.StreamReader) -> wire.Hello | None:
    frames = wire.FrameReader(MAX_CLIENT_FRAME)
    while True:
        data = await reader.read(65536)
        if not data:
            return None
        msgs = frames.feed_messages(data)
        if msgs:
            first = msgs[0]
            return first if isinstance(first, wire.Hello) else None


__all__ = ["StartBeacon", "peer_uid", "snapshot_state"]
