"""The HF worker as a process: how it ends, and the malloc settings it starts with.

A worker stopped mid-run finishes what it started and exits 0 with a silent stderr; a worker
whose daemon disappeared (kill -9) exits at its next report with one line, not a traceback.
Neither may end in a C++ abort ("terminate called without an active exception", SIGABRT),
which interpreter teardown beside torch's native threads used to produce.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from eagle3proto.codec import encode_frame
from eagle3proto.wire import FrameBuffer
from runkit import thread_names

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(dict[str, Any])


def _spawn(model: Path, dumps: Path, fault: str = "", **extra: str) -> subprocess.Popen[bytes]:
    dumps.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "EAGLE3D_FAULT"}
    env.update(extra)
    if fault:
        env["EAGLE3D_FAULT"] = fault
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eagle3d.remote.hf_worker",
            "--model",
            str(model),
            "--dump-dir",
            str(dumps),
            "--batch-tokens",
            "256",
            "--aux-layers",
            "1,2,3",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )


def _messages(proc: subprocess.Popen[bytes]) -> Iterator[dict[str, Any]]:
    assert proc.stdout is not None
    frames = FrameBuffer()
    while chunk := os.read(proc.stdout.fileno(), 1 << 16):
        for payload in frames.feed(chunk):
            yield _dec.decode(payload)


def _request(proc: subprocess.Popen[bytes], n: int) -> None:
    assert proc.stdin is not None
    reqs = [
        {"op": "req", "rid": f"r{i}", "ids": [(7 * i + k) % 900 + 1 for k in range(60)]}
        for i in range(n)
    ]
    proc.stdin.write(b"".join(encode_frame(_enc.encode(r)) for r in reqs))
    proc.stdin.flush()


def _ended(proc: subprocess.Popen[bytes]) -> tuple[int, str]:
    """Exit code and stderr; no traceback and no C++ abort may be in it."""
    code = proc.wait(timeout=60)
    assert proc.stderr is not None
    err = proc.stderr.read().decode(errors="replace")
    assert "Traceback" not in err and "terminate called" not in err, err
    return code, err


def _ready(
    model: Path, dumps: Path, fault: str = ""
) -> tuple[subprocess.Popen[bytes], Iterator[dict[str, Any]]]:
    proc = _spawn(model, dumps, fault)
    msgs = _messages(proc)
    assert next(msgs)["op"] == "ready"
    return proc, msgs


def test_the_worker_keeps_freed_activations_mapped_unless_the_operator_chose(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """glibc's mallopt applied in the worker (the benchmark measures what it saves), and an
    operator's own MALLOC_* setting left alone."""
    for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(k, raising=False)  # the test's own environment must not decide
    cases: list[tuple[str, dict[str, str], str]] = [
        ("tuned", {}, "mmap threshold 32 MiB, trim threshold 1 GiB"),
        ("operator", {"MALLOC_TRIM_THRESHOLD_": "131072"}, "MALLOC_* set by the operator"),
    ]
    for name, extra, want in cases:
        proc = _spawn(tiny_model_dir, tmp_path / name, **extra)
        ready = next(_messages(proc))
        assert proc.stdin is not None
        proc.stdin.close()
        assert ready["op"] == "ready" and ready["malloc"] == want, ready
        assert _ended(proc)[0] == 0


def test_stop_mid_run_finishes_the_batch_and_exits_quietly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # A 100 ms rest after each batch: the stop surely lands before the last of ten batches.
    proc, msgs = _ready(tiny_model_dir, tmp_path / "dumps", fault="worker_slow:100")
    try:
        _request(proc, 40)  # 40 x 60 tokens at 256 per batch: ten batches to go
        first = next(m for m in msgs if m["op"] == "done")  # after its batch's "start"
        assert proc.stdin is not None
        proc.stdin.write(encode_frame(_enc.encode({"op": "stop"})))
        proc.stdin.close()
        done = list(first["rids"]) + [r for m in msgs if m["op"] == "done" for r in m["rids"]]
        code, err = _ended(proc)
    finally:
        proc.kill()
    assert code == 0, err
    assert 0 < len(done) < 40  # stopped mid-run
    written = {p.name.removesuffix(".e3dump") for p in (tmp_path / "dumps").iterdir()}
    assert written == set(done)  # every reported dump is there, nothing half-written


def test_a_vanished_daemon_ends_the_worker_with_one_line(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    proc, _ = _ready(tiny_model_dir, tmp_path / "dumps")
    try:
        assert proc.stdout is not None
        proc.stdout.close()  # the daemon is gone: its end of the report pipe closes
        _request(proc, 4)  # the first batch's report meets the closed pipe
        code, err = _ended(proc)
    finally:
        proc.kill()
    assert code == 1, err
    assert "the daemon closed its end of the pipe" in err, err


def test_written_follows_each_batch_once_its_dumps_are_in_the_dump_area(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    dumps = tmp_path / "dumps"
    proc, msgs = _ready(tiny_model_dir, dumps)
    try:
        _request(proc, 6)
        written: set[str] = set()
        done: set[str] = set()
        for m in msgs:
            if m["op"] == "done":
                done.update(m["rids"])
            elif m["op"] == "written":
                for rid in m["rids"]:
                    assert rid in done  # after the forward, never before
                    assert (dumps / f"{rid}.e3dump").exists()  # and the file is there
                written.update(m["rids"])
            if len(written) == 6:
                break
        assert written == {f"r{i}" for i in range(6)}
        # Its threads carry their roles where top -H and ps -L look (eagle3d.remote.threadnames).
        names = thread_names(proc.pid)
        assert {"reader", "dump-writer"} <= names, names
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        _ended(proc)


def test_a_dump_that_cannot_be_written_is_reported_failed_and_the_worker_goes_on(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A dump area that refuses the write (here: a file where a dump's temp name goes) costs
    that request a 'fail' report, not the writer thread: later requests are still dumped."""
    dumps = tmp_path / "dumps"
    proc, msgs = _ready(tiny_model_dir, dumps)
    (dumps / ".r0.e3dump.tmp").mkdir()  # open(O_WRONLY) on a directory: EISDIR
    try:
        _request(proc, 3)
        failed, written = [], set()
        for m in msgs:
            if m["op"] == "fail":
                failed.append(m)
            elif m["op"] == "written":
                written.update(m["rids"])
            if failed and {"r1", "r2"} <= written:
                break
        assert [f["rid"] for f in failed] == ["r0"]
        assert failed[0]["error"] == "DumpWriteError" and "EISDIR" in failed[0]["message"]
        assert (dumps / "r1.e3dump").exists() and (dumps / "r2.e3dump").exists()
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        _ended(proc)


def test_give_hands_back_what_has_not_started_even_mid_batch(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A "give" is answered while a batch runs: the requests still waiting come back in
    "given" and are never computed here; one already running is not given."""
    # 300 ms rest after each batch: the give lands while batch two or three is pending.
    proc, msgs = _ready(tiny_model_dir, tmp_path / "dumps", fault="worker_slow:300")
    try:
        _request(proc, 20)  # 20 x 60 tokens at 256 per batch: five batches
        first = next(m for m in msgs if m["op"] == "start")
        assert proc.stdin is not None
        want = [f"r{i}" for i in range(19, 9, -1)] + list(first["rids"])
        proc.stdin.write(encode_frame(_enc.encode({"op": "give", "rids": want})))
        proc.stdin.flush()
        started, done, given = set(first["rids"]), set(), None
        for m in msgs:
            if m["op"] == "start":
                started.update(m["rids"])
            elif m["op"] == "done":
                done.update(m["rids"])
            elif m["op"] == "given":
                given = list(m["rids"])
            if given is not None and len(done) + len(given) == 20:
                break
        assert given is not None and set(given).isdisjoint(started)
        assert not set(first["rids"]) & set(given)  # running: not given
        assert set(given) == {f"r{i}" for i in range(10, 20)} - started
        assert len(given) >= 5  # most of the newest ten had not started
        assert done == {f"r{i}" for i in range(20)} - set(given)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        _ended(proc)


def test_a_batch_is_marked_for_its_written_report_only_after_its_done_is_sent(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon counts a batch's dumps as owed from its "done": a "written" ahead of it
    (the writer thread is quick on a CPU device) would leave them owed, and a worker lost
    later would fail dumps already saved. In process, with the worker's own ``forward``:
    the writer's "written" marker enters its queue only once "done" has gone out."""
    import argparse
    import queue

    from eagle3d.remote import hf_worker

    sent: list[object] = []
    monkeypatch.setattr(hf_worker, "send", sent.append)
    worker = hf_worker.Worker(
        argparse.Namespace(
            model=str(tiny_model_dir),
            dump_dir=str(tmp_path),
            batch_tokens=256,
            aux_layers=[1, 2, 3],
            device="cpu",
            dtype="auto",
            store_dtype="",
        )
    )
    dones_at_marker: list[int] = []

    class Recording(queue.Queue[tuple[Any, ...] | None]):
        def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
            if item is not None and item[0] is hf_worker._WRITTEN:
                dones_at_marker.append(sum(type(m).__name__ == "Done" for m in sent))
            super().put(item, block, timeout)

    worker.writes = Recording()
    worker.forward(["r0", "r1"], [[5, 6, 7], [8, 9]])
    worker.forward(["r2"], [[4, 4, 4, 4]])
    assert dones_at_marker == [1, 2]
    assert worker.writes.qsize() == 2 + 1 + 1 + 1  # three dumps, two markers
