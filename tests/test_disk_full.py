"""Disk full: the output on a small filesystem.

Where root may mount one, a size-limited tmpfs holds the output (and its journal): real ENOSPC
from the kernel, short writes included. Elsewhere the tests that need it are skipped and the
commit-layer test falls back to a writer double at :class:`eagle3d.store.committer.ChecksumWriter`.

The daemon must journal a clear ``run_state paused`` record naming the disk, keep running
without failing samples, leave no partial frame or temp file, and resume on its own when the
filesystem grows (``mount -o remount,size=...``).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import runkit
from eagle3d.dumps.format import Dump
from eagle3d.store.committer import CommitError, Committer


def _mount(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
    )
    return r.returncode == 0


def _umount(path: Path) -> None:
    """Unmount; detached lazily where a descriptor still open (a committer's row folder)
    keeps it busy: it goes once that is closed, and never stays behind the test."""
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=True)


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
    """The commit reports ENOSPC (so the daemon pauses instead of failing the sample)."""
    c = Committer(str(small_fs))
    t = 400  # 400 x 256 floats = 400 KiB: more than the filesystem holds
    with pytest.raises(CommitError) as ei:
        c.commit(0, list(range(t)), [1] * t, _dump(t))
    assert ei.value.errno == errno.ENOSPC, repr(ei.value)
    leftovers = [p.name for p in small_fs.rglob("*") if p.is_file()]
    assert leftovers == []  # no temp file, no final file


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_commit_enospc_through_the_writer_seam(
    direct: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same promise without a mount: the write fails with ENOSPC mid-file, after part
    of it reached the file (as a real full disk does); for buffered and direct writes."""
    real_writev, real_pwrite = os.writev, os.pwrite

    def writev(fd: int, buffers: list[memoryview]) -> int:
        if os.fstat(fd).st_size > 20_000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_writev(fd, [memoryview(b)[:8192] for b in buffers[:1]])

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        if offset > 20_000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, memoryview(data)[:8192], offset)

    monkeypatch.setattr(os, "writev", writev)
    monkeypatch.setattr(os, "pwrite", pwrite)
    _assert_commit_says_enospc_and_leaves_nothing(tmp_path, direct)


def test_commit_enospc_through_torch_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples of 4 GiB and more go through torch.save (zip64), which turns the writer's
    OSError into a RuntimeError from its zip writer; the commit must still say ENOSPC (so
    the daemon pauses instead of failing the sample). The size limit is lowered to get there."""
    from eagle3d.remote import samplefile as ckpt
    from eagle3d.store import committer as commit

    real = commit.ChecksumWriter.write

    def write(self: commit.ChecksumWriter, data: object) -> int:
        if self.size > 20_000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(commit.ChecksumWriter, "write", write)
    monkeypatch.setattr(ckpt, "_LIMIT", 1000)
    _assert_commit_says_enospc_and_leaves_nothing(tmp_path)


def _assert_commit_says_enospc_and_leaves_nothing(out: Path, direct: bool = True) -> None:
    t = 400
    c = Committer(str(out), direct=direct)
    with pytest.raises(CommitError) as ei:
        c.commit(3, list(range(t)), [1] * t, _dump(t))
    assert c.direct == direct  # ENOSPC is no reason to give up direct I/O
    assert ei.value.errno == errno.ENOSPC, repr(ei.value)
    assert [p.name for p in out.rglob("*") if p.is_file()] == []


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Mount tmpfs filesystems of a given size (skipped where this process may not mount)."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"mnt{len(mounted)}"
        if os.geteuid() != 0 or not _mount(mnt, size):
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(mnt)
        return mnt

    try:
        yield mount
    finally:
        for mnt in mounted:
            _umount(mnt)


def test_daemon_pauses_on_a_full_disk_and_resumes_when_it_grows(
    tiny_model_dir: Path, tmpfs: Callable[[str], Path], tmp_path: Path
) -> None:
    one_mib_fs = tmpfs("1m")
    data, out = tmp_path / "data.jsonl", one_mib_fs / "out"
    valid, malformed = runkit.dataset(data, 30)  # ~2.5 MB of samples for a 1 MiB filesystem
    # --no-space-check: the job does not fit on purpose (eagle3d plan would refuse it).
    proc = runkit.start(
        tiny_model_dir,
        data,
        out,
        "--dump-dir",
        str(tmp_path / "dumps"),
        "--no-space-check",
        log=tmp_path / "log",
    )
    try:
        runkit.wait_for(
            lambda: any(r.get("state") == "paused" for r in runkit.records(out, "run_state")),
            90,
            "a run_state paused record",
        )
        paused = [r for r in runkit.records(out, "run_state") if r.get("state") == "paused"]
        assert "disk full" in paused[0]["reason"] and str(out) in paused[0]["reason"], paused
        # Paused, not gone: it stays up through two stats records while paused, or 30 s
        # where the full disk leaves no room for them (they are not durable records).
        deadline = time.monotonic() + 30
        while (
            time.monotonic() < deadline
            and proc.poll() is None
            and sum(r.get("state") == "paused" for r in runkit.records(out, "stats")) < 2
        ):
            time.sleep(0.2)
        assert proc.poll() is None, "the daemon must pause, not exit"

        c = runkit.check(out)
        assert not c.bad, c.bad
        assert c.temp_files == 0, "a failed commit must not leave its temp file"
        assert not c.torn_tail, "no partial frame at the end of the journal"
        assert c.failed <= malformed, "a full disk must not fail samples"
        assert len(c.saved) < len(valid)

        top = subprocess.run(
            [sys.executable, "-m", "eagle3top.cli", "--once", "--output", str(out)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        print(top.stdout)
        assert top.returncode == 2, (top.returncode, top.stdout, top.stderr[-1000:])  # CRITICAL
        assert "disk" in top.stdout.lower()

        subprocess.run(["mount", "-o", "remount,size=64m", str(one_mib_fs)], check=True)
        assert proc.wait(timeout=120) == 0, (tmp_path / "log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    states = [r.get("state") for r in runkit.records(out, "run_state")]
    # loading the model, the producer up, then the pause and the resume
    assert states[:4] == ["loading", "running", "paused", "running"], states
    runkit.assert_complete(out, valid, malformed)


def _fill(directory: Path) -> Path:
    """Take every free byte of ``directory``'s filesystem with one file."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        block = b"\0" * 65536
        while True:
            try:
                if os.write(fd, block) < len(block):
                    block = block[:4096] if len(block) > 4096 else block[:1]
            except OSError as e:
                if e.errno != errno.ENOSPC or len(block) == 1:
                    break
                block = block[: max(1, len(block) // 16)]
    finally:
        os.close(fd)
    return filler


def test_journal_and_output_both_full_then_a_file_is_deleted(
    tiny_model_dir: Path, tmpfs: Callable[[str], Path], tmp_path: Path
) -> None:
    """A filler takes every byte, so even the journal cannot append: the daemon must still
    pause without failing samples or tearing a frame, and go on once the filler is deleted,
    even though the freed space is less than twice all the dumps waiting to be committed."""
    fs = tmpfs("8m")
    data, out = tmp_path / "data.jsonl", fs / "out"
    valid, malformed = runkit.dataset(data, 20)  # 5.5 MB of samples: they fit in 8 MiB
    # One sample per batch and a rest after each: the run is surely still going when the
    # filler lands (at full speed the 20 samples can all be saved before it does).
    proc = runkit.start(
        tiny_model_dir,
        data,
        out,
        "--dump-dir",
        str(tmp_path / "dumps"),
        "--batch-tokens",
        "1",
        "--no-space-check",  # an 8 MiB filesystem holds no 256 MiB reserve
        fault="worker_slow:300",
        log=tmp_path / "log",
    )
    try:
        runkit.wait_for(lambda: runkit.records(out, "sample_saved"), 90, "a saved sample")
        filler = _fill(fs)
        log_path = tmp_path / "log"
        runkit.wait_for(
            lambda: proc.poll() is not None or b"paused: disk full" in log_path.read_bytes(),
            60,
            "the pause on the full disk",
        )
        assert proc.poll() is None, (tmp_path / "log").read_text()[-3000:]
        c = runkit.check(out)
        assert not c.bad, c.bad
        assert not c.torn_tail and c.temp_files == 0
        assert c.failed <= malformed, "a full disk must not fail samples"
        log = (tmp_path / "log").read_text()
        print("paused in the journal:", runkit.records(out, "run_state"))
        if len(c.saved | c.failed) < len(valid | malformed):
            assert "paused: disk full" in log  # at least the log and STATUS say it
        filler.unlink()
        assert proc.wait(timeout=120) == 0, (tmp_path / "log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    runkit.assert_complete(out, valid, malformed)


def test_full_before_the_first_commit_is_still_journaled(
    tiny_model_dir: Path, tmpfs: Callable[[str], Path], tmp_path: Path
) -> None:
    """The disk fills before any commit, so a failed commit frees nothing: the paused state
    must still reach the journal (and so the monitor) while the disk is full."""
    fs = tmpfs("4m")
    data, out = tmp_path / "data.jsonl", fs / "out"
    valid, malformed = runkit.dataset(data, 10)
    log = tmp_path / "log"
    # A 4 MiB filesystem holds no 256 MiB reserve: the space check would refuse the run. The
    # disk fills while the workers load (slowed by the fault): the feeder has samples ready by
    # then, and the first commit would come within a second of the producer being up.
    proc = runkit.start(
        tiny_model_dir,
        data,
        out,
        "--dump-dir",
        str(tmp_path / "dumps"),
        "--no-space-check",
        log=log,
        fault="worker_slow_load:4000",
    )
    try:
        runkit.wait_for(lambda: b"loading model" in log.read_bytes(), 90, "the load")
        filler = _fill(fs)
        runkit.wait_for(lambda: b"paused: disk full" in log.read_bytes(), 60, "the pause")
        runkit.wait_for(
            lambda: any(r.get("state") == "paused" for r in runkit.records(out, "run_state")),
            30,
            "the paused state in the journal while the disk is full",
        )
        # A commit thread may be between a file's rename and its withdrawal (the journal
        # refused its sample_saved record): that file goes within moments; one that stays
        # is a file the journal does not know of.
        runkit.wait_for(lambda: not runkit.check(out).bad, 10, "no unrecorded file")
        c = runkit.check(out)
        assert not c.bad and not c.torn_tail and c.temp_files == 0, c.bad
        top = subprocess.run(
            [sys.executable, "-m", "eagle3top.cli", "--once", "--output", str(out)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert top.returncode == 2 and "disk" in top.stdout.lower(), top.stdout
        filler.unlink()
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    runkit.assert_complete(out, valid, malformed)
