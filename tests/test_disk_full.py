"""Disk full: the output on a small filesystem.

Where root may mount one, a size-limited tmpfs holds the output (and its journal): real ENOSPC
from the kernel, short writes included. Elsewhere the tests that need it are skipped and the
commit-layer test falls back to a writer double at :class:`eagle3d.commit.ChecksumWriter`.

The daemon must journal a clear ``run_state paused`` record naming the disk, keep running
without failing samples, leave no partial frame or temp file, and resume on its own when the
filesystem grows (``mount -o remount,size=...``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import runkit
from eagle3d.commit import CommitError, Committer
from eagle3d.dump import Dump


def _mount(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
    )
    return r.returncode == 0


def _umount(path: Path) -> None:
    for _ in range(50):
        if subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
            return
        time.sleep(0.2)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs (skipped where this process may not mount)."""
    mnt = tmp_path / "small"
    if os.geteuid() != 0 or not _mount(mnt, "256k"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        _umount(mnt)


def _dump(t: int, h: int = 64) -> Dump:
    import torch

    g = torch.Generator().manual_seed(t)
    return Dump(
        rid="r",
        layers=[0, 1, 2],
        input_ids=torch.arange(t, dtype=torch.int64),
        aux_hidden_state=torch.randn(t, 3 * h, generator=g),
        hidden_state=torch.randn(t, h, generator=g),
        nbytes=0,
    )


def test_commit_on_a_full_disk_raises_enospc_and_leaves_nothing(small_fs: Path) -> None:
    """torch.save turns the writer's OSError into a RuntimeError from its zip writer; the
    commit must still report ENOSPC (so the daemon pauses instead of failing the sample)."""
    c = Committer(str(small_fs))
    t = 400  # 400 x 256 floats = 400 KiB: more than the filesystem holds
    with pytest.raises(CommitError) as ei:
        c.commit(0, list(range(t)), [1] * t, _dump(t))
    assert ei.value.errno == errno.ENOSPC, repr(ei.value)
    leftovers = [p.name for p in small_fs.rglob("*") if p.is_file()]
    assert leftovers == []  # no temp file, no final file


def test_commit_enospc_through_the_writer_seam(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same promise without a mount: the checksum writer fails with ENOSPC mid-file."""
    from eagle3d import commit

    real = commit.ChecksumWriter.write

    def write(self: commit.ChecksumWriter, data: object) -> int:
        if self.size > 20_000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(commit.ChecksumWriter, "write", write)
    c = Committer(str(tmp_path))
    t = 400
    with pytest.raises(CommitError) as ei:
        c.commit(3, list(range(t)), [1] * t, _dump(t))
    assert ei.value.errno == errno.ENOSPC, repr(ei.value)
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []
