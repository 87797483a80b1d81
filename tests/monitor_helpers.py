"""Helpers for the monitor tests: real journals written with the real JournalWriter, the
shard lock held like the daemon holds it, and the real event-source process."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Iterator

from eagle3proto import events as ev
from eagle3proto import locks, paths
from eagle3proto.journal import JournalWriter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = sys.executable
EAGLE3_TOP = os.path.join(os.path.dirname(PY), "eagle3-top")
#: Stands in for ssh: drops the host and runs the remote command string with sh, as sshd does.
FAKE_SSH = "sh -c 'shift; exec sh -c \"$1\"' fake-ssh"


def write_journal(
    output: str,
    events: list[ev.Event],
    shard: paths.Shard | None = None,
) -> str:
    """Append ``events`` (with their own ``ts``) to a shard's journal; returns its dir."""
    shard = shard or paths.Shard(0, 1)
    jdir = paths.journal_dir(output, shard)
    w = JournalWriter(jdir, shard_index=shard.index, shard_count=shard.count, background=False)
    w.open()
    for e in events:
        w.append(e)
    w.close()
    return jdir


def run_events(
    t0: float,
    total: int,
    saved: int,
    failed: int = 0,
    step: float = 1.0,
    bytes_each: int = 1000,
    fail_at: float | None = None,
) -> list[ev.Event]:
    """A plausible session: run_started, then saved samples one per ``step`` seconds. Its
    daemon is this process (the one :func:`hold_lock` makes hold the shard lock)."""
    me = os.getpid()
    out: list[ev.Event] = [
        ev.RunStarted(
            ts=t0,
            total=total,
            job=ev.JobInfo(model="m"),
            pid=me,
            pid_start=locks.start_time(me),
            boot_id=locks.boot_id(),
        )
    ]
    t = t0
    for i in range(saved):
        t += step
        out.append(ev.SampleSent(ts=t - step / 2, idx=i, tokens=10))
        out.append(
            ev.SampleSaved(
                ts=t, idx=i, path=paths.sample_relpath(i), bytes=bytes_each, tokens=10, checksum="0"
            )
        )
    for k in range(failed):
        ft = fail_at if fail_at is not None else t
        out.append(ev.SampleFailed(ts=ft, idx=saved + k, error="ValueError", message="bad"))
    return out


def stats(ts: float, free: int, total: int = 1 << 40) -> ev.Stats:
    return ev.Stats(
        ts=ts,
        disk=[
            ev.DiskUsage(
                label="output",
                path="/o",
                total_bytes=total,
                used_bytes=total - free,
                free_bytes=free,
            )
        ],
        producer=ev.ProducerHealth(name="hf", up=True, latency_s=0.2),
        gpu_note="no GPU telemetry: NVML Shared Library Not Found",
    )


@contextlib.contextmanager
def hold_lock(output: str, shard: paths.Shard | None = None) -> Iterator[None]:
    """Hold the shard lock the way the daemon does (an exclusive flock)."""
    path = paths.lock_path(output, shard or paths.Shard(0, 1))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def event_source(output: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """The real event-source process (JournalWriter + EventServer), until the block ends."""
    p = subprocess.Popen(
        [PY, os.path.join(HERE, "eventsource.py"), "--output", output, *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.startswith("ready"), line
        yield p
    finally:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def wait_for(pred, timeout: float = 10.0, step: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())


def top(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """Run the real ``eagle3-top`` console script."""
    e = dict(os.environ)
    e.pop("FORCE_COLOR", None)
    if env:
        e.update(env)
    return subprocess.run(
        [EAGLE3_TOP, *args], capture_output=True, text=True, env=e, timeout=timeout, check=False
    )


def shown_reason(verdict: str) -> str:
    """The reason in the TUI's verdict lines: the first line and its indented continuation
    (a long reason wraps), whitespace collapsed; other messages follow on their own lines."""
    first, *rest = verdict.split("\n")
    return " ".join(" ".join([first, *(r for r in rest if r.startswith("  "))]).split())
