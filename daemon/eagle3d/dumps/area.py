"""The dump area's filesystem, as the commit path meets it: tmpfs pages of 4 KiB or 2 MiB.

A commit writes each dump out of the dump area with direct I/O (a v1 dump: reads it back).
On a tmpfs mounted without ``huge=`` (as ``/dev/shm`` usually is) the kernel hands it over
one 4 KiB page at a time: the commit splices the pages into the write (cheaper than mapping
and pinning each one); on one mounted with ``huge=within_size`` (or ``always``) files are
kept in 2 MiB pages, the commit writes from a mapping of them and its threads spend about a
third less CPU (``bench/commit_calls.py --pages``, docs/benchmarks.md). The daemon says so
at start when it could gain from it (docs/operations.md has the mount).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True, slots=True)
class Area:
    """The mount holding a dump area: its mount point, filesystem type and, for a tmpfs,
    its ``huge=`` option ("never" when the mount has none)."""

    mount: str
    fstype: str
    huge: str


def area_of(path: str, mountinfo: str) -> Area | None:
    """The mount that holds ``path`` (absolute, links resolved) according to ``mountinfo``
    (``/proc/self/mountinfo``'s text): the last of the longest mount points that contain
    it (a later mount on the same point hides an earlier one); None when none does."""
    best: Area | None = None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        point = _unescape(fields[4])
        if not _contains(point, path) or (best is not None and len(point) < len(best.mount)):
            continue
        options = dict(o.partition("=")[::2] for o in tail[2].split(","))
        best = Area(point, tail[0], options.get("huge", "never"))
    return best


def read(path: str, mountinfo: str = MOUNTINFO) -> Area | None:
    """:func:`area_of` for ``path`` on this machine; None where mountinfo cannot be read."""
    try:
        with open(mountinfo) as f:
            text = f.read()
    except OSError:
        return None
    return area_of(os.path.realpath(path), text)


def huge_pages(area: Area | None) -> bool:
    """Whether the area is a tmpfs that keeps its files in 2 MiB pages, which a direct
    write pins from a mapping at little cost; elsewhere the commit splices a dump's pages
    (:func:`eagle3d.store.directio.write_spliced`) instead of mapping them one by one."""
    return area is not None and area.fstype == "tmpfs" and area.huge in HUGE


#: tmpfs' ``huge=`` options that keep a file's pages in 2 MiB folios (``advise``: only for
#: mappings that ask, and a dump is written, not mapped, by its producer).
HUGE = ("always", "within_size")


def advice(path: str, area: Area | None) -> str:
    """What to tell the user about the dump area ``path`` on ``area``: '' unless it is a
    tmpfs kept in 4 KiB pages."""
    if area is None or area.fstype != "tmpfs" or huge_pages(area):
        return ""
    return (
        f"dump area {path}: a tmpfs in 4 KiB pages ({area.mount}, huge={area.huge}); on a "
        "tmpfs mounted with huge=within_size the commit threads move each dump with "
        "a third less CPU (docs/operations.md, 'The dump area's pages')"
    )


def _contains(mount: str, path: str) -> bool:
    return path == mount or path.startswith(mount.rstrip("/") + "/")


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in octal (\040, \011, \012, \134).
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field
