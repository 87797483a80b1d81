"""The event socket's file: bound with mode 0660 under a temporary name and renamed into
place, replacing only a dead daemon's socket."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat

from eagle3proto.paths import MAX_SOCKET_PATH


class SocketInUse(RuntimeError):
    """A live daemon already serves this socket path."""


def bind_socket(path: str, gid: int = -1) -> socket.socket:
    """Bind a listening socket at ``path`` with mode 0660, replacing only a stale file; with
    ``gid`` (``--group``) the socket, and its folder when made here, belong to that group.

    The socket is bound under a temporary name, chmod'ed, then renamed over ``path``, so it
    is never reachable with a wider mode and no process-wide umask change is needed.
    """
    parent = os.path.dirname(path) or "."
    made = not os.path.isdir(parent)
    os.makedirs(parent, mode=0o750, exist_ok=True)
    if made and gid >= 0:
        os.chown(parent, -1, gid)
    _check_stale(path)
    # A short temporary name: sun_path holds 107 bytes, and the final path may be close.
    tmp = os.path.join(parent, f".e3d-{os.getpid()}.tmp")
    if len(os.fsencode(tmp)) > MAX_SOCKET_PATH:
        tmp = path  # no room for a rename: bind in place (chmod follows at once)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(tmp)
        os.chmod(tmp, 0o660)
        if gid >= 0:
            os.chown(tmp, -1, gid)
        sock.listen(128)
        sock.setblocking(False)
        if tmp != path:
            _check_stale(path)
            os.replace(tmp, path)
    except BaseException:
        sock.close()
        if tmp != path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise
    return sock


def _check_stale(path: str) -> None:
    """Remove a dead daemon's socket file; raise SocketInUse if something answers on it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketInUse(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        raise SocketInUse(f"cannot tell whether {path} is live: {e}") from e
    finally:
        probe.close()
    raise SocketInUse(f"a live daemon is serving {path}")
