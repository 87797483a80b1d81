"""Power loss: everything written since the last fsync is forgotten, then the job reopens.

SIGKILL keeps the page cache; a power cut does not. :mod:`powerloss` provides a double of the
journal's file seam that logs what each fdatasync made durable, and cuts the files back to
that state. The real JournalWriter and the real commit path (:class:`eagle3d.store.committer.Committer`)
are used in-process, and the real daemon is used through a launcher that puts the double
under its journal. Checks: every record that was acknowledged (an append of a durable kind
returned, or the daemon published it) survives; the output stays consistent; a rerun completes.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import crashcheck
import pytest
import runkit
from eagle3d.dumps.format import Dump
from eagle3proto import events as ev
from eagle3proto.journal import JournalWriter
from eagle3proto.journalread import iter_events
from powerloss import ForgetfulFileOps, power_loss

HERE = Path(__file__).resolve().parent


class PowerCut(BaseException):
    """Raised by the double at the chosen operation: the machine is gone from here on."""


class CuttingOps(ForgetfulFileOps):
    """Forgetful ops that cut the power at the ``cut_at``-th operation (a write is torn)."""

    def __init__(self, log_path: str, cut_at: int) -> None:
        super().__init__(log_path)
        self.cut_at = cut_at
        self.ops = 0

    def _tick(self) -> None:
        self.ops += 1
        if self.ops == self.cut_at:
            raise PowerCut

    def write(self, fd: int, data: bytes | memoryview) -> int:
        if self.ops + 1 == self.cut_at:
            os.write(fd, bytes(data)[: len(data) // 2])  # torn on the way down
        self._tick()
        return super().write(fd, data)

    def fdatasync(self, fd: int) -> None:
        self._tick()
        super().fdatasync(fd)

    def replace(self, src: str, dst: str) -> None:
        self._tick()
        super().replace(src, dst)

    def fsync_dir(self, path: str) -> None:
        self._tick()
        super().fsync_dir(path)


def test_the_double_forgets_unsynced_bytes_and_renames(tmp_path: Path) -> None:
    ops = ForgetfulFileOps(str(tmp_path / "log"))
    a, b = str(tmp_path / "a.tmp"), str(tmp_path / "a")
    fd = ops.create_exclusive(a)
    ops.write(fd, b"durable")
    ops.fdatasync(fd)
    ops.write(fd, b" and not")
    ops.close(fd)
    ops.replace(a, b)  # never made durable: no fsync_dir
    c = str(tmp_path / "c")
    fd = ops.open_append(c)
    ops.write(fd, b"never synced")
    ops.close(fd)
    loss = power_loss(str(tmp_path / "log"))
    assert Path(a).read_bytes() == b"durable" and not Path(b).exists()
    assert loss.undone_renames == [(a, b)]
    assert loss.dropped_bytes == {b: 8}  # cut under its new name, then the rename undone
    assert Path(c).read_bytes() == b"never synced"  # untracked files are left alone


def _dump(idx: int, t: int, h: int = 8) -> Dump:
    import torch

    g = torch.Generator().manual_seed(idx)
    return Dump(
        rid=f"r{idx}",
        layers=[0, 1, 2],
        input_ids=torch.arange(t, dtype=torch.int64),
        aux_hidden_state=torch.randn(t, 3 * h, generator=g),
        hidden_state=torch.randn(t, h, generator=g),
        nbytes=0,
    )


def _job(jdir: str, out: str, ops: ForgetfulFileOps, n: int, acked: list[int]) -> None:
    """A job that commits ``n`` samples the daemon's way: file first, then the durable record."""
    from eagle3d.store.committer import Committer

    committer = Committer(out)
    j = JournalWriter(jdir, fileops=ops, background=False, segment_bytes=2048)
    j.open()
    j.append(ev.RunStarted(total=n))
    done = {e.idx for e in iter_events(jdir)[0] if isinstance(e, ev.SampleSaved)}
    for i in range(n):
        if i in done:
            continue
        j.append(ev.SampleSent(idx=i, rid=f"r{i}"))
        t = 5 + i % 7
        c = committer.commit(i, list(range(t)), [1] * t, _dump(i, t))
        j.append(
            ev.SampleSaved(idx=i, path=c.relpath, bytes=c.nbytes, tokens=t, checksum=c.checksum)
        )
        acked.append(i)  # the durable append returned: this sample is promised
        j.append(ev.Stats(inflight=i))  # chatty: written, not synced
        if i % 3 == 0:
            j.flush()
    j.append(ev.RunFinished(saved=n, failed=0))
    j.close()


def test_acknowledged_commits_survive_a_power_cut_at_every_operation(tmp_path: Path) -> None:
    """Cut the power at each journal operation in turn of a real JournalWriter + Committer job
    (small segments, so rotations are cut too)."""
    n = 12
    # How many seam operations a whole job makes, to aim the cuts inside it.
    probe = CuttingOps(str(tmp_path / "probe.log"), cut_at=-1)
    _job(str(tmp_path / "probe" / "j"), str(tmp_path / "probe"), probe, n, [])
    total_ops = probe.ops
    assert total_ops > 30  # header writes, appends, syncs, renames and directory syncs
    dropped_any = False
    for k in range(1, total_ops + 1):
        base = tmp_path / f"cut-{k}"
        out, jdir, log = str(base), str(base / ".eagle3d" / "j"), str(base) + ".log"
        acked: list[int] = []
        ops = CuttingOps(log, cut_at=k)
        with pytest.raises(PowerCut):
            _job(jdir, out, ops, n, acked)
        for fd in list(ops._paths):
            os.close(fd)  # the process is gone; nothing more reaches the disk
        loss = power_loss(log)
        dropped_any = dropped_any or loss.total_dropped > 0
        events, rep = iter_events(jdir)
        assert not rep.stopped_early, rep.problems
        saved = [e for e in events if isinstance(e, ev.SampleSaved)]
        ids = [e.idx for e in saved]
        assert set(acked) <= set(ids), f"cut at op {k}: acknowledged {acked}, survived {ids}"
        assert len(ids) == len(set(ids))
        assert set(ids) - set(acked) <= {len(acked)}  # at most the one being appended
        for e in saved:
            size, crc = crashcheck.file_crc(os.path.join(out, e.path))
            assert (size, crc) == (e.bytes, e.checksum), f"cut at op {k}: sample {e.idx}"
        # Reopen with the real file layer and finish the job: recovery, then append.
        again: list[int] = []
        _job(jdir, out, ForgetfulFileOps(log + ".2"), n, again)
        events, rep = iter_events(jdir)
        final = [e.idx for e in events if isinstance(e, ev.SampleSaved)]
        assert sorted(final) == list(range(n)), f"cut at op {k}: {sorted(final)}"
        for e in events:
            if isinstance(e, ev.SampleSaved):
                size, crc = crashcheck.file_crc(os.path.join(out, e.path))
                assert (size, crc) == (e.bytes, e.checksum)
    assert dropped_any, "no cut dropped any unsynced byte: the double proved nothing"


def _launch(
    model: Path, data: Path, out: Path, log: Path, *extra: str, fault: str = ""
) -> subprocess.Popen[bytes]:
    env = runkit.env_without_faults()
    if fault:
        env["EAGLE3D_FAULT"] = fault
    argv = runkit.run_args(model, data, out, *extra)[3:]  # drop "python -m eagle3d"
    logf = open(f"{out}.out", "wb")  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen(
            [sys.executable, str(HERE / "powerloss.py"), str(log), "--", *argv],
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    finally:
        logf.close()


def _published_saved(log: Path) -> set[int]:
    if not log.exists():
        return set()
    return {
        int(w[2])
        for w in (ln.split() for ln in log.read_text().splitlines())
        if w[:2] == ["published", "sample_saved"]
    }


def test_daemon_killed_then_power_cut(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGKILL the real daemon mid-run, forget its unsynced journal bytes, rerun."""
    data, out, log = tmp_path / "data.jsonl", tmp_path / "out", tmp_path / "ops.log"
    valid, malformed = runkit.dataset(data, 30)
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    # Small batches keep commits (and so unsynced chatty records) flowing at the kill.
    proc = _launch(tiny_model_dir, data, out, log, "--batch-tokens", "512")
    try:
        runkit.wait_for(lambda: len(_published_saved(log)) >= 1, 90, "a published sample")
        time.sleep(rng.uniform(0.0, 1.0))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    published = _published_saved(log)
    loss = power_loss(str(log))
    print(f"published {len(published)} saved; power cut dropped {loss.dropped_bytes}")
    c = runkit.check(out)
    assert not (c.lost or c.corrupt or c.duplicated or c.journal), c.bad
    assert published <= c.saved, sorted(published - c.saved)
    r = runkit.run(tiny_model_dir, data, out)
    assert r.returncode == 0, r.stderr[-2000:]
    runkit.assert_complete(out, valid, malformed)


def test_record_written_but_not_synced_is_lost_and_redone(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``kill:after_append_before_sync`` under the forgetful layer: the record reached the page
    cache only, so the power cut takes it; nothing acknowledged is lost and the rerun redoes it."""
    data, out, log = tmp_path / "data.jsonl", tmp_path / "out", tmp_path / "ops.log"
    valid, malformed = runkit.dataset(data, 25)
    proc = _launch(tiny_model_dir, data, out, log, fault="kill:after_append_before_sync:15")
    assert proc.wait(timeout=120) == 137, (out.parent / "out.out").read_text()[-2000:]
    published = _published_saved(log)
    seg = sorted((out / ".eagle3d" / "journal" / "shard-0-of-1").glob("*.e3j"))
    loss = power_loss(str(log))
    assert any(Path(p) in seg for p in loss.dropped_bytes), loss  # the unsynced append went
    c = runkit.check(out)
    assert not (c.lost or c.corrupt or c.duplicated or c.journal), c.bad
    assert published <= c.saved
    r = runkit.run(tiny_model_dir, data, out)
    assert r.returncode == 0, r.stderr[-2000:]
    runkit.assert_complete(out, valid, malformed)
