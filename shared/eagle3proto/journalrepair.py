"""Recovering a shard's journal before a writer opens it: what follows the last good record
is kept aside (``*.broken-OFFSET``, ``*.broken``), then cut off."""

from __future__ import annotations

import os

from .fileops import OsFileOps
from .journalread import Problem, Replay, list_segments


def repair(directory: str, rep: Replay, fs: OsFileOps) -> list[Problem]:
    """Set aside everything after the last good record of ``rep``, then cut it off; the
    repairs made, for ``recovered`` records."""
    repairs: list[Problem] = []
    if not rep.problems:
        return repairs
    cut_from: str | None = None
    for p in rep.problems:
        if p.dropped_bytes == 0 and p.reason != "bad_header":
            continue
        kept = _keep_aside(p.segment, p.offset)
        fs.truncate_path(p.segment, p.offset) if p.offset else None
        if p.offset == 0 or p.reason == "bad_header":
            os.replace(p.segment, p.segment + ".broken")
        repairs.append(Problem(p.segment, p.offset, p.reason, kept, p.dropped_bytes, p.fatal))
        if p.fatal:
            cut_from = p.segment
    if cut_from is not None:
        later = [s for s in list_segments(directory) if s > cut_from]
        for s in later:
            os.replace(s, s + ".broken")
            size = os.path.getsize(s + ".broken")
            repairs.append(Problem(s, 0, "after_corruption", s + ".broken", size, True))
    fs.fsync_dir(directory)
    return repairs


def _keep_aside(path: str, offset: int) -> str:
    kept = f"{path}.broken-{offset}"
    with open(path, "rb") as src, open(kept, "wb") as dst:
        src.seek(offset)
        dst.write(src.read())
        dst.flush()
        os.fsync(dst.fileno())
    return kept
