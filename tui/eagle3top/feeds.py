"""Asyncio feeds that keep each :class:`~eagle3top.model.Row` up to date for the TUI.

* :class:`LocalFeed` - the daemon's socket; while it is unreachable, the journal followed
  live, with the socket retried on a capped back-off.
* :class:`StreamFeed` - a remote host through ``ssh HOST eagle3-top --stream``, restarted
  on a capped back-off when it ends.
* :class:`ShardWatch` - the shards of an output that start after the monitor did.

Both speak the same protocol through :meth:`Feed._session`. Time for display comes from the
injected wall clock; back-off sleeps use the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable

import msgspec
from eagle3proto import events as ev
from eagle3proto import reducer, wire
from eagle3proto.journalread import Follower, list_segments

from .model import Row
from .sources import SourceInfo, Target, daemon_alive, decode, is_beacon, read_journal_counted

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 15.0)
#: How often a journal is re-read while its daemon is known to be down (nothing appends to
#: it then; a daemon that starts again takes the lock and is then followed every interval).
QUIET_POLL_S = 5.0


def backoff(attempts: int, delays: tuple[float, ...] = BACKOFF_S) -> float:
    """Delay before reconnect attempt number ``attempts`` (1-based), capped."""
    return delays[min(max(attempts, 1), len(delays)) - 1]


class Feed:
    """Base: one row, a wall clock, and a way to cut a back-off short (``r``)."""

    def __init__(self, row: Row, clock: Callable[[], float], alias: str = "") -> None:
        self.row = row
        self.clock = clock
        self.alias = alias  # a remote host as the user named it: prefixes the row label
        self.delays = BACKOFF_S
        self.coalesce_s = 0.2
        self._kick = asyncio.Event()
        self.records = 0  # records folded, for benchmarks
        #: Called (no arguments) after new records were folded into the row.
        self.on_change: Callable[[], None] | None = None

    def _changed(self, n: int) -> None:
        self.records += n
        if n and self.on_change is not None:
            self.on_change()

    def reconnect(self) -> None:
        self._kick.set()

    def _live(self) -> None:
        """A snapshot arrived: the source is live, whatever stood in for it is stale."""

    async def _sleep(self, delay: float) -> bool:
        """Sleep ``delay`` or until :meth:`reconnect`; True if woken by it."""
        self._kick.clear()
        try:
            await asyncio.wait_for(self._kick.wait(), delay)
        except TimeoutError:
            return False
        return True

    async def run(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    async def _session(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter | None,
        transport: asyncio.ReadTransport | None = None,
    ) -> bool:
        """Speak the protocol until the peer goes away. True if a snapshot arrived.

        Long: the protocol's exchange in the order it happens (hello, snapshot, the stream,
        the end), one state machine best read top to bottom."""
        row = self.row
        frames = wire.FrameBuffer()
        got_snapshot = False
        try:
            while True:
                data = await reader.read(1 << 18)
                if not data:
                    row.error = row.error or "connection closed"
                    return got_snapshot
                payloads = frames.feed(data)
                if not payloads:
                    continue
                row.last_msg = self.clock()
                try:
                    msgs: list[object] = list(ev.decode_many(payloads))  # the common case
                except msgspec.MsgspecError:
                    msgs = [decode(p) for p in payloads]
                for i, m in enumerate(msgs):
                    if isinstance(m, ev.Unknown):  # control messages are not events
                        msgs[i] = decode(payloads[i])
                folded = 0
                for m in msgs:
                    if isinstance(m, ev.Event | ev.Unknown):
                        s = row.state
                        if s is None or m.seq <= s.seq:
                            continue
                        reducer.apply(s, m)
                        folded += 1
                    elif isinstance(m, wire.Snapshot):
                        got_snapshot = True
                        self._live()
                        folded += 1
                        row.state, row.start = m.state, m.start
                        row.host = m.host or row.host
                        row.output = m.output or row.output
                        row.shard = f"shard-{m.shard_index}-of-{m.shard_count}"
                        if self.alias:
                            row.label = f"{self.alias} {row.shard}"
                        row.error = ""
                        row.attempts = 0
                        row.retry_at = None
                        if row.source in ("", "socket", "journal", "beacon"):
                            row.source = "socket" if m.start is None else "beacon"
                            row.conn, row.alive = "live", True
                    elif isinstance(m, SourceInfo):
                        row.source = f"ssh/{m.mode}"
                        row.alive = m.alive
                        row.conn = "live" if m.mode == "socket" else "journal"
                    elif isinstance(m, wire.Bye):
                        row.error = f"daemon said bye: {m.reason}"
                        return got_snapshot
                    elif isinstance(m, wire.Error):
                        row.error = f"refused: {m.message}"
                        return got_snapshot
                self._changed(folded)
                if got_snapshot:
                    # Coalesce: at 1,000 records/s a wake-up per record costs more than
                    # everything else. What came is folded and shown; now pause the transport
                    # so the kernel buffers meanwhile, and the next read takes it all.
                    if transport is not None:
                        transport.pause_reading()
                    await asyncio.sleep(self.coalesce_s)
                    if transport is not None and not transport.is_closing():
                        transport.resume_reading()
        except wire.ProtocolError as e:
            row.error = f"protocol error: {e}"
            return got_snapshot
        except (ConnectionError, OSError) as e:
            row.error = str(e)
            return got_snapshot
        finally:
            if writer is not None:
                writer.close()


class LocalFeed(Feed):
    """Socket first; the journal while the socket is unreachable."""

    def __init__(self, target: Target, clock: Callable[[], float], interval: float = 1.0) -> None:
        super().__init__(Row(label=target.label, output=target.output, shard=target.label), clock)
        self.target = target
        self.interval = interval
        #: the journal's fold while the socket is unreachable, and where it has read to;
        #: dropped when the socket is back (:meth:`_live`)
        self._jstate: reducer.ShardState | None = None
        self._follower: Follower | None = None
        self.largest_read = 0  # the most records one journal read folded (tests, benchmarks)

    def _live(self) -> None:
        # Kept, the follower's next read after this session would take every record the
        # session wrote at once (a long session's worth of decoded events: memory the
        # process keeps). Dropped, the next fall-back reads the newest checkpoint and its
        # tail, bounded by the checkpoint's interval, however long the session ran.
        self._jstate = self._follower = None

    async def run(self) -> None:
        row = self.row
        while True:
            row.conn = "connecting" if row.state is None else row.conn
            if await self._try_socket():
                continue  # it was up: try again at once (a restart is quick)
            row.attempts += 1
            delay = backoff(row.attempts, self.delays)
            row.retry_at = self.clock() + delay
            await self._follow_journal(delay)

    async def _try_socket(self) -> bool:
        errors = []
        for path in self.target.socket_candidates():
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), 2.0)
            except (OSError, TimeoutError) as e:
                if is_beacon(path):
                    continue  # no daemon is starting
                errors.append(f"socket {path}: {getattr(e, 'strerror', None) or e}")
                continue
            writer.write(wire.encode(wire.Hello(client="eagle3-top")))
            self.row.source = "socket"
            got = await self._session(reader, writer, writer.transport)  # type: ignore[arg-type]
            if self.row.source in ("socket", "beacon"):
                self.row.conn = "disconnected"
            return got
        # Said only once no candidate answered: a starting daemon's beacon, tried after the
        # event socket, must not be shown as "no socket" while it is being reached.
        if errors:
            self.row.error = "; ".join(errors)
        return False

    async def _follow_journal(self, seconds: float) -> None:
        row, t = self.row, self.target
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while True:
            every = self.interval
            if t.jdir and list_segments(t.jdir):
                if self._follower is None:
                    # The first read folds the whole journal: off the UI thread.
                    self._jstate, self._follower, n = await asyncio.to_thread(
                        read_journal_counted, t.jdir
                    )
                    self.largest_read = max(self.largest_read, n)
                    folded = 1
                else:
                    # Later reads take one interval's appends: inline, no thread hop (each
                    # wake-up of an idle monitor costs more than the read itself).
                    new = self._follower.poll()
                    assert self._jstate is not None
                    reducer.apply_all(self._jstate, new)
                    folded = len(new)
                    self.largest_read = max(self.largest_read, folded)
                row.state, row.start = self._jstate, None
                row.source, row.conn = "journal", "journal"
                row.alive = daemon_alive(t.lock, self._jstate) if t.lock else None
                self._changed(folded)
                if row.alive is False:
                    every = max(every, QUIET_POLL_S)
            else:
                row.conn = "disconnected"
                # The words --once uses for the same situation.
                if t.jdir and not row.error.startswith("no journal"):
                    row.error = f"no journal at {t.jdir}" + (f"; {row.error}" if row.error else "")
                    row.error += "; not started"
            left = end - loop.time()
            if left <= 0 or await self._sleep(min(every, left)):
                return


class StreamFeed(Feed):
    """A remote shard through the ``--stream`` relay run by ssh."""

    def __init__(self, host: str, argv: list[str], clock: Callable[[], float]) -> None:
        super().__init__(Row(label=host, host=host, source="ssh"), clock, alias=host)
        self.argv = argv

    async def run(self) -> None:
        row = self.row
        while True:
            got = False
            try:
                proc = await asyncio.create_subprocess_exec(
                    *self.argv,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    start_new_session=True,
                )
            except OSError as e:
                row.error = f"cannot run ssh: {e}"
            else:
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(wire.encode(wire.Hello(client="eagle3-top")))
                pipe = proc._transport.get_pipe_transport(1)  # type: ignore[attr-defined]
                try:
                    got = await self._session(proc.stdout, None, pipe)
                finally:
                    # ssh and whatever it started locally: the whole process group goes.
                    proc.stdin.close()
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                        with contextlib.suppress(BaseException):
                            await asyncio.wait_for(asyncio.shield(proc.wait()), 2.0)
                        # Close the transport now, on a live loop, not in a late __del__.
                        proc._transport.close()  # type: ignore[attr-defined]
                err = b""
                with contextlib.suppress(Exception):
                    assert proc.stderr is not None
                    err = await asyncio.wait_for(proc.stderr.read(), 1.0)
                await proc.wait()
                lines = err.decode(errors="replace").strip().splitlines()
                if lines and not got:
                    row.error = f"ssh: {lines[-1]}"
            if got:
                row.attempts = 0
            row.attempts += 1
            row.conn = "disconnected"
            delay = backoff(row.attempts, self.delays)
            row.retry_at = self.clock() + delay
            await self._sleep(delay)


class ShardWatch:
    """New shards of an output, as their journal folders appear (a Slurm array's tasks start
    at different times): one listing of ``OUTPUT/.eagle3d/journal/`` per :meth:`poll`.

    ``make`` builds the feed of a new target; a placeholder target whose journal folder
    does not exist (what discovery gives for an output with no journal yet) is replaced by
    the real shards once they appear.
    """

    def __init__(
        self,
        output: str,
        make: Callable[[Target], Feed],
        known: list[Target],
        keep: Callable[[Target], bool] = lambda t: True,
    ) -> None:
        self.output = output
        self.make = make
        self.keep = keep
        self._known = {t.jdir for t in known if t.jdir}

    def poll(self, feeds: list[Feed]) -> tuple[list[Feed], list[Feed]]:
        """(feeds to add, placeholder feeds to drop) for the journal folders now present."""
        from .sources import discover

        found = [t for t in discover(self.output, None) if os.path.isdir(t.jdir) and self.keep(t)]
        new = [t for t in found if t.jdir not in self._known]
        if not new:
            return [], []
        self._known.update(t.jdir for t in new)
        drop: list[Feed] = [
            f
            for f in feeds
            if isinstance(f, LocalFeed) and f.row.state is None and not os.path.isdir(f.target.jdir)
        ]
        return [self.make(t) for t in new], drop
