"""Where the monitor's numbers come from: the daemon's socket, the journal, or an ssh relay.

Discovery (:func:`discover`) turns ``--output``/``--socket`` into one :class:`Target` per
shard. For each target the socket path is, in order: ``--socket``; the ``socket`` field of
the newest ``run_started`` record in the journal; :func:`eagle3proto.paths.default_socket_path`.

Liveness ("is the daemon up?") is decided without disturbing it:

* a socket that answers hello means up;
* otherwise the shard lock (:func:`eagle3proto.paths.lock_path`, an ``flock`` the daemon
  holds for its whole life) is looked up in ``/proc/locks``: up only when its holder is the
  daemon the journal's last ``run_started`` names (its pid *and* start time, on this boot:
  :mod:`eagle3proto.locks`); a lock held by anything else is down, and the holder is named.
  Where ``/proc/locks`` cannot be read the lock is tested with a non-blocking shared
  ``flock`` that is released at once.

Blocking helpers here serve ``--once`` (no asyncio import on that path); the asyncio feeds
that keep the TUI's rows up to date live in :mod:`eagle3top.feeds`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import os
import socket
import stat
import time
from collections.abc import Callable

import msgspec
from eagle3proto import checkpoint, locks, paths, reducer, wire
from eagle3proto import events as ev
from eagle3proto.codec import HEADER_SIZE, scan
from eagle3proto.journalread import Follower, Replay, list_segments, replay

from .model import Row

#: Default ssh command for remote hosts; ``EAGLE3_TOP_SSH`` overrides it (tests use a local
#: stand-in). The remote command is passed as one shell string, as ssh does.
DEFAULT_SSH = "ssh -T -o BatchMode=yes -o ConnectTimeout=10"
#: The program run on the remote host; ``EAGLE3_TOP_REMOTE`` overrides it.
DEFAULT_REMOTE = "eagle3-top"


class SourceInfo(msgspec.Struct, tag="source", tag_field="kind", kw_only=True):
    """Sent by the ``--stream`` relay before the snapshot: what it is relaying."""

    mode: str = "socket"  # socket | journal
    alive: bool | None = None  # the daemon, as the relay sees it on its host
    detail: str = ""


_enc = msgspec.msgpack.Encoder()
_source_dec = msgspec.msgpack.Decoder(SourceInfo)


def decode(payload: bytes) -> object:
    """Decode one relay/socket payload: wire messages, events, or :class:`SourceInfo`."""
    msg = wire.decode_payload(payload)
    if isinstance(msg, ev.Unknown) and msg.kind == "source":
        return _source_dec.decode(payload)
    return msg


class Target(msgspec.Struct, frozen=True):
    """One local shard to watch."""

    label: str
    output: str = ""
    shard: paths.Shard | None = None
    socket: str = ""  # explicit --socket
    jdir: str = ""
    lock: str = ""

    def socket_candidates(self) -> list[str]:
        if self.socket:
            return [self.socket]
        out: list[str] = []
        if self.jdir:
            s = newest_socket(self.jdir)
            if s:
                out.append(s)
        if self.output and self.shard is not None:
            d = paths.default_socket_path(self.output, self.shard)
            if d not in out:
                out.append(d)
            # Last: a daemon that is starting (its event socket not up yet) answers here.
            out.append(paths.start_beacon_name(self.output, self.shard))
        return out


def is_beacon(path: str) -> bool:
    """Whether a socket candidate is a starting daemon's beacon (an abstract name)."""
    return path.startswith("\0")


def runtime_sockets(env: dict[str, str] | None = None) -> list[str]:
    """Daemon sockets in the standard runtime places: ``/run/eagle3d/[JOB/]`` (systemd's
    RuntimeDirectory) and ``$XDG_RUNTIME_DIR/eagle3d/`` (a user's run)."""
    env = dict(os.environ) if env is None else env
    roots = ["/run/eagle3d"]
    if env.get("XDG_RUNTIME_DIR"):
        roots.append(os.path.join(env["XDG_RUNTIME_DIR"], "eagle3d"))
    found: list[str] = []
    for root in roots:
        for pattern in ("*.sock", "*/*.sock"):
            found.extend(sorted(glob.glob(os.path.join(root, pattern))))
    return [p for p in found if _is_socket(p)]


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def discover(output: str | None, sock: str | None) -> list[Target]:
    """The shards to watch for ``--output``/``--socket``; with neither, the journal in the
    current directory, else every daemon socket in the standard runtime places."""
    if not output and not sock and os.path.isdir(paths.state_dir(".")):
        output = "."
    if not output and not sock:
        return [
            Target(label=os.path.basename(p).removesuffix(".sock"), socket=p)
            for p in runtime_sockets()
        ]
    if not output:
        return [Target(label=os.path.basename(sock or "") or "socket", socket=sock or "")]
    output = os.path.abspath(output)
    found = paths.shard_dirs(output)
    if not found:  # no journal yet: the shards whose daemon is starting, else shard 0 of 1
        shards = paths.starting_shards(output) or [paths.Shard(0, 1)]
        found = [(shard, paths.journal_dir(output, shard)) for shard in shards]
    return [
        Target(
            label=shard.name,
            output=output,
            shard=shard,
            socket=sock if (sock and len(found) == 1) else "",
            jdir=jdir,
            lock=paths.lock_path(output, shard),
        )
        for shard, jdir in found
    ]


def newest_socket(jdir: str, probe_bytes: int = 1 << 16) -> str:
    """The ``socket`` of the newest ``run_started`` (read from the newest segments' heads).

    Every daemon start opens a new segment and journals ``run_started`` near its start, so
    only the first frames of each segment, newest first, need reading.
    """
    for seg in reversed(list_segments(jdir)):
        try:
            with open(seg, "rb") as f:
                head = f.read(HEADER_SIZE + probe_bytes)
        except OSError:
            continue
        for p in scan(head, HEADER_SIZE).payloads:
            try:
                e = ev.decode(p)
            except msgspec.DecodeError:
                break
            if isinstance(e, ev.RunStarted):
                return e.socket
    return ""


def lock_held(path: str, proc_locks: str = locks.PROC_LOCKS) -> bool:
    """Whether some process holds an ``flock`` on ``path`` (the daemon's shard lock)."""
    held = locks.holders(path, proc_locks)
    return _flock_probe(path) if held is None else bool(held)


def daemon_alive(path: str, state: reducer.ShardState | None) -> bool:
    """Whether the daemon the journal names holds the shard lock at ``path``: a lock held
    by any other process (a pid reused, another user's program) is not a live daemon."""
    return liveness(path, state)[0]


def liveness(path: str, state: reducer.ShardState | None) -> tuple[bool, str]:
    """:func:`daemon_alive`, and '' unless the shard lock is held by a process that is not
    the journal's daemon; then who holds it, for the monitor to say. One read of
    ``/proc/locks`` answers both."""
    held = locks.holders(path)
    if held is None:  # no /proc/locks: the lock alone, as before
        return (_flock_probe(path) if os.path.exists(path) else False), ""
    if not held:
        return False, ""
    if state is not None and _holds(state, held):
        return True, ""
    who = ", ".join(locks.describe(p) for p in held)
    return False, f"the shard lock {path} is held by {who}, not by this journal's daemon"


def _holds(state: reducer.ShardState, held: list[int]) -> bool:
    """Whether the daemon ``state`` names (its pid, start time and boot) is among ``held``."""
    return state.pid > 0 and any(
        locks.is_process(p, state.pid_start, state.boot_id) for p in held if p == state.pid
    )


def _flock_probe(path: str) -> bool:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases the probe's shared lock at once
    return False


# -- blocking reads for --once ----------------------------------------------------------------


def fetch_socket(path: str, timeout: float = 2.0) -> wire.Snapshot:
    """Ask a daemon for one snapshot (``hello mode=once``). Raises OSError if unreachable."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        s.sendall(wire.encode(wire.Hello(mode="once", client="eagle3-top --once")))
        return _read_snapshot(s.recv, timeout)
    finally:
        s.close()


def _read_snapshot(recv: Callable[[int], bytes], timeout: float) -> wire.Snapshot:
    frames = wire.FrameBuffer()
    deadline = time.monotonic() + timeout
    snap: wire.Snapshot | None = None
    while time.monotonic() < deadline:
        data = recv(1 << 16)
        if not data:
            break
        for p in frames.feed(data):
            m = decode(p)
            if isinstance(m, wire.Snapshot):
                snap = m
            elif isinstance(m, wire.Error):
                raise ConnectionError(f"daemon refused: {m.message}")
            elif isinstance(m, wire.Bye | SourceInfo) and snap is not None:
                return snap
    if snap is None:
        raise ConnectionError("no snapshot from the daemon")
    return snap


def read_journal(jdir: str) -> tuple[reducer.ShardState, Follower]:
    """Fold a shard's journal (read-only): its checkpoint and the records after it, or the
    whole journal when it has none that checks out. The follower continues from its end."""
    state, fol, _ = read_journal_counted(jdir)
    return state, fol


def read_journal_counted(jdir: str) -> tuple[reducer.ShardState, Follower, int]:
    """:func:`read_journal`, and how many records it folded after the checkpoint."""
    ck = checkpoint.load(jdir).checkpoint
    if ck is None:
        state, fol = reducer.new_state(), Follower(jdir)
    else:
        state, fol = ck.state, Follower.after(jdir, ck.position)
    tail = fol.poll()
    reducer.apply_all(state, tail)
    return state, fol, len(tail)


def fold_journal(jdir: str) -> tuple[reducer.ShardState, Replay, str]:
    """A shard's state from its checkpoint and the journal's tail after it (the whole
    journal when the checkpoint is missing or refused), what the replay found, and why a
    checkpoint was refused ('' when none was, or there was none)."""
    loaded = checkpoint.load(jdir)
    ck = loaded.checkpoint
    state = reducer.new_state() if ck is None else ck.state

    def fold(batch: list[ev.AnyEvent]) -> None:
        reducer.apply_all(state, batch)

    rep = replay(jdir, fold, None if ck is None else ck.position)
    return state, rep, "" if ck is not None or loaded.missing else loaded.note


def once_local(t: Target) -> Row:
    """One shard's row for ``--once``: from the socket, else from the journal."""
    row = Row(label=t.label, output=t.output, shard=t.label, host=socket.gethostname())
    errors = []
    for path in t.socket_candidates():
        try:
            snap = fetch_socket(path)
        except (OSError, ConnectionError) as e:
            if is_beacon(path) and isinstance(e, OSError):
                continue  # no daemon is starting: nothing to say about an abstract name
            errors.append(
                f"socket {path}: {e.strerror if isinstance(e, OSError) and e.strerror else e}"
            )
            continue
        row.state, row.start = snap.state, snap.start
        row.source = "beacon" if snap.start is not None else "socket"
        row.alive, row.conn = True, "live"
        row.host = snap.host or row.host
        row.output = snap.output or row.output
        return row
    if t.jdir and list_segments(t.jdir):
        # replay (not Follower): it also reports a torn tail in the newest segment, which
        # matters when the daemon is gone.
        state, rep, refused = fold_journal(t.jdir)
        if refused:
            row.notes.append(refused)
        row.state = state
        row.source, row.conn = "journal", "journal"
        row.alive, foreign = liveness(t.lock, state) if t.lock else (None, "")
        if foreign:
            row.notes.append(foreign)
        for p in rep.problems:
            if p.reason == "torn" and row.alive:
                continue  # a live writer's last frame may simply be half written
            row.notes.append(f"journal: {p.describe()}")
        return row
    row.error = "; ".join(errors) or "nothing to read"
    if t.jdir:
        # Nothing is written under the output before a start passed its checks: a start
        # stopped or refused before then leaves no journal, and no daemon is starting.
        row.error = f"no journal at {t.jdir}" + (f"; {row.error}" if errors else "")
        row.error += "; not started"
    return row


# -- remote hosts --------------------------------------------------------------------------


def ssh_argv(host: str, remote_args: list[str], env: dict[str, str] | None = None) -> list[str]:
    """``ssh HOST 'eagle3-top --stream ...'`` with the ssh and remote commands configurable."""
    import shlex  # only for remote hosts: ``--once`` on this host never loads it

    env = dict(os.environ) if env is None else env
    ssh = shlex.split(env.get("EAGLE3_TOP_SSH") or DEFAULT_SSH)
    remote = shlex.split(env.get("EAGLE3_TOP_REMOTE") or DEFAULT_REMOTE)
    return [*ssh, host, shlex.join([*remote, "--stream", *remote_args])]


def once_remote(host: str, remote_args: list[str], timeout: float = 20.0) -> Row:
    """One remote shard's row for ``--once``, through the ``--stream`` relay over ssh."""
    import subprocess  # only for remote hosts (see :func:`ssh_argv`)

    row = Row(label=host, host=host, source="ssh")
    hello = wire.encode(wire.Hello(mode="once", client="eagle3-top --once"))
    try:
        proc = subprocess.run(
            ssh_argv(host, remote_args),
            input=hello,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        row.error = f"ssh {host}: {e}"
        return row
    frames = wire.FrameBuffer()
    try:
        msgs = [decode(p) for p in frames.feed(proc.stdout)]
    except wire.ProtocolError as e:
        row.error = f"{host}: bad relay output ({e})"
        return row
    for m in msgs:
        if isinstance(m, SourceInfo):
            row.alive = m.alive
            row.source = f"ssh/{m.mode}"
            if m.detail:
                row.notes.append(m.detail)
        elif isinstance(m, wire.Snapshot):
            row.state, row.start = m.state, m.start
            row.output = m.output
            row.shard = f"shard-{m.shard_index}-of-{m.shard_count}"
            row.label = f"{host} {row.shard}"
    if row.state is None:
        err = proc.stderr.decode(errors="replace").strip().splitlines()
        row.error = f"ssh {host}: exit {proc.returncode}" + (f": {err[-1]}" if err else "")
    else:
        row.conn = "live" if row.alive else "journal"
        if row.alive and row.source == "ssh/socket":
            row.conn = "live"
    return row


def encode_source(info: SourceInfo) -> bytes:
    from eagle3proto.codec import encode_frame

    return encode_frame(_enc.encode(info))


def safe_close(f: object) -> None:
    with contextlib.suppress(Exception):
        f.close()  # type: ignore[attr-defined]


def remote_args(args: argparse.Namespace) -> list[str]:
    """The flags that choose what to watch, for ``eagle3-top --stream`` on a remote host."""
    out: list[str] = []
    if args.output:
        out += ["--output", args.output]
    if args.socket:
        out += ["--socket", args.socket]
    if args.shard:
        out += ["--shard", args.shard]
    return out


def targets(args: argparse.Namespace) -> list[Target]:
    """The shards the command line asks to watch (``--output``, ``--socket``, ``--shard``)."""
    from eagle3proto.paths import Shard

    found = discover(args.output, args.socket)
    if args.shard:
        want = Shard.parse(args.shard)
        found = [t for t in found if t.shard is None or t.shard == want]
    return found
