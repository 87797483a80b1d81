"""A journal file layer that can forget everything not yet fsync'ed: power loss, simulated.

:class:`ForgetfulFileOps` is a double for the journal's :class:`eagle3proto.fileops.OsFileOps`
seam. It does the real I/O, and writes one line per durability-relevant step to a log
(``O_APPEND``, so the log survives a SIGKILL of the process that writes it):

* ``sync PATH SIZE`` - an fdatasync (or a synced truncate) made SIZE bytes of PATH durable;
* ``rename SRC DST`` - a rename, durable only once its directory is fsync'ed;
* ``dirsync DIR`` - the directory's entries are durable;
* ``published KIND IDX SEQ`` - the daemon told the world about a record (launcher only).

:func:`power_loss` replays the log and puts the files where a power cut would leave them:
every file cut back to the size its last fdatasync covered (0 if never synced), and renames
whose directory was never fsync'ed undone.

``python tests/powerloss.py LOG -- eagle3d run ARGS...`` runs the real daemon with this layer
under its journal (the kill points of ``EAGLE3D_FAULT`` keep working) and logs each published
``sample_saved`` record, so a test can SIGKILL it, cut the power, and check that everything
the daemon ever acknowledged survived.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

from eagle3proto.fileops import OsFileOps


class ForgetfulFileOps(OsFileOps):
    """Real file operations plus a log of what each fdatasync made durable."""

    def __init__(self, log_path: str) -> None:
        self.log_path = log_path
        self._log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._paths: dict[int, str] = {}

    def note(self, *words: object) -> None:
        os.write(self._log, (" ".join(map(str, words)) + "\n").encode())

    def open_append(self, path: str) -> int:
        fd = super().open_append(path)
        self._paths[fd] = path
        return fd

    def create_exclusive(self, path: str) -> int:
        fd = super().create_exclusive(path)
        self._paths[fd] = path
        self.note("create", path)
        return fd

    def fdatasync(self, fd: int) -> None:
        # Only bytes written before the call are promised durable: measure them first, or a
        # write racing with the sync would be counted as durable when it may not be.
        size = os.fstat(fd).st_size
        super().fdatasync(fd)
        self.note("sync", self._paths[fd], size)

    def close(self, fd: int) -> None:
        self._paths.pop(fd, None)
        super().close(fd)

    def replace(self, src: str, dst: str) -> None:
        super().replace(src, dst)
        self.note("rename", src, dst)

    def fsync_dir(self, path: str) -> None:
        super().fsync_dir(path)
        self.note("dirsync", path)

    def truncate_path(self, path: str, size: int) -> None:
        super().truncate_path(path, size)  # it fsyncs: the cut is durable
        self.note("sync", path, size)


@dataclass
class Loss:
    """What a simulated power cut did."""

    dropped_bytes: dict[str, int] = field(default_factory=dict)
    undone_renames: list[tuple[str, str]] = field(default_factory=list)
    published: list[tuple[str, int, int]] = field(default_factory=list)  # (kind, idx, seq)

    @property
    def total_dropped(self) -> int:
        return sum(self.dropped_bytes.values())


def power_loss(log_path: str) -> Loss:
    """Cut every logged file back to its durable state (see the module docstring)."""
    synced: dict[str, int] = {}
    pending: list[tuple[str, str]] = []
    loss = Loss()
    with open(log_path, encoding="utf-8") as f:
        for line in f:
            words = line.split()
            if not words:
                continue
            op = words[0]
            if op == "create":
                synced[words[1]] = 0
            elif op == "sync":
                synced[words[1]] = int(words[2])
            elif op == "rename":
                src, dst = words[1], words[2]
                synced[dst] = synced.pop(src, 0)
                pending.append((src, dst))
            elif op == "dirsync":
                d = words[1].rstrip("/")
                pending = [(s, t) for s, t in pending if os.path.dirname(t) != d]
            elif op == "published":
                loss.published.append((words[1], int(words[2]), int(words[3])))
    for path, size in synced.items():
        try:
            now = os.path.getsize(path)
        except FileNotFoundError:
            continue
        if now > size:
            os.truncate(path, size)
            loss.dropped_bytes[path] = now - size
    for src, dst in reversed(pending):
        if os.path.exists(dst):
            os.replace(dst, src)
            loss.undone_renames.append((src, dst))
    return loss


def launch(log_path: str, argv: list[str]) -> int:
    """Run ``eagle3d`` in this process with the forgetful layer under the journal."""
    from eagle3d import cli
    from eagle3d.run import daemon, recorder

    notes = ForgetfulFileOps(log_path)  # the same O_APPEND log, for "published" lines
    base: Any = recorder.FaultFileOps

    if issubclass(base, OsFileOps):
        # The kill points subclass OsFileOps: slot the forgetful layer in beneath them.
        class FaultForgetful(base, ForgetfulFileOps):
            def __init__(self) -> None:
                ForgetfulFileOps.__init__(self, log_path)

    else:
        # The kill points delegate to an inner OsFileOps: make that one forgetful.
        class FaultForgetful(base):  # type: ignore[no-redef]
            def __init__(self) -> None:
                self._os = ForgetfulFileOps(log_path)

    recorder.FaultFileOps = FaultForgetful  # type: ignore[misc]
    original = daemon.Daemon._published

    def published(self: daemon.Daemon, e: Any) -> None:
        if getattr(e, "kind", "") in ("sample_saved", "sample_failed"):
            notes.note("published", e.kind, e.idx, e.seq)
        original(self, e)

    daemon.Daemon._published = published  # type: ignore[method-assign]
    return cli.main(argv)


if __name__ == "__main__":
    log, sep, *rest = sys.argv[1:]
    assert sep == "--", "usage: powerloss.py LOG -- eagle3d-args..."
    sys.exit(launch(log, rest))
