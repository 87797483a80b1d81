"""``eagle3-top --stream``: relay a shard's events as frames on stdout (run over ssh).

Like ``docker system dial-stdio``: the local monitor runs ``ssh HOST eagle3-top --stream``,
writes its ``hello`` on the relay's stdin and reads the protocol of :mod:`eagle3proto.wire`
from its stdout, preceded by one :class:`~eagle3top.sources.SourceInfo`.

* With a live socket the relay is a byte pipe between stdio and the daemon.
* Otherwise it serves the journal: a snapshot folded from it, then new records as they are
  appended, and a fresh ``source`` message whenever the daemon's liveness changes. When the
  socket comes back it exits, so the client reconnects to the live daemon.

Exits 0 when either side closes, 3 when there is neither socket nor journal.
"""

from __future__ import annotations

import os
import selectors
import socket
import time

import msgspec
from eagle3proto import reducer, wire
from eagle3proto.codec import encode_frame
from eagle3proto.journalread import list_segments

from .sources import SourceInfo, Target, daemon_alive, encode_source, read_journal


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_hello(fd: int, timeout: float) -> wire.Hello | None:
    frames = wire.FrameReader(64 << 10)
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    try:
        while (left := deadline - time.monotonic()) > 0:
            if not sel.select(left):
                continue
            data = os.read(fd, 65536)
            if not data:
                return None
            for m in frames.feed_messages(data):
                if isinstance(m, wire.Hello):
                    return m
        return None
    finally:
        sel.close()


def _connect(target: Target) -> socket.socket | None:
    for path in target.socket_candidates():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
        except OSError:
            s.close()
            continue
        return s
    return None


def run(target: Target, *, stdin: int = 0, stdout: int = 1, interval: float = 0.5) -> int:
    """Serve one client on stdin/stdout until either side goes away."""
    hello = _read_hello(stdin, 30.0)
    if hello is None:
        return 2
    sock = _connect(target)
    if sock is not None:
        _write_all(stdout, encode_source(SourceInfo(mode="socket", alive=True)))
        sock.sendall(wire.encode(hello))
        return _pipe(sock, stdin, stdout)
    return _serve_journal(target, hello, stdin, stdout, interval)


def _pipe(sock: socket.socket, stdin: int, stdout: int) -> int:
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, "sock")
    sel.register(stdin, selectors.EVENT_READ, "stdin")
    try:
        while True:
            for key, _ in sel.select():
                if key.data == "sock":
                    data = sock.recv(1 << 16)
                    if not data:
                        return 0
                    _write_all(stdout, data)
                else:
                    data = os.read(stdin, 1 << 16)
                    if not data:
                        # Half-close like dial-stdio: the daemon still answers what it was
                        # asked (a once-hello), then closes, which ends the relay.
                        sel.unregister(stdin)
                        sock.shutdown(socket.SHUT_WR)
                        continue
                    sock.sendall(data)
    except (BrokenPipeError, ConnectionError):
        return 0
    finally:
        sel.close()
        sock.close()


def _serve_journal(
    target: Target, hello: wire.Hello, stdin: int, stdout: int, interval: float
) -> int:
    if not target.jdir or not list_segments(target.jdir):
        msg = f"no socket and no journal for {target.output or target.socket}"
        _write_all(stdout, wire.encode(wire.Error(message=msg)))
        return 3
    state, fol = read_journal(target.jdir)
    alive = daemon_alive(target.lock, state) if target.lock else None
    detail = "daemon running, socket unreachable" if alive else "daemon not running"
    shard = target.shard
    snap = wire.Snapshot(
        shard_index=shard.index if shard else 0,
        shard_count=shard.count if shard else 1,
        host=socket.gethostname(),
        output=target.output,
        state=state,
    )
    try:
        _write_all(stdout, encode_source(SourceInfo(mode="journal", alive=alive, detail=detail)))
        _write_all(stdout, wire.encode(snap))
        if hello.mode == "once":
            _write_all(stdout, wire.encode(wire.Bye(reason="once", last_seq=state.seq)))
            return 0
        sel = selectors.DefaultSelector()
        sel.register(stdin, selectors.EVENT_READ)
        next_probe = time.monotonic() + 2.0
        while True:
            if sel.select(interval) and not os.read(stdin, 65536):
                return 0  # the client went away
            # Unknown kinds are forwarded too: the seq chain must stay unbroken.
            new = fol.poll()
            reducer.apply_all(state, new)  # a new session's daemon is recognised too
            out = [encode_frame(msgspec.msgpack.encode(e)) for e in new]
            if out:
                _write_all(stdout, b"".join(out))
            now = time.monotonic()
            if now >= next_probe:
                next_probe = now + 2.0
                now_alive = daemon_alive(target.lock, state) if target.lock else None
                if now_alive != alive:
                    alive = now_alive
                    info = SourceInfo(mode="journal", alive=alive, detail="liveness changed")
                    _write_all(stdout, encode_source(info))
                probe = _connect(target)
                if probe is not None:
                    probe.close()
                    bye = wire.Bye(reason="daemon socket is back", last_seq=fol.next_seq - 1)
                    _write_all(stdout, wire.encode(bye))
                    return 0
    except BrokenPipeError:
        return 0
