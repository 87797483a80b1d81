"""Scratch folders and filesystems for a benchmark: made under the given parents, removed
whatever happens."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def scratch(prefix: str, *parents: str) -> Iterator[list[str]]:
    """One new folder under each of ``parents`` (named ``prefix...``), removed on exit."""
    made: list[str] = []
    try:
        for parent in parents:
            made.append(tempfile.mkdtemp(prefix=prefix, dir=parent))
        yield made
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def fresh_fs(parent: str, nbytes: int) -> Iterator[Path]:
    """A new journaled ext4 of ``nbytes`` (a sparse image in ``parent``, on a loop device
    doing direct I/O into it, so writes reach ``parent``'s disk as the job's own would),
    mounted on a new folder; all of it removed on exit. Needs root.

    Why: on a filesystem that earlier runs just filled and emptied, creating a file can
    cost 20x a fresh one's (ext4 without a journal skips inodes deleted in the last
    minutes, reading each one's table block): a benchmark's own cleanup between rounds
    would be measured as the daemon's per-file cost."""
    made: list[str] = []
    loop = ""
    try:
        fd, image = tempfile.mkstemp(prefix="fresh-fs-", suffix=".img", dir=parent)
        made.append(image)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        # Few inodes, written now: no lazy init thread writing beside the benchmark.
        mkfs = ["mkfs.ext4", "-q", "-F", "-N", "65536"]
        subprocess.run([*mkfs, "-E", "lazy_itable_init=0,lazy_journal_init=0", image], check=True)
        loop = subprocess.run(
            ["losetup", "--find", "--show", "--direct-io=on", image],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        mnt = tempfile.mkdtemp(prefix="fresh-fs-", dir=parent)
        made.append(mnt)
        subprocess.run(["mount", loop, mnt], check=True)
        try:
            yield Path(mnt)
        finally:
            if subprocess.run(["umount", mnt], check=False).returncode:
                subprocess.run(["umount", "-l", mnt], check=False)  # a descriptor still open
    finally:
        if loop:
            subprocess.run(["losetup", "-d", loop], check=False)
        for path in reversed(made):
            if os.path.isdir(path):
                os.rmdir(path)
            elif os.path.exists(path):
                os.unlink(path)
