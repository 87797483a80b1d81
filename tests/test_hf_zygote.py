"""The HF workers' zygote: CPU workers forked from one process that imported torch once.

Real processes throughout: a real producer, its real zygote and workers on the tiny model.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import psutil
import pytest
from eagle3d.core.sample import Request
from eagle3d.produce.hf import HFProducer
from eagle3d.produce.hf_workers import ProducerStartError
from eagle3d.produce.hf_zygote import ForkedWorker, Zygote, forkable


class _Events:
    def __init__(self) -> None:
        self.states: list[tuple[str, str]] = []
        self.failed: list[tuple[str, str]] = []

    def request_failed(self, rid: str, error: str, message: str, retryable: bool) -> None:
        self.failed.append((rid, error))

    def producer_state(self, state: str, message: str = "") -> None:
        self.states.append((state, message))

    def requests_started(self, rids: list[str]) -> None:
        pass


def _producer(model: Path, tmp: Path, workers: int = 2, threads: int = 1) -> HFProducer:
    (tmp / "dumps").mkdir(exist_ok=True)
    return HFProducer(str(model), dump_dir=str(tmp / "dumps"), workers=workers, threads=threads)


async def _until(check: Callable[[], object], secs: float, what: str) -> None:
    deadline = time.monotonic() + secs
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _computes(p: HFProducer, tmp: Path, rid: str) -> None:
    """A request sent now comes back as a dump in the dump area."""
    p.submit(Request(rid, 0, [1, 2, 3, 4, 5, 6]))
    await _until(lambda: any(rid in f for f in os.listdir(tmp / "dumps")), 60, f"{rid}'s dump")


def _zygote(p: HFProducer) -> Zygote:
    z = p._launcher.zygote
    assert z is not None
    return z


def _pids(p: HFProducer) -> list[int]:
    return [w.proc.pid for w in p._workers if w is not None and w.proc.pid is not None]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), 180))


def test_only_cpu_workers_fork() -> None:
    assert forkable("cpu", 0) and forkable("cpu", 2) and forkable("auto", 0)
    assert not forkable("auto", 1) and not forkable("cuda:0", 1) and not forkable("cuda", 0)


def test_cpu_workers_are_forked_from_one_zygote(tiny_model_dir: Path, tmp_path: Path) -> None:
    async def body() -> None:
        p, events = _producer(tiny_model_dir, tmp_path, threads=2), _Events()
        await p.start(events)
        z = _zygote(p)
        # One process imported torch, with a single thread (no pool was forked)...
        assert z.hello is not None and z.hello.tasks == 1 and z.hello.pid == z.proc.pid
        assert len(_pids(p)) == 2
        for w in p._workers:
            assert w is not None and isinstance(w.proc, ForkedWorker) and w.info is not None
            proc = psutil.Process(w.proc.pid)
            # ... and each worker is its child, set its own threads after the fork, shows as a
            # worker, and is in the daemon's process group (a group's Ctrl-C reaches it).
            assert proc.ppid() == z.proc.pid and w.info.pid == w.proc.pid
            assert w.info.threads == 2
            assert proc.cmdline()[1:3] == ["-m", "eagle3d.remote.hf_worker"]
            assert proc.cmdline()[-2:] == ["--threads", "2"]  # whole: the zygote left room
            assert os.getpgid(proc.pid) == os.getpgid(0)
        await _computes(p, tmp_path, "r1")
        await _computes(p, tmp_path, "r2")
        pids = [*_pids(p), z.proc.pid]
        await p.stop()
        assert all(_gone(pid) for pid in pids)
        assert z.proc.returncode == 0

    _run(body)


def test_a_killed_worker_is_forked_again(tiny_model_dir: Path, tmp_path: Path) -> None:
    async def body() -> None:
        p, events = _producer(tiny_model_dir, tmp_path), _Events()
        await p.start(events)
        z = _zygote(p)
        old = _pids(p)[0]
        os.kill(old, signal.SIGKILL)
        await _until(lambda: len(events.states) >= 3, 60, "the restart")
        assert events.states[1] == ("restarting", f"worker {old} exited with code -9")
        assert events.states[2][0] == "up"
        new = _pids(p)[0]
        assert new != old and psutil.Process(new).ppid() == z.proc.pid
        await _computes(p, tmp_path, "after")
        await p.stop()

    _run(body)


def test_a_killed_zygote_leaves_its_workers_and_restarts_exec(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    async def body() -> None:
        p, events = _producer(tiny_model_dir, tmp_path), _Events()
        await p.start(events)
        z = _zygote(p)
        z.proc.kill()
        await z.proc.wait()
        await _until(lambda: z.gone, 10, "the zygote's end seen")
        await _computes(p, tmp_path, "orphans")  # its workers go on
        old = _pids(p)[0]
        os.kill(old, signal.SIGKILL)  # its status is nobody's to tell now: seen on the pidfd
        await _until(lambda: len(events.states) >= 3, 60, "the restart")
        assert events.states[1] == ("restarting", f"worker {old} exited with code None")
        w = p._workers[0]
        assert w is not None and not isinstance(w.proc, ForkedWorker)
        assert psutil.Process(w.proc.pid).ppid() == os.getpid()  # exec'd
        await _computes(p, tmp_path, "exec")
        await p.stop()
        assert p._workers[1] is not None and _gone(_pids(p)[1])

    _run(body)


def test_a_zygote_that_dies_importing_fails_the_start(tiny_model_dir: Path, tmp_path: Path) -> None:
    async def body() -> None:
        p, events = _producer(tiny_model_dir, tmp_path), _Events()
        await p.launch(events)
        _zygote(p).proc.kill()
        with pytest.raises(ProducerStartError, match="zygote exited with code -9 before forking"):
            await p.start(events)
        await p.stop()
        assert psutil.Process().children(recursive=True) == []

    _run(body)


def test_a_failed_import_is_reported_like_a_load_failure(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "fake" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('transformers is broken here')\n")
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))

    async def body() -> None:
        p, events = _producer(tiny_model_dir, tmp_path), _Events()
        with pytest.raises(
            ProducerStartError, match="could not import: ImportError: transformers is broken"
        ):
            await p.start(events)
        await p.stop()
        assert psutil.Process().children(recursive=True) == []

    _run(body)


def test_a_stop_while_the_zygote_imports_leaves_no_process(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    async def body() -> None:
        p, events = _producer(tiny_model_dir, tmp_path), _Events()
        await p.launch(events)
        z = _zygote(p)
        await p.stop()
        assert z.hello is None  # it was still importing: ended at once, nothing forked
        assert z.proc.returncode == -signal.SIGUSR1
        assert psutil.Process().children(recursive=True) == []

    _run(body)


def test_a_stop_while_the_workers_load_leaves_no_process(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EAGLE3D_FAULT", "worker_slow_load:60000")

    async def body() -> None:
        p, events = _producer(tiny_model_dir, tmp_path), _Events()
        await p.launch(events)
        await _until(lambda: len(_pids(p)) == 2, 60, "both workers forked")
        pids = [*_pids(p), _zygote(p).proc.pid]
        await p.stop()
        assert all(_gone(pid) for pid in pids)
        assert psutil.Process().children(recursive=True) == []

    _run(body)


def test_the_switch_turns_the_zygote_off(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EAGLE3D_WORKER_ZYGOTE", "0")

    async def body() -> None:
        p, events = _producer(tiny_model_dir, tmp_path), _Events()
        await p.start(events)
        assert p._launcher.zygote is None
        assert all(psutil.Process(pid).ppid() == os.getpid() for pid in _pids(p))
        await _computes(p, tmp_path, "exec")
        await p.stop()

    _run(body)


def test_the_group_signals_are_the_daemons_to_act_on(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Ctrl-C, SIGTERM or SIGHUP sent to the process group reach the zygote and its workers
    (all in the daemon's group) as they reach exec'd workers: ignored, the daemon stops them."""
    group = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    async def body() -> None:
        p, events = _producer(tiny_model_dir, tmp_path), _Events()
        await p.launch(events)
        z = _zygote(p)
        assert os.getpgid(z.proc.pid) == os.getpgid(0)
        await asyncio.sleep(0.5)  # past the interpreter's start, into the imports
        for sig in group:
            os.kill(z.proc.pid, sig)
        await p.start(events)
        for pid in [*_pids(p), z.proc.pid]:
            for sig in group:
                os.kill(pid, sig)
        await asyncio.sleep(0.5)
        assert z.proc.returncode is None and not any(_gone(pid) for pid in _pids(p))
        await _computes(p, tmp_path, "after-signals")
        await p.stop()

    _run(body)


def test_a_daemon_gone_before_its_forks_were_read_gets_none(tiny_model_dir: Path) -> None:
    """The daemon is killed while the zygote imports, with two forks asked: the zygote leaves
    without forking (a worker would load the model for nobody)."""
    import socket
    import subprocess
    import sys

    from eagle3d.remote import hf_protocol as pr

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    cmd = [sys.executable, "-m", "eagle3d.remote.hf_zygote", "--fd", str(theirs.fileno())]
    z = subprocess.Popen([*cmd, "--model", str(tiny_model_dir)], pass_fds=[theirs.fileno()])
    theirs.close()
    outs = []
    for ident in (1, 2):
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        flags = ["--model", str(tiny_model_dir), "--dump-dir", "/nonexistent"]
        socket.send_fds(ours, [pr.encode(pr.Fork(ident, flags))], [in_r, out_w])
        os.close(in_r)
        os.close(out_w)
        outs.append((in_w, out_r))
    ours.close()
    assert z.wait(timeout=60) == 0
    for in_w, out_r in outs:
        assert os.read(out_r, 1 << 16) == b""  # a forked worker would have said "ready"
        os.close(in_w)
        os.close(out_r)
