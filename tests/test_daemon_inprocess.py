"""The whole daemon in-process: ``Daemon(cfg).run()`` in the test's own event loop, with the
synthetic producer, the tiny model's tokenizer, a real journal and output in a temp dir, and a
real sd_notify socket the test reads.

``test_shell.py`` drives the pipeline piece by piece with a clock the test moves; this drives
the daemon as ``eagle3d run`` does (its checks, its lock, the journal's replay, the start and
the teardown in its exit stack), without a subprocess, so that a stop can be sent at each
stage of the start the moment sd_notify names it. The journal is then read by the independent
reader (``crashcheck``), as for the subprocess tests.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import runkit
from eagle3d import config
from eagle3d.exitcodes import EXIT_OK, EXIT_OUTPUT
from eagle3d.run.daemon import Daemon

ROWS = 40


@dataclass
class Notes:
    """A real ``$NOTIFY_SOCKET``: every STATUS the daemon sends, whether it sent
    ``STOPPING=1`` (only the ledger's judgement of a stop does), and a stop sent to this
    process (the daemon's loop handles SIGTERM) when a STATUS matches ``stop_at``."""

    path: Path
    stop_at: Callable[[str], bool] = lambda status: False
    statuses: list[str] = field(default_factory=list)
    stopped_at: str = ""
    stopping: bool = False

    def __post_init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        self.sock.settimeout(0.1)
        self.done = threading.Event()
        self.synced = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while not self.done.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            for line in data.decode().splitlines():
                if line.startswith("STATUS="):
                    self._status(line[len("STATUS=") :])
                self.stopping = self.stopping or line == "STOPPING=1"
                if line == "SYNC=1":
                    self.synced.set()

    def _status(self, text: str) -> None:
        self.statuses.append(text)
        if not self.stopped_at and self.stop_at(text):
            self.stopped_at = text
            os.kill(os.getpid(), signal.SIGTERM)

    def sync(self, deadline_s: float = 30.0) -> None:
        """Wait until everything sent so far is read: a datagram of its own, read after
        those before it (a Unix datagram socket keeps their order)."""
        self.synced.clear()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b"SYNC=1", str(self.path))
        assert self.synced.wait(deadline_s), "the notify socket's reader is stuck"

    def close(self) -> None:
        self.done.set()
        self.thread.join(5)
        self.sock.close()


@pytest.fixture
def notes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Notes]:
    n = Notes(tmp_path / "notify.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", str(n.path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.delenv("EAGLE3D_FAULT", raising=False)
    yield n
    n.close()


def job(model: Path, data: Path, out: Path) -> config.JobConfig:
    cfg = config.JobConfig(
        model=str(model),
        dataset=str(data),
        output=str(out),
        backend="synthetic",
        dump_dir=f"{out}.dumps",
        socket=f"{out}.sock",
        max_failed_fraction=0.5,
        concurrency=8,
    )
    cfg.validate()
    return cfg


def run_daemon(cfg: config.JobConfig) -> int:
    """One daemon, to its end, in this process; its signal handlers go with its loop."""
    return asyncio.run(Daemon(cfg).run())


def test_a_job_runs_to_its_end_in_process(
    tiny_model_dir: Path, tmp_path: Path, notes: Notes
) -> None:
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    valid, bad = runkit.dataset(data, ROWS)
    assert run_daemon(job(tiny_model_dir, data, out)) == EXIT_OK
    runkit.assert_complete(out, valid, bad)
    assert any(s.startswith("reading") for s in notes.statuses), notes.statuses
    # A second run of a finished job does nothing, and says the job is finished.
    assert run_daemon(job(tiny_model_dir, data, out)) == EXIT_OK
    assert len(runkit.records(out, "sample_saved")) == len(valid)


# Each stage of a start, as sd_notify names it (a prefix of its STATUS), and whether the
# output holds a job yet: a first run stopped before its journal is open leaves nothing.
# From the journal's replay on the ledger judges the stop: during the replay and the
# producer's launch the pipeline's pieces are not made yet, during the load they are.
STAGES = [
    ("reading dataset", False),
    ("reading the journal", True),
    ("launching the producer", True),
    ("loading", True),  # the producer's start: the synthetic one starts at once
]


@pytest.mark.parametrize(("stage", "resumed"), STAGES)
def test_a_stop_at_each_stage_of_a_start_ends_cleanly_and_resumes_exactly_once(
    tiny_model_dir: Path, tmp_path: Path, notes: Notes, stage: str, resumed: bool
) -> None:
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    valid, bad = runkit.dataset(data, ROWS)
    notes.stop_at = lambda status: (
        status.lower().startswith(stage)
        or (stage == "loading" and status.lower().startswith("starting"))
    )
    code = run_daemon(job(tiny_model_dir, data, out))
    if not notes.stopped_at:  # the stage passed before its STATUS was read: not this case
        pytest.skip(f"no STATUS {stage!r} seen: {notes.statuses}")
    assert code == EXIT_OK, notes.statuses
    # STOPPING=1 is the ledger's: a stop judged by it, not one that ended the start before it
    notes.sync()
    assert notes.stopping == resumed, notes.statuses
    if not resumed:  # stopped before anything was written: the output is not there
        assert not out.exists(), sorted(str(p) for p in out.rglob("*"))
    else:
        c = runkit.check(out)
        assert not c.bad and not c.leftovers and c.temp_files == 0, c
        assert not c.finished, notes.statuses
        if stage == "reading the journal":  # before the producer's start: nothing sent
            assert runkit.records(out, "sample_sent") == []
    notes.stop_at = lambda status: False
    assert run_daemon(job(tiny_model_dir, data, out)) == EXIT_OK
    runkit.assert_complete(out, valid, bad)


def test_the_output_moved_away_mid_run_stops_the_daemon(
    tiny_model_dir: Path, tmp_path: Path, notes: Notes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The output renamed under a running daemon: exit 4, and the journal never says
    finished (the moved output keeps what was saved)."""
    # Batches of 4 requests every 20 ms: the run lasts a second or two, not milliseconds.
    monkeypatch.setenv("EAGLE3D_SYNTHETIC_LATENCY_S", "0.02")
    monkeypatch.setenv("EAGLE3D_SYNTHETIC_BATCH", "4")
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    runkit.dataset(data, 300, malformed=False)
    moved = tmp_path / "moved"
    mover = threading.Thread(target=move_when_saved, args=(out, moved, 10), daemon=True)
    mover.start()
    code = run_daemon(job(tiny_model_dir, data, out))
    mover.join(30)
    assert moved.exists(), notes.statuses
    assert code == EXIT_OUTPUT, notes.statuses
    saved = runkit.records(moved, "sample_saved")
    assert 10 <= len(saved) < 300 and not runkit.check(moved).finished


def move_when_saved(out: Path, to: Path, n: int, deadline_s: float = 60.0) -> None:
    """Rename ``out`` to ``to`` once its journal holds ``n`` saved samples."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            if len(runkit.records(out, "sample_saved")) >= n:
                out.rename(to)
                return
        except Exception:  # the journal is being written: read it again next time
            pass
        time.sleep(0.01)
