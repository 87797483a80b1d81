"""The SGLang hook's failure markers: an empty file ``<rid>.<REASON>.e3fail`` in the dump area
for a request whose dump could not be written, read and removed by the client that sent it."""

from __future__ import annotations

import contextlib
import errno
import os
import time

from eagle3d.remote.sglang_rid import parse_failure_marker

#: A failure marker nobody read in this long belongs to no live client.
STALE_MARKER_S = 600.0


def take_markers(dump_dir: str, rids: set[str]) -> dict[str, str]:
    """Failure markers the hook left in ``dump_dir`` for these requests (rid -> reason; each
    removed once read; another client's are left alone unless stale)."""
    try:
        names = os.listdir(dump_dir)
    except OSError:
        return {}
    found: dict[str, str] = {}
    for name in names:
        parsed = parse_failure_marker(name)
        if parsed is None:
            continue
        path = os.path.join(dump_dir, name)
        if parsed[0] in rids:
            found[parsed[0]] = parsed[1]
        else:
            try:  # another shard's (read within seconds by its client), or stale
                if time.time() - os.stat(path).st_mtime < STALE_MARKER_S:
                    continue
            except OSError:
                continue
        with contextlib.suppress(OSError):
            os.unlink(path)
    return found


def marker_message(dump_dir: str, reason: str) -> str:
    """What a failure marker's ``reason`` means, in words."""
    if reason == "LOST":
        return "the server's hook lost the request's earlier chunks (see the server log)"
    text = os.strerror(getattr(errno, reason)) if hasattr(errno, reason) else "failed"
    where = dump_area_words(dump_dir)
    return f"the server's hook could not write the dump: {reason}: {text}; {where}"


def dump_area_words(dump_dir: str) -> str:
    """The dump area and its free space, for a message."""
    try:
        st = os.statvfs(dump_dir)
    except OSError as e:
        return f"dump area {dump_dir}: {e.strerror}"
    return f"dump area {dump_dir} has {st.f_bavail * st.f_frsize} bytes free"
