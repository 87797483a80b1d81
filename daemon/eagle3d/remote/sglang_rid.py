"""The tie between a dump and the daemon's request, and the hook's failure markers. Used on both
sides: by the capture hook inside SGLang's processes and by the daemon's SGLang client, so
nothing here imports torch, sglang or the daemon.

The producer sends SGLang ``rid = "e3d.<send>.<T>.<digest>.<rid>"`` (:func:`sglang_rid`), with
``T`` the number of ids and ``digest`` a BLAKE2b-64 of the ids as little-endian int64. The hook
only dumps requests with such a rid (warm-up and health-check requests are ignored), names the
dump after the daemon's ``rid``, knows from ``T`` when a chunked prefill is complete, and
refuses to write a dump whose ids do not hash to ``digest``.
"""

from __future__ import annotations

import array
import errno
import hashlib
import re
import sys
from dataclasses import dataclass

#: The ``--forward-hooks`` factory of the capture hook, as SGLang imports it.
FACTORY = "eagle3d.remote.sglang_hook:make_hook"
#: The factory named by launch lines written before the hook moved; the compatibility module
#: :mod:`eagle3d.remote.sglang_hook` still serves it, and the client accepts either.
LEGACY_FACTORY = "eagle3d.sglang_hook:make_hook"
FACTORIES = (FACTORY, LEGACY_FACTORY)
RID_PREFIX = "e3d"
_SAFE_RID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,199}$")


def ids_digest(ids: list[int]) -> str:
    """BLAKE2b-64 (hex) of the ids as little-endian int64."""
    a = array.array("q", ids)
    if sys.byteorder != "little":
        a.byteswap()
    return hashlib.blake2b(a.tobytes(), digest_size=8).hexdigest()


def sglang_rid(rid: str, ids: list[int], send: int = 1) -> str:
    """The SGLang request id for one send of the daemon request ``rid`` with these ids.

    ``send`` makes repeated sends of one request distinct (SGLang refuses a duplicate rid
    still in flight); the dump is named after ``rid`` whatever ``send`` is.
    """
    if not _SAFE_RID.match(rid):
        raise ValueError(f"request id {rid!r} is not usable as a dump file name")
    return f"{RID_PREFIX}.{send}.{len(ids)}.{ids_digest(ids)}.{rid}"


@dataclass(frozen=True, slots=True)
class Tag:
    """What :func:`parse_sglang_rid` recovers from an SGLang rid."""

    rid: str
    send: int
    length: int
    digest: str


def parse_sglang_rid(srid: object) -> Tag | None:
    """The tag of one of our requests, or None for any other request (warm-up, health, users)."""
    if not isinstance(srid, str) or not srid.startswith(RID_PREFIX + "."):
        return None
    parts = srid.split(".", 4)
    if len(parts) != 5:
        return None
    _, send, length, digest, rid = parts
    if not (send.isdigit() and length.isdigit() and len(digest) == 16 and _SAFE_RID.match(rid)):
        return None
    return Tag(rid, int(send), int(length), digest)


# --------------------------------------------------------------------------------------------
# Failure markers: how the hook tells the client *why* a dump it answered for is missing.
#
# A failed write leaves ``.<rid>.<REASON>.e3fail`` in the dump directory: an empty file (it
# needs an inode, no data block, so it can still be made on a full tmpfs) whose name carries the
# reason, an errno name such as ENOSPC, or LOST for a request whose states never reached the
# writer. The client (``eagle3d.produce.sglang``) turns it into a failure report naming that
# reason and removes it. The watcher ignores hidden names, so it is never taken for a dump.

FAIL_SUFFIX = ".e3fail"
_REASON = re.compile(r"^[A-Z][A-Z0-9_]{0,31}$")


def error_reason(e: BaseException) -> str:
    """ENOSPC, EACCES, ... for an OSError with an errno; the exception's class name otherwise."""
    if isinstance(e, OSError) and e.errno:
        return errno.errorcode.get(e.errno, f"E{e.errno}")
    return "ERROR"


def describe_error(e: BaseException) -> str:
    """``ENOSPC: No space left on device`` (the form the other producers report)."""
    if isinstance(e, OSError) and e.errno:
        return f"{error_reason(e)}: {e.strerror or e}"
    return f"{type(e).__name__}: {e}"


def failure_marker_name(rid: str, reason: str) -> str:
    if not _REASON.match(reason):
        reason = "ERROR"
    return f".{rid}.{reason}{FAIL_SUFFIX}"


def parse_failure_marker(name: str) -> tuple[str, str] | None:
    """(rid, reason) of a failure marker's file name, or None for any other name."""
    if not (name.startswith(".") and name.endswith(FAIL_SUFFIX)):
        return None
    rid, _, reason = name[1 : -len(FAIL_SUFFIX)].rpartition(".")
    if not (_SAFE_RID.match(rid) and _REASON.match(reason)):
        return None
    return rid, reason
