"""The output's row folders (``rows_<a>-<b>/``), opened relative to the output's descriptor
and never through a symbolic link, and their identity for the life of a run.

A sample file is written into the descriptor of its row folder (``openat``, ``renameat``),
so a path under the output is never followed through a link eagle3d did not make: a row
folder that is a symbolic link (to anywhere) is refused, not written through. Every folder a
committed file lives in (those of the samples an earlier session saved, and each one this run
opened) is remembered by (device, inode); :meth:`RowDirs.check` says when one was removed,
replaced, or turned into a link under the run, which stops it (exit 4) instead of making the
folder again and calling a job with missing files finished.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading

#: The mode of a row folder eagle3d makes (the owner's; group members may read).
DIR_MODE = 0o750


class RowDirs:
    """Row folders under ``output``; thread-safe (the commit threads share one)."""

    def __init__(self, output: str, dir_mode: int = DIR_MODE) -> None:
        self.output = output
        self.dir_mode = dir_mode
        self._out = os.open(output, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._fds: dict[str, int] = {}
        self._ids: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self.problem = ""  # the first refusal: a row folder that is a link, or not a folder

    def _path(self, name: str) -> str:
        return os.path.join(self.output, name)

    def _lstat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self._out, follow_symlinks=False)

    def adopt(self, names: list[str], committed: set[str]) -> str:
        """At the start: each of ``names`` that exists must be a real folder, and each of
        ``committed`` (folders holding samples the journal says are saved) must exist; they
        are remembered. '' when so, else what is wrong, naming the folder."""
        for name in sorted(set(names) | committed):
            try:
                st = self._lstat(name)
            except FileNotFoundError:
                if name in committed:
                    return (
                        f"the row folder {self._path(name)} holding committed samples is"
                        " missing; run `eagle3d verify --repair` on the output, then this"
                        " command again to redo them"
                    )
                continue
            if not stat.S_ISDIR(st.st_mode):
                return self._refuse(name, st)
            if name in committed:
                with self._lock:
                    self._ids[name] = (st.st_dev, st.st_ino)
        return ""

    def _refuse(self, name: str, st: os.stat_result | None) -> str:
        what = "a symbolic link" if st is not None and stat.S_ISLNK(st.st_mode) else "no folder"
        return (
            f"the row folder {self._path(name)} is {what}: eagle3d writes only into folders"
            " it made (move it away and rerun, or use another --output)"
        )

    def open(self, name: str) -> int:
        """The descriptor of row folder ``name``, made if it never existed. Raises OSError:
        ELOOP/ENOTDIR for a link or a file in its place, ENOENT for a folder that held
        committed files and is gone (never made again)."""
        with self._lock:
            fd = self._fds.get(name, -1)
            if fd >= 0:
                return fd
            if name not in self._ids:
                try:
                    os.mkdir(name, self.dir_mode, dir_fd=self._out)
                    os.fsync(self._out)  # the new folder's entry itself durable
                except FileExistsError:
                    pass
            try:
                fd = os.open(
                    name,
                    os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                    dir_fd=self._out,
                )
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    with contextlib.suppress(OSError):
                        self.problem = self.problem or self._refuse(name, self._lstat(name))
                raise
            st = os.fstat(fd)
            known = self._ids.setdefault(name, (st.st_dev, st.st_ino))
            if known != (st.st_dev, st.st_ino):
                os.close(fd)
                raise OSError(errno.ENOENT, f"row folder {self._path(name)} was replaced")
            self._fds[name] = fd
            return fd

    def check(self) -> str:
        """'' while every remembered row folder is where it was; else what happened."""
        with self._lock:
            if self.problem:
                return self.problem
            for name, ident in self._ids.items():
                try:
                    st = self._lstat(name)
                except FileNotFoundError:
                    return f"the row folder {self._path(name)} was removed during the run"
                except OSError as e:
                    return f"the row folder {self._path(name)} cannot be reached ({e.strerror})"
                if stat.S_ISLNK(st.st_mode):
                    return f"the row folder {self._path(name)} was replaced by a symbolic link during the run"
                if (st.st_dev, st.st_ino) != ident:
                    return f"the row folder {self._path(name)} was replaced during the run"
            return ""

    def forget(self) -> None:
        """Open the folders again at their next use (their identities are kept)."""
        with self._lock:
            for fd in self._fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._fds.clear()

    def close(self) -> None:
        self.forget()
        with contextlib.suppress(OSError):
            os.close(self._out)


__all__ = ["DIR_MODE", "RowDirs"]
