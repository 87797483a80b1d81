"""Every start speaks from its first second: each stage of ``eagle3d run``'s start is a log
line, the monitor (``--once``, ``--json``, the TUI in tmux) shows the stage ticking through
the daemon's start beacon (an abstract Unix socket: nothing written under the output), and
a SIGINT at any moment of the start ends it promptly with words that are true afterwards.

The dataset has two million short rows after the demo's, and its count rests after each MiB
(``count_slow``): counting them takes seconds, which is what these tests watch (they are
stopped before any is sent)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import runkit
from eagle3proto import paths, wire
from monitor_helpers import EAGLE3_TOP
from test_tmux import Tmux

pytestmark = pytest.mark.timeout(180)

DEMO = Path(__file__).parent.parent / "daemon" / "eagle3d" / "data" / "demo.jsonl"
SHORT_ROWS = 2_000_000
#: The rows are counted at memory speed (16 MB in a tenth of a second): a rest after each
#: MiB scanned makes the count take seconds, for the tests to act during it.
SLOW_READ = "count_slow:300"


def _dataset(tmp_path: Path) -> tuple[Path, int]:
    data = tmp_path / "big.jsonl"
    demo = DEMO.read_text()
    with data.open("w") as f:
        f.write(demo)
        f.write('{"x":0}\n' * SHORT_ROWS)
    return data, demo.count("\n") + SHORT_ROWS


def _once(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [EAGLE3_TOP, "--output", str(out), "--once", *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _shard(out: Path) -> tuple[dict[str, Any], int]:
    r = _once(out, "--json")
    doc = json.loads(r.stdout)
    return doc["shards"][0], r.returncode


def _poll(
    out: Path, want: Any, proc: subprocess.Popen[bytes], timeout: float = 90
) -> dict[str, Any]:
    """The first ``--once --json`` shard for which ``want(shard)`` holds (the daemon alive)."""
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        assert proc.poll() is None, runkit.log_of(out)[-3000:]
        last, code = _shard(out)
        if want(last):
            assert code == 0, last  # a start is OK
            return last
    raise AssertionError(f"never seen; last: {last}\nlog: {runkit.log_of(out)[-3000:]}")


def _reading(s: dict[str, Any]) -> bool:
    st = s.get("start") or {}
    return str(st.get("stage", "")).startswith("reading dataset") and st.get("rows", 0) > 0


def _stop(proc: subprocess.Popen[bytes], out: Path) -> int:
    proc.send_signal(signal.SIGINT)
    return runkit.exit_code(proc, 15, Path(f"{out}.log"))


def _as_nobody(name: str) -> bytes:
    """What the beacon answers a peer of another uid (``nobody``), before any hello."""
    code = (
        "import socket,sys\n"
        "s=socket.socket(socket.AF_UNIX,socket.SOCK_STREAM)\n"
        "s.settimeout(10)\n"
        f"s.connect({name!r})\n"
        "out=b''\n"
        "while (b:=s.recv(65536)):\n"
        "    out+=b\n"
        "sys.stdout.buffer.write(out)\n"
    )
    r = subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "/usr/bin/python3"],
        input=code.encode(),
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert r.returncode == 0, r.stderr.decode()
    return r.stdout


@pytest.mark.skipif(shutil.which("setpriv") is None or os.geteuid() != 0, reason="needs root")
def test_every_stage_is_said_and_the_monitor_shows_it_ticking(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The log has each stage in order; ``--once --json`` during the read says ``starting``
    with the stage and its rows and bytes, ticking; the TUI shows it; the beacon answers no
    other user; a stop during the model load leaves ``not started: N left``."""
    data, rows = _dataset(tmp_path)
    out = tmp_path / "out"
    tui = Tmux([EAGLE3_TOP, "--output", str(out)])
    try:
        with runkit.reaped(runkit.start(tiny_model_dir, data, out, fault=SLOW_READ)) as proc:
            first = _poll(out, _reading, proc)
            assert first["state"] == "starting" and first["run_state"] == "starting", first
            assert first["source"] == "beacon" and first["level"] == "OK", first
            st = first["start"]
            assert st["bytes_total"] == data.stat().st_size and st["bytes_read"] > 0, st
            assert st["pid"] == proc.pid and "reading dataset big.jsonl" in first["reason"]
            later = _poll(out, lambda s: (s.get("start") or {}).get("rows", 0) > st["rows"], proc)
            assert later["state"] == "starting", later
            # Another user gets a refusal, and nothing of the job.
            name = paths.start_beacon_name(str(out), paths.Shard(0, 1))
            answer = wire.FrameReader().feed_messages(_as_nobody(name))
            assert len(answer) == 1 and isinstance(answer[0], wire.Error), answer
            assert "uid 65534" in answer[0].message
            # The TUI shows the start's stage, ticking.
            seen = tui.wait_screen(lambda t: re.search(r"(reading dataset|checking the space)", t))
            tick = re.search(r"for (\d+) s", seen)
            assert tick, seen
            tui.wait_screen(lambda t: f"for {int(tick.group(1)) + 2} s" in t)
            _poll(out, lambda s: s["run_state"] == "loading", proc)
            assert _stop(proc, out) == 0
    finally:
        tui.kill()
    log = runkit.log_of(out)
    stages = [
        "start: checking the model folder",
        "start: reading dataset big.jsonl",
        "start: checking the space the job needs",
        "start: reading the journal",
        "start: launching the producer (hf)",
        "loading model",
    ]
    at = [log.find(s) for s in stages]
    assert -1 not in at and at == sorted(at), (at, log[-3000:])
    assert re.search(r"start: reading dataset big\.jsonl .*: counting rows: [\d,]+ rows", log) or (
        re.search(r"start: checking the space the job needs: .* rows \(\d+ %\), \d+ s", log)
    ), log[-3000:]
    after, code = _shard(out)
    assert after["state"] == "stopped" and code == 1, after  # WARNING, as before
    assert f"not started: {rows:,} left" in after["reason"] and "resumable" in after["reason"]


def test_a_sigint_while_reading_a_new_jobs_dataset_writes_nothing(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Stopped during the read: exit 0 at once, nothing under the output (not even the
    folder, which the run makes only once its checks passed), and the monitor says so."""
    data, _ = _dataset(tmp_path)
    out = tmp_path / "out"
    with runkit.reaped(runkit.start(tiny_model_dir, data, out, fault=SLOW_READ)) as proc:
        _poll(out, _reading, proc)
        assert _stop(proc, out) == 0
    assert not out.exists() and not Path(f"{out}.dumps").exists()
    assert not Path(f"{out}.sock").exists()
    log = runkit.log_of(out)
    assert "stopped by SIGINT while reading dataset big.jsonl" in log, log[-3000:]
    r = _once(out)
    assert "no journal at" in r.stdout and "; not started" in r.stdout, r.stdout
    assert r.returncode == 3, r.stdout  # UNKNOWN, as before: there is nothing to judge


def test_a_sigint_while_a_resumed_job_reads_shows_the_new_start_then_the_truth(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A resumed job: during the new start's read the monitor shows that start (not the
    journal's last session, stopped); after a SIGINT there, the journal's words are true
    (no session was added)."""
    data, rows = _dataset(tmp_path)
    out = tmp_path / "out"
    with runkit.reaped(
        runkit.start(tiny_model_dir, data, out, "--no-space-check", fault=SLOW_READ)
    ) as proc:
        _poll(out, lambda s: s["run_state"] == "loading", proc)
        assert _stop(proc, out) == 0
    before, _ = _shard(out)
    assert before["state"] == "stopped", before
    with runkit.reaped(
        runkit.start(tiny_model_dir, data, out, "--no-space-check", fault=SLOW_READ)
    ) as proc:
        during = _poll(out, _reading, proc)
        assert during["state"] == "starting" and during["source"] == "beacon", during
        assert during["start"]["pid"] == proc.pid, during
        assert _stop(proc, out) == 0
    after, _ = _shard(out)
    assert after["state"] == "stopped" and after["source"] == "journal", after
    assert f"not started: {rows:,} left" in after["reason"], after
    assert len(runkit.records(out, "run_started")) == 1


def test_the_beacon_answers_once_and_live(tmp_path: Path) -> None:
    """The protocol monitors speak: ``once`` gets a snapshot and ``bye``; a live client
    gets a fresh snapshot each second, and ``bye`` when the beacon closes."""
    import asyncio

    from eagle3d.serve.beacon import StartBeacon

    name = paths.start_beacon_name(str(tmp_path / "o"), paths.Shard(0, 1))
    n = {"rows": 0}

    def info() -> wire.StartInfo:
        n["rows"] += 1000
        return wire.StartInfo(stage="reading dataset d.jsonl", rows=n["rows"], pid=os.getpid())

    def client(mode: str, count: int) -> list[object]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(name)
        s.sendall(wire.encode(wire.Hello(mode=mode)))
        frames, got = wire.FrameReader(), []
        while len(got) < count and (b := s.recv(65536)):
            got += frames.feed_messages(b)
        s.close()
        return got

    async def main() -> tuple[list[object], list[object]]:
        b = StartBeacon(name, info, shard=paths.Shard(0, 1), output="o", host="h", every=0.2)
        assert await b.open()
        once = await asyncio.to_thread(client, "once", 2)
        live = asyncio.create_task(asyncio.to_thread(client, "live", 1000))
        while n["rows"] < 4000:  # the live client's second snapshot was made
            await asyncio.sleep(0.05)
        await b.close()
        return once, await live

    once, live = asyncio.run(main())
    assert isinstance(once[0], wire.Snapshot) and isinstance(once[1], wire.Bye), once
    assert once[0].state.state == "starting" and once[0].start is not None
    snaps = [m for m in live if isinstance(m, wire.Snapshot)]
    assert len(snaps) >= 2 and snaps[1].start.rows > snaps[0].start.rows  # type: ignore[union-attr]
    assert isinstance(live[-1], wire.Bye) and "event socket" in live[-1].reason, live
    with pytest.raises(OSError):  # closed: the name is gone
        client("once", 1)


def test_a_shard_starting_on_a_new_output_is_found_by_its_beacon(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """No journal yet, and the daemon runs shard 1 of 2: the monitor finds that shard (from
    the kernel's list of Unix sockets), not a placeholder shard 0 of 1."""
    data, _ = _dataset(tmp_path)
    out = tmp_path / "out"
    with runkit.reaped(
        runkit.start(tiny_model_dir, data, out, "--shard", "1/2", fault=SLOW_READ)
    ) as proc:
        seen = _poll(out, _reading, proc)
        assert seen["label"] == "shard-1-of-2" and seen["source"] == "beacon", seen
        assert _stop(proc, out) == 0
    assert not out.exists()
