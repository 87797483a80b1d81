"""The one narrow seam between the journal writer and the filesystem.

:class:`OsFileOps` is the real thing. Tests substitute a double (for example one that
forgets every byte written since the last fdatasync, to simulate power loss) beside it.
"""

from __future__ import annotations

import os

#: A journal segment's mode: the owner writes, the group may read, others nothing.
FILE_MODE = 0o640


class OsFileOps:
    """Plain POSIX file operations."""

    def open_append(self, path: str) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, FILE_MODE)

    def create_exclusive(self, path: str) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        return os.write(fd, data)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def ftruncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def fstat_size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def close(self, fd: int) -> None:
        os.close(fd)

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def truncate_path(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)
