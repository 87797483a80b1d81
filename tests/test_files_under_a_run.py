"""Nothing mixed, burnt or exposed when files change under a run (issue 26): each situation
with the real daemon on real files and processes.

1. the dataset rewritten in place during a run (same inode);
2. the dataset truncated during a run;
3. a row folder removed during a run;
4. a row folder that is a symlink;
5. the shard lock, the journal and the sample files against another local user;
6. the clock stepped while the daemon is frozen;
7. a worker's allocation failing;
8. a line too long to hold;
9. invalid UTF-8, first line or later;
10. a refused start.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import runkit
from eagle3proto import events as ev
from eagle3proto import paths, views
from eagle3proto.journal import JournalWriter

#: Slow enough (a 50 ms rest after every batch) that a change lands while the run goes on.
SLOW = "worker_slow:50"


def _lines(n: int, seed: int) -> list[str]:
    return [json.dumps(r) for r in runkit.conversations(n, seed=seed)]


def _write(path: Path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _rewrite_in_place(path: Path, data: bytes) -> None:
    """What ``cat other > data`` does: the same inode, truncated, then written."""
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(data)


def _saved_match(out: Path, model: Path, lines: list[str]) -> list[int]:
    """Saved samples whose token ids are not those of their line in ``lines``."""
    from eagle3d.ingest.chat import ChatEncoder
    from eagle3d.ingest.dataformats import parse_row
    from eagle3d.reader import load_sample
    from transformers import AutoTokenizer

    enc = ChatEncoder(AutoTokenizer.from_pretrained(str(model)), max_length=2048)
    wrong = []
    for r in runkit.records(out, "sample_saved"):
        idx = r["idx"]
        want = list(enc.encode(parse_row(idx, lines[idx].encode())).input_ids)
        got = load_sample(out / r["path"])["input_ids"].tolist()
        if got != want:
            wrong.append(idx)
    return wrong


def _finished(out: Path) -> bool:
    return bool(runkit.records(out, "run_finished"))


# -- 1 and 2. the dataset pinned for the life of a run ------------------------------------------


@pytest.mark.parametrize("change", ["rewritten", "truncated"])
def test_a_dataset_changed_under_a_run_stops_it_unmixed(
    tiny_model_dir: Path, tmp_path: Path, change: str
) -> None:
    data, out, log = tmp_path / "data.jsonl", tmp_path / "out", tmp_path / "log"
    old = _lines(300, seed=0)
    _write(data, old)
    before = data.read_bytes()
    proc = runkit.start(tiny_model_dir, data, out, "--concurrency", "4", fault=SLOW, log=log)
    with runkit.reaped(proc):
        runkit.wait_for(lambda: len(runkit.records(out, "sample_saved")) >= 5, 120, "5 saves")
        if change == "rewritten":  # the new file: a line more at the top, ids shifted
            _rewrite_in_place(data, ("\n".join(_lines(1, seed=7) + old) + "\n").encode())
        else:  # cut in the middle of a line
            cut = before.index(b"\n", len(before) // 2) - 20
            os.truncate(data, cut)
        rc = runkit.exit_code(proc, 120, log)
    text = log.read_text()
    assert rc == 6, text[-3000:]
    assert str(data) in text and "changed during the run" in text, text[-3000:]
    assert not _finished(out)
    stopped = runkit.records(out, "run_stopped")
    assert stopped and stopped[-1]["exit_code"] == 6, stopped
    assert not runkit.records(out, "sample_failed"), runkit.records(out, "sample_failed")
    assert not _saved_match(out, tiny_model_dir, old)
    c = runkit.check(out)
    assert not c.bad and not c.finished and len(c.saved) < len(old), c.bad
    # The changed file is another job: refused. Restored, the same command completes.
    r = runkit.run(tiny_model_dir, data, out)
    assert r.returncode == 6, r.stderr[-2000:]
    data.write_bytes(before)
    r = runkit.run(tiny_model_dir, data, out)
    assert r.returncode == 0, r.stderr[-3000:]
    runkit.assert_complete(out, set(range(len(old))), set())
    assert not _saved_match(out, tiny_model_dir, old)


def test_a_line_an_older_version_failed_on_a_short_file_is_retried(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """What an older eagle3d recorded for a line cut by a truncation: ``bad JSON: Input data
    was truncated``, for good. A version that pins the dataset retries such a record once;
    a line that is really bad fails again and stays failed."""
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    lines = _lines(20, seed=3)
    lines[15] = lines[15][:30]  # really cut: fails again
    _write(data, lines)
    jdir = paths.journal_dir(str(out), paths.Shard())
    r = runkit.run(tiny_model_dir, data, out, "--max-failed-fraction", "0.5")
    assert r.returncode == 0, r.stderr[-3000:]
    assert {x["idx"] for x in runkit.records(out, "sample_failed")} == {15}
    # A session of an older version (its run_started has no pin) that took line 7 as cut
    # short, and line 15 as well.
    last = [e for e in runkit.events(out) if isinstance(e, ev.RunStarted)][-1]
    with JournalWriter(jdir) as j:
        j.open()
        j.append(ev.RunStarted(job=last.job, total=last.total, session=last.session + 1))
        j.append(ev.SampleInvalid(idx=7, reason="test: made pending"))
        for idx in (7, 15):
            cut = "bad JSON: Input data was truncated"
            j.append(ev.SampleFailed(idx=idx, error="bad_json", message=cut, attempt=0))
        j.append(ev.RunFinished(saved=18, failed=2, exit_code=0))
    r = runkit.run(tiny_model_dir, data, out, "--max-failed-fraction", "0.5")
    assert r.returncode == 0, r.stderr[-3000:]
    reopened = [x for x in runkit.records(out, "sample_failed") if "retried" in x["message"]]
    assert {x["idx"] for x in reopened} == {7, 15}
    runkit.assert_complete(out, set(range(20)) - {15}, {15})
    # Recorded again by a version that pins the dataset: a third run retries nothing.
    r = runkit.run(tiny_model_dir, data, out, "--max-failed-fraction", "0.5")
    assert r.returncode == 0 and "nothing to do" in r.stderr, r.stderr[-2000:]


# -- 3 and 4. row folders ----------------------------------------------------------------------


def _once(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "eagle3top.cli", "--once", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("how", ["removed", "symlinked"])
def test_a_row_folder_removed_or_linked_under_a_run_stops_it(
    tiny_model_dir: Path, tmp_path: Path, how: str
) -> None:
    data, out, log = tmp_path / "data.jsonl", tmp_path / "out", tmp_path / "log"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    lines = _lines(300, seed=2)
    _write(data, lines)
    rows = out / "rows_0-2000"
    proc = runkit.start(tiny_model_dir, data, out, "--concurrency", "4", fault=SLOW, log=log)
    with runkit.reaped(proc):
        runkit.wait_for(lambda: len(runkit.records(out, "sample_saved")) >= 5, 120, "5 saves")
        # rm -rf, atomically (a tree walk races with the commits): out of the way, then gone.
        os.rename(rows, tmp_path / "gone")
        shutil.rmtree(tmp_path / "gone", ignore_errors=True)
        if how == "symlinked":
            rows.symlink_to(elsewhere, target_is_directory=True)
        rc = runkit.exit_code(proc, 120, log)
    text = log.read_text()
    assert rc == 4, text[-3000:]
    assert f"the row folder {rows} was" in text, text[-3000:]
    assert not _finished(out)
    assert list(elsewhere.iterdir()) == []  # nothing written through the link
    top = _once(out)
    assert top.returncode != 0 and "FINISHED" not in top.stdout, top.stdout
    # Missing files are found by verify --repair; then the same command redoes them.
    if how == "symlinked":
        rows.unlink()
    r = runkit.run(tiny_model_dir, data, out)
    assert r.returncode == 4 and "verify --repair" in r.stderr, r.stderr[-2000:]
    rep = subprocess.run(
        [sys.executable, "-m", "eagle3d", "verify", "--output", str(out), "--repair"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rep.returncode == 1, rep.stdout + rep.stderr
    r = runkit.run(tiny_model_dir, data, out)
    assert r.returncode == 0, r.stderr[-3000:]
    runkit.assert_complete(out, set(range(len(lines))), set())


def test_a_row_folder_that_is_a_link_is_never_written_through(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _write(data, _lines(10, seed=4))
    out.mkdir()
    (out / "rows_0-2000").symlink_to(elsewhere, target_is_directory=True)
    r = runkit.run(tiny_model_dir, data, out)
    assert r.returncode == 4, r.stderr[-3000:]
    assert f"the row folder {out / 'rows_0-2000'} is a symbolic link" in r.stderr
    assert list(elsewhere.iterdir()) == []
    assert not runkit.records(out, "run_finished")


# -- 5. a job's files are its owner's -----------------------------------------------------------

OTHER = "e3d-other"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (useradd, runuser)")


@pytest.fixture(scope="module")
def other_user() -> str:
    """A real second local user (made if missing)."""
    import pwd

    try:
        pwd.getpwnam(OTHER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER],
            check=True,
        )
    return OTHER


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder another user can reach (pytest's own is its owner's alone)."""
    base = Path(tempfile.mkdtemp(prefix="e3d-i26-", dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _as(user: str, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by ``user`` (runuser: a real second user, no capabilities)."""
    return subprocess.run(
        ["runuser", "-u", user, "--", "/usr/bin/python3", "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


_TRY_OPEN = """
import os, sys
for p in sys.argv[1:]:
    try:
        fd = os.open(p, os.O_RDONLY)
        os.close(fd)
        print("OPENED", p)
    except PermissionError:
        print("DENIED", p)
"""


@needs_root
def test_a_jobs_files_give_nothing_to_another_user(
    tiny_model_dir: Path, shared_dir: Path, other_user: str
) -> None:
    data, out = shared_dir / "data.jsonl", shared_dir / "out"
    _write(data, _lines(6, seed=5))
    os.chmod(data, 0o644)
    r = runkit.run(tiny_model_dir, data, out)
    assert r.returncode == 0, r.stderr[-2000:]
    lock = Path(paths.lock_path(str(out), paths.Shard()))
    jdir = Path(paths.journal_dir(str(out), paths.Shard()))
    segment = sorted(jdir.glob("*.e3j"))[0]
    sample = out / runkit.records(out, "sample_saved")[0]["path"]
    rows = sample.parent
    ckpt, capture = jdir / "checkpoint.e3c", out / ".eagle3d" / "capture.json"
    staging = Path(paths.staging_dir(str(out), paths.Shard()))
    files = (lock, segment, sample, rows, jdir, ckpt, capture, staging, staging.parent)
    modes = {p: p.stat().st_mode & 0o777 for p in files}
    assert modes == {
        lock: 0o600,
        segment: 0o640,
        sample: 0o640,
        rows: 0o750,
        jdir: 0o750,
        ckpt: 0o640,
        capture: 0o640,
        staging: 0o750,
        staging.parent: 0o750,
    }
    seen = _as(other_user, _TRY_OPEN, *(str(p) for p in (lock, segment, sample, rows)))
    denied = [ln for ln in seen.stdout.splitlines() if ln.startswith("DENIED")]
    assert len(denied) == 4, seen.stdout + seen.stderr


_HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
print(os.getpid(), flush=True)
time.sleep(600)
"""


@needs_root
def test_a_lock_held_by_another_users_process_is_no_live_daemon(
    tiny_model_dir: Path, shared_dir: Path, other_user: str
) -> None:
    """The daemon killed; its lock file as an older version left it (0644); another user
    takes an flock on it. The monitor must not call that a running daemon, and the next run
    names the real holder."""
    data, out, log = shared_dir / "data.jsonl", shared_dir / "out", shared_dir / "log"
    _write(data, _lines(200, seed=6))
    proc = runkit.start(tiny_model_dir, data, out, "--concurrency", "4", fault=SLOW, log=log)
    with runkit.reaped(proc):
        runkit.wait_for(lambda: len(runkit.records(out, "sample_saved")) >= 3, 120, "3 saves")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    lock = paths.lock_path(str(out), paths.Shard())
    for p in (shared_dir, out, Path(lock).parent):
        os.chmod(p, 0o755)
    os.chmod(lock, 0o644)  # as an older eagle3d made it
    holder = subprocess.Popen(
        ["runuser", "-u", other_user, "--", "/usr/bin/python3", "-c", _HOLD, lock],
        stdout=subprocess.PIPE,
        text=True,
    )
    pid = 0
    try:
        assert holder.stdout is not None
        pid = int(holder.stdout.readline())  # runuser's child: the process holding it
        top = _once(out)
        assert top.returncode != 0 and "OK" not in top.stdout.split("\n")[0], top.stdout
        assert f"held by pid {pid}" in top.stdout, top.stdout
        r = runkit.run(tiny_model_dir, data, out)
        assert r.returncode == 5, r.stderr[-2000:]
        assert f"held by pid {pid}" in r.stderr, r.stderr[-2000:]
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
        holder.kill()
        holder.wait()
    r = runkit.run(tiny_model_dir, data, out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert os.stat(lock).st_mode & 0o777 == 0o600
    runkit.assert_complete(out, set(range(200)), set())


# -- 6. time --------------------------------------------------------------------------------------

LIBFAKETIME = next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))), None)
needs_faketime = pytest.mark.skipif(
    LIBFAKETIME is None, reason="needs libfaketime (apt-get install faketime)"
)


def _monitor(out: Path, offset: str = "") -> dict[str, Any]:
    """``eagle3-top --once --json``'s shard, the monitor's own wall clock ``offset`` off
    (libfaketime; its boot clock true: ``FAKETIME_DONT_FAKE_MONOTONIC``)."""
    env = dict(os.environ)
    if offset:
        env.update(LD_PRELOAD=str(LIBFAKETIME), FAKETIME=offset, FAKETIME_DONT_FAKE_MONOTONIC="1")
    once = [sys.executable, "-m", "eagle3top.cli", "--once", "--json", "--output", str(out)]
    r = subprocess.run(once, capture_output=True, text=True, timeout=60, env=env)
    assert r.stdout, r.stderr[-2000:]
    shard: dict[str, Any] = json.loads(r.stdout)["shards"][0]
    return shard


def _offset_file(tmp_path: Path, seconds: float) -> Path:
    f = tmp_path / "wall-offset"
    f.write_text(f"{seconds}\n")
    return f


@needs_faketime
@pytest.mark.parametrize("whose", ["daemon", "monitor"])
def test_a_clock_set_back_never_hides_a_frozen_daemon(
    tiny_model_dir: Path, tmp_path: Path, whose: str
) -> None:
    """A wall clock 1 h back, the daemon's (its records' ``ts``, the daemon's own seam) or
    the monitor's (libfaketime): the running daemon is OK (before: ``stalled``, no record
    for an hour; or UNKNOWN, the clock set back), then frozen (SIGSTOP, its whole group) it
    turns ``stalled`` within the silence threshold: the ages are boot-clock differences."""
    data, out, log = tmp_path / "data.jsonl", tmp_path / "out", tmp_path / "log"
    _write(data, _lines(300, seed=11))
    fault = SLOW
    if whose == "daemon":
        fault += f",wall_offset:{_offset_file(tmp_path, -3600)}"
    monitor = "-1h" if whose == "monitor" else ""
    proc = runkit.start(tiny_model_dir, data, out, "--concurrency", "4", fault=fault, log=log)
    with runkit.reaped(proc):
        runkit.wait_for(lambda: len(runkit.records(out, "sample_saved")) >= 3, 120, "3 saves")
        live = _monitor(out, monitor)
        assert (live["state"], live["level"]) == ("running", "OK"), live
        assert live["age_s"] is not None and 0 <= live["age_s"] < views.SILENT_AFTER_S, live
        os.killpg(proc.pid, signal.SIGSTOP)
        try:
            frozen = [live]
            deadline = time.monotonic() + views.SILENT_AFTER_S + 60
            while frozen[-1]["state"] != "stalled" and time.monotonic() < deadline:
                time.sleep(2)
                frozen.append(_monitor(out, monitor))
            assert frozen[-1]["state"] == "stalled", frozen[-1]
            assert frozen[-1]["level"] == "WARNING", frozen[-1]
            assert "no record for" in frozen[-1]["reason"], frozen[-1]
            assert all(f["level"] in ("OK", "WARNING") for f in frozen), frozen
        finally:
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_clock_stepped_under_a_running_daemon_moves_neither_rate_nor_eta(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The daemon's wall clock 2 h back from its start: the rate the monitor shows is the
    rate the test measures itself (saved over its own monotonic seconds), not 0; then
    stepped 3 h forward mid-run: the ETA stays of the order of remaining / that rate (before:
    0 or an hour-sized ETA for a two-minute remainder)."""
    data, out, log = tmp_path / "data.jsonl", tmp_path / "out", tmp_path / "log"
    _write(data, _lines(600, seed=12))
    offset = _offset_file(tmp_path, -7200)
    fault = f"{SLOW},wall_offset:{offset}"
    proc = runkit.start(tiny_model_dir, data, out, "--concurrency", "4", fault=fault, log=log)
    with runkit.reaped(proc):
        runkit.wait_for(lambda: len(runkit.records(out, "sample_saved")) >= 20, 180, "20 saves")

        def measured(first: dict[str, Any]) -> tuple[float, dict[str, Any]]:
            t0, s0 = time.monotonic(), first["saved"]
            runkit.wait_for(
                lambda: len(runkit.records(out, "sample_saved")) >= s0 + 40, 180, "40 more"
            )
            last = _monitor(out)
            return (last["saved"] - s0) / (time.monotonic() - t0), last

        true_rate, back = measured(_monitor(out))
        assert back["state"] == "running", back
        assert back["rate_samples_s"] > 0, back
        assert true_rate / 3 < back["rate_samples_s"] < true_rate * 3, (true_rate, back)
        offset.write_text(f"{3 * 3600 - 7200}\n")  # stepped 3 h forward
        stepped = [e.ts for e in runkit.events(out)]
        runkit.wait_for(
            lambda: max(e.ts for e in runkit.events(out)) > max(stepped) + 3 * 3600 - 60,
            30,
            "a record after the step",
            step=0.5,
        )
        true_rate, ahead = measured(_monitor(out))
        assert ahead["state"] == "running" and ahead["level"] == "OK", ahead
        assert ahead["remaining"] > 0 and ahead["eta_s"] is not None, ahead
        want = ahead["remaining"] / true_rate
        assert want / 3 < ahead["eta_s"] < want * 3, (want, ahead)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


# -- 7. a worker's memory is not a sample's fault ---------------------------------------------


def test_a_workers_allocation_failure_charges_no_sample(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``worker_oom:700``: a forward of more than 700 tokens makes a real allocation that
    fails (MemoryError). With --max-attempts 1 nothing may be burnt: the worker splits the
    batch; only a line that does not fit even alone (line 7, made long) fails, with
    ``OutOfMemory``."""
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    rows = runkit.conversations(40, seed=10)
    rows[6] = {
        "messages": [
            {"role": "user", "content": "alpha beta " * 200},
            {"role": "assistant", "content": "ok"},
        ]
    }
    runkit.write_jsonl(data, rows)
    r = runkit.run(
        tiny_model_dir,
        data,
        out,
        "--max-attempts",
        "1",
        "--batch-tokens",
        "2048",
        fault="worker_oom:700",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    failed = runkit.records(out, "sample_failed")
    assert [(x["idx"], x["error"]) for x in failed] == [(6, "OutOfMemory")], failed
    assert "out of memory with this sample alone" in failed[0]["message"]
    runkit.assert_complete(out, set(range(40)) - {6}, {6})


@pytest.mark.parametrize("fault", ["worker_crash", "worker_device_error"])
def test_a_worker_that_crashes_mid_batch_charges_no_sample(
    tiny_model_dir: Path, tmp_path: Path, fault: str
) -> None:
    """One worker dies in the middle of its 2nd forward: exits with code 1 (a crash), or
    raises a device error (``CUDA error: device-side assert triggered``, after which the
    worker exits 1). With --max-attempts 1 nothing may be burnt: the batch's samples are
    each computed again alone, and every one is saved."""
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    rows = runkit.conversations(40, seed=12)
    runkit.write_jsonl(data, rows)
    marker = tmp_path / "fired"
    r = runkit.run(
        tiny_model_dir,
        data,
        out,
        "--max-attempts",
        "1",
        "--workers",
        "1",
        "--batch-tokens",
        "2048",
        fault=f"{fault}:2@{marker}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert marker.exists()  # the fault fired
    crashed = runkit.records(out, "sample_failed")
    assert len(crashed) > 1 and all(x["error"] == "ProducerCrashed" for x in crashed), crashed
    assert all(x["retry"] and x.get("environment") for x in crashed), crashed
    alone = [x for x in crashed if "computing a batch of" in x["message"]]
    assert alone and all("each is sent again alone" in x["message"] for x in alone), crashed
    if fault == "worker_device_error":
        assert "CUDA error: device-side assert triggered" in r.stderr
    runkit.assert_complete(out, set(range(40)), set())


def test_a_sample_that_crashes_its_worker_every_time_fails_alone(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``worker_crash_over:600``: every forward holding a sample of more than 600 tokens
    exits 1 (line 7, made long). Its batch's others are charged nothing; computed alone, it
    crashes the worker again and that attempt is its own: failed for good, named."""
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    rows = runkit.conversations(40, seed=13)
    rows[6] = {
        "messages": [
            {"role": "user", "content": "alpha beta " * 200},
            {"role": "assistant", "content": "ok"},
        ]
    }
    runkit.write_jsonl(data, rows)
    r = runkit.run(
        tiny_model_dir,
        data,
        out,
        "--max-attempts",
        "1",
        "--workers",
        "1",
        "--batch-tokens",
        "2048",
        "--max-failed-fraction",
        "0.1",
        fault="worker_crash_over:600",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    final = [x for x in runkit.records(out, "sample_failed") if not x.get("retry")]
    assert [(x["idx"], x["error"]) for x in final] == [(6, "ProducerCrashed")], final
    assert "exited with code 1, computing this sample alone" in final[0]["message"], final
    runkit.assert_complete(out, set(range(40)) - {6}, {6})


# -- 8 and 9. bounded input -----------------------------------------------------------------------


def test_a_line_too_long_to_hold_fails_alone_under_a_real_memory_limit(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A 200 MB line (a valid conversation) among 20, the daemon under a 4 GiB address-space
    limit (RLIMIT_AS, inherited by its workers): the line fails alone, named, with the
    default --max-line-bytes; every other line is saved; the run ends by itself."""
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    lines = _lines(20, seed=8)
    huge = json.dumps(
        {
            "messages": [
                {"role": "user", "content": "word " * 40_000_000},
                {"role": "assistant", "content": "ok"},
            ]
        }
    )
    assert len(huge) > 200_000_000
    lines[4] = huge
    _write(data, lines)
    del huge, lines
    cmd = ["prlimit", f"--as={4 << 30}", "--", *runkit.run_args(tiny_model_dir, data, out)]
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=runkit.env_without_faults()
    )
    assert r.returncode == 0, r.stderr[-3000:]
    failed = runkit.records(out, "sample_failed")
    assert [(x["idx"], x["error"]) for x in failed] == [(4, "line_too_long")], failed
    assert "line 5 (sample 4): the line is 2" in failed[0]["message"], failed[0]
    assert "line 5 (sample 4)" in r.stderr
    runkit.assert_complete(out, set(range(20)) - {4}, {4})


def _chats(n: int, seed: int) -> list[dict[str, object]]:
    """``n`` small conversations, all in the ``messages`` form (one parquet schema)."""
    import random

    rng = random.Random(seed)
    words = ("alpha", "beta", "gamma", "delta", "answer", "question")
    return [
        {
            "messages": [
                {"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(3, 30)))},
                {
                    "role": "assistant",
                    "content": " ".join(rng.choices(words, k=rng.randint(3, 30))),
                },
            ]
        }
        for _ in range(n)
    ]


def test_a_huge_message_is_cut_before_it_is_tokenized(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A 30 MB answer on a line under --max-line-bytes, ``--max-length 256``, the daemon
    under a 4 GiB address-space limit: the sample is saved with 256 tokens, its text cut
    before tokenizing (256 x 64 characters and a margin), and its record says that the
    original length is an estimate (``original_estimated``)."""
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    rows = _chats(10, seed=14)
    rows[3] = {
        "messages": [
            {"role": "user", "content": "say it"},
            {"role": "assistant", "content": "word " * 6_000_000},
        ]
    }
    runkit.write_jsonl(data, rows)
    assert 30_000_000 < data.stat().st_size < 64 << 20
    args = runkit.run_args(tiny_model_dir, data, out, "--max-length", "256")
    cmd = ["prlimit", f"--as={4 << 30}", "--", *args]
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=runkit.env_without_faults()
    )
    assert r.returncode == 0, r.stderr[-3000:]
    saved = {x["idx"]: x for x in runkit.records(out, "sample_saved")}
    big = saved[3]
    assert big["tokens"] == 256 and big["truncated"] and big.get("original_estimated"), big
    # "word " is a token or two: the estimate is of the right size (6 M words).
    assert 3_000_000 < big["original_tokens"] < 20_000_000, big
    assert not any(x.get("original_estimated") for i, x in saved.items() if i != 3)
    runkit.assert_complete(out, set(range(10)), set())


def test_a_chat_cut_before_tokenizing_keeps_the_same_ids(tiny_model_dir: Path) -> None:
    """The cut text's first ``max_length`` ids are those of the whole text's."""
    from eagle3d.ingest.chat import ChatEncoder
    from eagle3d.ingest.dataformats import parse_row
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    row = {
        "messages": [
            {"role": "user", "content": "say it"},
            {"role": "assistant", "content": "alpha beta, gamma! " * 50_000},
        ]
    }
    sample = parse_row(0, json.dumps(row).encode())
    whole = ChatEncoder(tok, max_length=0).encode(sample)
    cut = ChatEncoder(tok, max_length=64).encode(sample)
    assert cut.input_ids == whole.input_ids[:64] and cut.loss_mask == whole.loss_mask[:64]
    assert cut.truncated and cut.estimated and not whole.estimated
    assert 0.8 < cut.full_length / whole.full_length < 1.25, (cut.full_length, whole.full_length)


@pytest.mark.parametrize("fmt", ["json", "parquet"])
def test_an_oversized_item_or_row_fails_alone_by_number(
    tiny_model_dir: Path, tmp_path: Path, fmt: str
) -> None:
    """A JSON array's item, a parquet row, over --max-line-bytes: failed alone, named by
    its number (``item 4`` / ``row 4``), never decoded; every other sample saved."""
    out = tmp_path / "out"
    rows = _chats(12, seed=15)
    rows[3] = {
        "messages": [
            {"role": "user", "content": "word " * 60_000},
            {"role": "assistant", "content": "ok"},
        ]
    }
    if fmt == "json":
        data = tmp_path / "data.json"
        data.write_text(json.dumps(rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        data = tmp_path / "data.parquet"
        pq.write_table(pa.Table.from_pylist(rows), data)
    r = runkit.run(tiny_model_dir, data, out, "--max-line-bytes", "100000")
    assert r.returncode == 0, r.stderr[-3000:]
    unit = {"json": "item", "parquet": "row"}[fmt]
    failed = runkit.records(out, "sample_failed")
    assert [(x["idx"], x["error"]) for x in failed] == [(3, f"{unit}_too_long")], failed
    assert f"{unit} 4 (sample 3): the {unit} is 3" in failed[0]["message"], failed[0]
    runkit.assert_complete(out, set(range(12)) - {3}, {3})


def test_invalid_utf8_is_a_per_line_failure_wherever_it_is(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    lines = [ln.encode() for ln in _lines(20, seed=9)]
    for i in (1, 14):  # line 2, as early as the format's look at the head; and line 15
        lines[i] = lines[i].replace(b"answer", b"answ\xe9r", 1)
    data.write_bytes(b"\n".join(lines) + b"\n")
    r = runkit.run(tiny_model_dir, data, out, "--max-failed-fraction", "0.2")
    assert r.returncode == 0, r.stderr[-3000:]
    failed = {x["idx"]: x["message"] for x in runkit.records(out, "sample_failed")}
    assert set(failed) == {1, 14}, failed
    assert (
        failed[1].startswith("line 2 (sample 1): bad JSON") and "line 15 (sample 14)" in failed[14]
    )
    runkit.assert_complete(out, set(range(20)) - {1, 14}, {1, 14})
    # A file that is not UTF-8 text as a whole (Latin-1): refused, naming the first bad byte.
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(
        b"\n".join(
            b'{"messages": [{"role": "user", "content": "caf\xe9 %d"}]}' % i for i in range(9)
        )
    )
    r = runkit.run(tiny_model_dir, latin, tmp_path / "out2")
    assert r.returncode == 3, r.stderr[-2000:]
    assert "not UTF-8 text" in r.stderr and "first bad byte is on line 1, byte 47" in r.stderr
    assert not (tmp_path / "out2").exists()


# -- 10. a refused start writes nothing ------------------------------------------------------


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


@pytest.mark.parametrize(
    "args, code",
    [
        (("--aux-layers", "0,1,99"), 2),  # a layer the model does not have
        (("--space-reserve", "100%"), 10),  # does not fit
    ],
    ids=["aux-layers", "space"],
)
def test_a_refused_start_writes_nothing(
    tiny_model_dir: Path, tmp_path: Path, args: tuple[str, ...], code: int
) -> None:
    data = tmp_path / "data.jsonl"
    _write(data, _lines(5, seed=1))
    fresh, empty = tmp_path / "fresh", tmp_path / "empty"
    empty.mkdir()
    for out in (fresh, empty):
        r = runkit.run(tiny_model_dir, data, out, *args)
        assert r.returncode == code, r.stderr[-2000:]
    assert not fresh.exists(), _tree(fresh)
    assert _tree(empty) == []
    assert not Path(f"{fresh}.dumps").exists() and not Path(f"{empty}.sock").exists()


def test_zero_values_are_documented_in_help() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "eagle3d", "run", "--help"], capture_output=True, text=True
    )
    text = " ".join(r.stdout.split())
    for option, words in (
        ("--max-length", "0: no limit"),
        ("--workers", "0: automatic"),
        ("--worker-threads", "0: automatic"),
        ("--commit-threads", "0: automatic"),
        ("--batch-tokens", "0: automatic"),
        ("--concurrency", "0: the producer's"),
    ):
        at = text.rindex(option + " ")
        assert words in text[at : at + 400], (option, text[at : at + 400])


# -- 5. --group: a shared training group reads the job, nobody else -----------------------------


@pytest.fixture(scope="module")
def training_group() -> Iterator[tuple[str, int, int]]:
    """A real group with one member user (both made here, removed after): (name, gid, uid)."""
    import grp
    import pwd

    name = f"e3dg{os.getpid() % 100000}"
    subprocess.run(["groupadd", name], check=True)
    try:
        subprocess.run(
            ["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", "-G", name, f"{name}m"],
            check=True,
        )
        try:
            yield name, grp.getgrnam(name).gr_gid, pwd.getpwnam(f"{name}m").pw_uid
        finally:
            subprocess.run(["userdel", f"{name}m"], check=False)
    finally:
        subprocess.run(["groupdel", name], check=False)


#: Run by root, then as ``uid`` (with the groups of that user) once everything it needs is
#: imported: the shared venv lives under /root, which the user itself could not reach.
_AS_MEMBER = """
import os, pkgutil, sys, importlib, socket, contextlib, io
import eagle3top, eagle3top.cli
for m in pkgutil.walk_packages(eagle3top.__path__, "eagle3top."):
    if m.name.endswith("__main__"):
        continue
    with contextlib.suppress(Exception):
        importlib.import_module(m.name)
uid, gid = int(sys.argv[1]), int(sys.argv[2])
os.setgroups(os.getgrouplist(sys.argv[3], gid))
os.setresgid(gid, gid, gid)
os.setresuid(uid, uid, uid)
what, rest = sys.argv[4], sys.argv[5:]
if what == "open":
    for p in rest:
        try:
            os.close(os.open(p, os.O_RDONLY))
            print("OPENED", p)
        except PermissionError:
            print("DENIED", p)
elif what == "connect":
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(rest[0])
        print("CONNECTED")
    except PermissionError:
        print("DENIED")
else:
    sys.argv = ["eagle3-top", *rest]
    sys.exit(eagle3top.cli.main())
"""


def _as_uid(uid: int, gid: int, user: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _AS_MEMBER, str(uid), str(gid), user, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
    import pwd

    n = pwd.getpwnam("nobody")
    return _as_uid(n.pw_uid, n.pw_gid, "nobody", *args)


@needs_root
def test_a_group_set_with_group_reads_the_job_and_nobody_else(
    tiny_model_dir: Path, shared_dir: Path, training_group: tuple[str, int, int]
) -> None:
    name, gid, uid = training_group
    member = f"{name}m"
    data, out, log = shared_dir / "data.jsonl", shared_dir / "out", shared_dir / "log"
    sock = f"{out}.sock"
    _write(data, _lines(300, seed=7))
    proc = runkit.start(
        tiny_model_dir, data, out, "--group", name, "--concurrency", "4", fault=SLOW, log=log
    )
    with runkit.reaped(proc):
        runkit.wait_for(lambda: len(runkit.records(out, "sample_saved")) >= 3, 120, "3 saves")
        runkit.wait_for(lambda: os.path.exists(sock), 60, "the socket")
        st = os.stat(sock)
        assert (st.st_gid, st.st_mode & 0o777) == (gid, 0o660)
        assert _as_uid(uid, gid, member, "connect", sock).stdout.strip() == "CONNECTED"
        assert _as_nobody("connect", sock).stdout.strip() == "DENIED"
        live = _as_uid(uid, gid, member, "top", "--once", "--socket", sock)
        assert live.returncode == 0 and "running" in live.stdout, live.stdout + live.stderr
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    jdir = Path(paths.journal_dir(str(out), paths.Shard()))
    segment = sorted(jdir.glob("*.e3j"))[0]
    sample = out / runkit.records(out, "sample_saved")[0]["path"]
    for p in (out, out / ".eagle3d", jdir, sample.parent):
        st = os.stat(p)
        assert (st.st_gid, st.st_mode & 0o7777) == (gid, 0o2750), p
    for p in (segment, sample, jdir / "checkpoint.e3c", out / ".eagle3d" / "capture.json"):
        st = os.stat(p)
        assert (st.st_gid, st.st_mode & 0o777) == (gid, 0o640), p
    seen = _as_uid(uid, gid, member, "open", str(segment), str(sample))
    assert seen.stdout.count("OPENED") == 2, seen.stdout + seen.stderr
    stranger = _as_nobody("open", str(segment), str(sample))
    assert stranger.stdout.count("DENIED") == 2, stranger.stdout + stranger.stderr
    after = _as_uid(uid, gid, member, "top", "--once", "--output", str(out))
    assert "UNKNOWN" not in after.stdout and "saved" in after.stdout, after.stdout + after.stderr
    assert after.returncode == _once(out).returncode, after.stdout


@needs_root
def test_without_group_another_user_cannot_connect_to_the_socket(
    tiny_model_dir: Path, shared_dir: Path
) -> None:
    data, out, log = shared_dir / "data.jsonl", shared_dir / "out", shared_dir / "log"
    sock = f"{out}.sock"
    _write(data, _lines(200, seed=8))
    proc = runkit.start(tiny_model_dir, data, out, "--concurrency", "4", fault=SLOW, log=log)
    with runkit.reaped(proc):
        runkit.wait_for(lambda: os.path.exists(sock), 120, "the socket")
        runkit.wait_for(lambda: len(runkit.records(out, "sample_saved")) >= 1, 120, "a save")
        assert _as_nobody("connect", sock).stdout.strip() == "DENIED"
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)


def test_an_unknown_group_is_refused_before_anything_is_written(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    _write(data, _lines(3, seed=9))
    r = runkit.run(tiny_model_dir, data, out, "--group", "e3d-no-such-group")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "e3d-no-such-group" in r.stderr
    assert not out.exists()


def test_the_runs_own_dump_folder_is_the_daemons_alone(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Without --dump-dir an HF run's dumps go to its own folder under /dev/shm: 0700, and
    its parent (an older eagle3d made it 0755) narrowed to 0700."""
    from eagle3d.run.assemble import own_dump_dir

    data, out, log = tmp_path / "data.jsonl", tmp_path / "out", tmp_path / "log"
    _write(data, _lines(60, seed=10))
    parent = Path(own_dump_dir("0" * 32, paths.Shard())).parent
    parent.mkdir(exist_ok=True)
    os.chmod(parent, 0o755)  # as an older eagle3d made it
    args = runkit.run_args(tiny_model_dir, data, out, "--concurrency", "4")
    at = args.index("--dump-dir")
    del args[at : at + 2]
    env = runkit.env_without_faults(EAGLE3D_FAULT=SLOW)
    with open(log, "wb") as logf:
        proc = subprocess.Popen(
            args, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    with runkit.reaped(proc):
        runkit.wait_for(lambda: runkit.records(out, "run_started"), 120, "run_started")
        run_id = runkit.records(out, "run_started")[0]["run"]
        mine = Path(own_dump_dir(run_id, paths.Shard()))
        runkit.wait_for(mine.is_dir, 120, "the run's dump folder")
        assert mine.stat().st_mode & 0o777 == 0o700
        assert mine.parent.stat().st_mode & 0o777 == 0o700
        proc.wait(timeout=300)
    assert proc.returncode == 0, log.read_text()[-2000:]
    assert not mine.exists()
