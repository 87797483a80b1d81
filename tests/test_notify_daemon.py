"""The real daemon speaks sd_notify: `eagle3d run` against a datagram socket the test binds.

What systemd would see, without systemd: EXTEND_TIMEOUT_USEC while loading, READY=1 once
the producer is up, STATUS= with the counters, WATCHDOG=1 while samples complete (and none
once the HF worker hangs), STOPPING=1 on SIGTERM, then exit 0.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from importlib import resources
from pathlib import Path

import pytest
from eagle3d.ingest.dataset import BadSample, parse_line


class Listener:
    """Collects (time, line) of every datagram sent to a bound NOTIFY_SOCKET."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
        self.lines: list[tuple[float, str]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            now = time.monotonic()
            self.lines.extend((now, line) for line in data.decode().split("\n"))

    def first(self, prefix: str) -> float | None:
        return next((t for t, line in list(self.lines) if line.startswith(prefix)), None)

    def times(self, line: str) -> list[float]:
        return [t for t, x in list(self.lines) if x == line]

    def wait(self, prefix: str, proc: subprocess.Popen[bytes], timeout: float = 90.0) -> float:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            t = self.first(prefix)
            if t is not None:
                return t
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no {prefix!r}; got {[x for _, x in self.lines][:40]}")

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.sock.close()


def dataset(path: Path, n: int) -> None:
    raw = resources.files("eagle3d").joinpath("data/demo.jsonl").read_text().splitlines()
    good = []
    for i, line in enumerate(raw):
        try:
            parse_line(i, line)
        except BadSample:
            continue
        good.append(line)
    path.write_text("".join(good[i % len(good)] + "\n" for i in range(n)))


def start(
    tmp_path: Path, model: Path, n: int, **env: str
) -> tuple[subprocess.Popen[bytes], Listener]:
    dataset(tmp_path / "data.jsonl", n)
    listener = Listener(str(tmp_path / "notify.sock"))
    cmd = [
        str(Path(sys.executable).parent / "eagle3d"),
        "run",
        "--model",
        str(model),
        "--dataset",
        str(tmp_path / "data.jsonl"),
        "--output",
        str(tmp_path / "out"),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--workers",
        "1",
        "--batch-tokens",
        "512",
        "--dump-dir",
        str(tmp_path / "dumps"),
    ]
    full_env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("WATCHDOG_", "NOTIFY_"))},
        "NOTIFY_SOCKET": str(tmp_path / "notify.sock"),
        **env,
    }
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, listener


def stop(proc: subprocess.Popen[bytes], listener: Listener, twice: bool = False) -> tuple[int, str]:
    """SIGTERM (a drain); ``twice`` adds a second one, which abandons what is in flight."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        if twice:
            time.sleep(1.0)
            proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        listener.close()
    return proc.returncode, err.decode(errors="replace")


@pytest.mark.timeout(180)
def test_ready_status_watchdog_stopping(tmp_path, tiny_model_dir):
    # Enough samples that an idle machine is still busy three pings (1 s apart) after READY.
    proc, lis = start(tmp_path, tiny_model_dir, 4000, WATCHDOG_USEC="2000000")
    try:
        ready = lis.wait("READY=1", proc)
        extend = lis.first("EXTEND_TIMEOUT_USEC=")
        assert extend is not None and extend <= ready, "no EXTEND_TIMEOUT_USEC before READY=1"
        lis.wait("STATUS=saved ", proc)
        # Pings while samples complete: several within a few seconds of READY.
        end = time.monotonic() + 30
        while len(lis.times("WATCHDOG=1")) < 3 and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.1)
        assert len(lis.times("WATCHDOG=1")) >= 3
        assert proc.poll() is None, "the job finished before the test could stop it"
    finally:
        code, err = stop(proc, lis)
    assert code == 0, err[-3000:]
    assert lis.first("STOPPING=1") is not None
    status = [x for _, x in lis.lines if x.startswith("STATUS=saved ")]
    assert all("/4,000 · " in s for s in status), status[:5]


@pytest.mark.timeout(180)
def test_hung_worker_stops_the_pings(tmp_path, tiny_model_dir):
    stall = 3.0
    proc, lis = start(
        tmp_path,
        tiny_model_dir,
        400,
        WATCHDOG_USEC="2000000",
        EAGLE3D_STALL_SEC=str(stall),
        EAGLE3D_FAULT="worker_hang:2",
    )
    try:
        lis.wait("READY=1", proc)
        # The worker hangs after 2 batches; once nothing completes for `stall` seconds the
        # daemon must go quiet on WATCHDOG=1 although its event loop keeps running.
        deadline = time.monotonic() + 60
        quiet = 0.0
        while time.monotonic() < deadline and proc.poll() is None:
            pings = lis.times("WATCHDOG=1")
            last = pings[-1] if pings else lis.first("READY=1") or 0.0
            quiet = time.monotonic() - last
            if quiet > stall + 4.0:
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the daemon exited instead of hanging"
        assert quiet > stall + 4.0, "WATCHDOG=1 kept coming while the worker hung"
        # ...while STATUS keeps flowing: the loop is alive, the pipeline is not.
        n = len([x for _, x in lis.lines if x.startswith("STATUS=")])
        deadline = time.monotonic() + 30
        while len([x for _, x in lis.lines if x.startswith("STATUS=")]) <= n:
            assert time.monotonic() < deadline, "no STATUS= within 30 s while the worker hung"
            time.sleep(0.1)
    finally:
        # The hung worker would hold a plain drain for its whole timeout: abandon instead.
        stop(proc, lis, twice=True)
