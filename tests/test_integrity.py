"""Never report success for lost, mixed or unread work: the eight situations, each with the
real daemon on real files and processes.

1. the output directory removed, or moved, under a running job;
2. the output made unwritable (a real chmod, the daemon without CAP_DAC_OVERRIDE);
3. a different shard count on the same output;
4. datasets that are not plain JSONL (gzip, zstandard, JSON array, parquet; refusals);
5. ``verify`` on nothing;
6. a committed sample damaged or deleted afterwards (``verify --repair``);
7. Ctrl-C in a real terminal (tmux) and SIGTERM to the whole process group;
8. a full dump area (a small tmpfs).

After each, the same command again ends with every valid sample saved exactly once (the
crash loop's independent checker and ``eagle3d verify``), and nothing valid failed.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import crashcheck
import pytest
import runkit
from eagle3proto import events as ev
from eagle3proto import paths
from eagle3proto.journal import JournalWriter

EAGLE3_TOP = [sys.executable, "-m", "eagle3top.cli"]
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="needs root (mount, setpriv)")


@pytest.fixture(scope="module")
def slow_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An 8-layer h256 model: batches take about a second here, so a signal or a fault
    lands while samples are in flight."""
    from eagle3d.tools.tinymodel import build_tiny_model

    return Path(build_tiny_model(tmp_path_factory.mktemp("slow-model"), layers=8, hidden=256))


#: A small window, so that a stop finds work both in flight and still to send.
SMALL = ("--max-failed-fraction", "0.1", "--concurrency", "4", "--batch-tokens", "1024")


def _burnt(out: Path, malformed: set[int]) -> list[dict[str, object]]:
    """Samples recorded failed for good that are not malformed lines."""
    return [
        r
        for r in runkit.records(out, "sample_failed")
        if not r.get("retry") and r.get("idx", 0) not in malformed
    ]


def _once(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*EAGLE3_TOP, "--once", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


# -- 7. a stop never fails a sample -----------------------------------------------------------


class Terminal:
    """A real terminal: one tmux session on a private server socket running ``command``."""

    def __init__(self, command: str, cwd: Path) -> None:
        self.server = f"eagle3d-integrity-{os.getpid()}-{time.monotonic_ns()}"
        self._tmux(
            "new-session",
            "-d",
            "-s",
            "main",
            "-x",
            "200",
            "-y",
            "50",
            "-c",
            str(cwd),
            "bash",
            "-c",
            command,
        )

    def _tmux(self, *args: str) -> str:
        env = {k: v for k, v in os.environ.items() if k != "TMUX"}
        p = subprocess.run(
            ["tmux", "-L", self.server, "-f", "/dev/null", *args],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        return p.stdout

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "main", *keys)

    def close(self) -> None:
        self._tmux("kill-server")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed")
def test_ctrl_c_in_a_terminal_fails_no_sample(slow_model_dir: Path, tmp_path: Path) -> None:
    data, out, log = tmp_path / "data.jsonl", tmp_path / "out", tmp_path / "log"
    valid, malformed = runkit.dataset(data, 60)
    args = [*runkit.run_args(slow_model_dir, data, out), *SMALL]
    cmd = subprocess.list2cmdline(args)
    exitf = tmp_path / "exit"
    env = " ".join(f"{k}={v}" for k, v in (("HF_HUB_OFFLINE", "1"), ("PYTHONUNBUFFERED", "1")))
    term = Terminal(f"env {env} {cmd} 2>{log}; echo $? > {exitf}; sleep 600", tmp_path)
    try:
        runkit.wait_for(lambda: runkit.records(out, "sample_saved"), 120, "a saved sample")
        sent = {r["idx"] for r in runkit.records(out, "sample_sent")}
        saved = {r["idx"] for r in runkit.records(out, "sample_saved")}
        assert sent - saved, "samples must be in flight when Ctrl-C comes"
        term.keys("C-c")  # SIGINT to the terminal's foreground group: daemon and workers
        runkit.wait_for(exitf.exists, 120, "the daemon to exit after Ctrl-C")
        time.sleep(0.2)
        assert exitf.read_text().strip() == "0", _tail(log)
    finally:
        term.close()
    assert not _burnt(out, malformed), _burnt(out, malformed)
    c = runkit.check(out)
    assert not c.bad and not c.finished and len(c.saved) < len(valid), c.bad
    last = _last_word(log)
    assert "stopped (signal SIGINT): saved" in last and "left; resumable" in last, last
    r = runkit.run(slow_model_dir, data, out, *SMALL, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    runkit.assert_complete(out, valid, malformed)


def _last_word(log: Path) -> str:
    """The daemon's last line before the session's summary (``eagle3d run`` ends with it)."""
    return [ln for ln in log.read_text().strip().splitlines() if " summary: " not in ln][-1]


def _stop_group_mid_run(model: Path, data: Path, out: Path, log: Path) -> None:
    proc = runkit.start(model, data, out, *SMALL, log=log)
    with runkit.reaped(proc):
        runkit.wait_for(lambda: runkit.records(out, "sample_saved"), 120, "a saved sample")
        # What scancel, kill -- -PGID and a container stop do: every process of the group.
        os.killpg(proc.pid, signal.SIGTERM)
        assert runkit.exit_code(proc, 120, log) == 0, _tail(log)


def test_sigterm_to_the_process_group_fails_no_sample(slow_model_dir: Path, tmp_path: Path) -> None:
    data, out, log = tmp_path / "data.jsonl", tmp_path / "out", tmp_path / "log"
    valid, malformed = runkit.dataset(data, 60)
    _stop_group_mid_run(slow_model_dir, data, out, log)
    assert not _burnt(out, malformed), _burnt(out, malformed)
    drained = [r for r in runkit.records(out, "sample_failed") if r.get("environment")]
    assert all(r.get("retry") for r in drained), drained
    last = _last_word(log)
    assert "stopped (signal SIGTERM): saved" in last and "left; resumable" in last, last
    c = runkit.check(out)
    assert not c.bad and len(c.saved) < len(valid)

    # What an older eagle3d recorded for such a stop (and for a full or unwritable disk):
    # failures "for good" that were not the samples' own. The next run retries them.
    pending = sorted(valid - c.saved - c.failed)[:3]
    assert len(pending) == 3, pending
    old = [
        ("ProducerCrashed", "worker 4242 exited with code -15"),
        ("DumpWriteError", "writing the dump failed: ENOSPC: No space left on device"),
        ("CommitError", "CommitError: commit of sample 9 failed: Permission denied"),
    ]
    with JournalWriter(paths.journal_dir(str(out), paths.Shard())) as j:
        j.open()
        for idx, (error, message) in zip(pending, old, strict=True):
            j.append(ev.SampleFailed(idx=idx, error=error, message=message, attempt=1))
    assert set(pending) <= runkit.check(out).failed

    r = runkit.run(slow_model_dir, data, out, *SMALL, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "are retried" in r.stderr
    reopened = [
        r for r in runkit.records(out, "sample_failed") if "retried:" in str(r.get("message"))
    ]
    assert {r["idx"] for r in reopened} == set(pending)
    runkit.assert_complete(out, valid, malformed)
    top = _once(out)
    assert top.returncode == 0 and "FINISHED" in top.stdout, top.stdout


# -- 8. a full dump area -----------------------------------------------------------------------


def _mount(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)


def _umount(path: Path) -> None:
    for _ in range(50):
        if subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
            return
        time.sleep(0.2)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        if not ROOT:
            pytest.skip("mounting a tmpfs needs root")
        mnt = tmp_path / f"tmpfs{len(mounted)}"
        _mount(mnt, size)
        mounted.append(mnt)
        return mnt

    try:
        yield mount
    finally:
        for mnt in mounted:
            _umount(mnt)


def _fill(directory: Path) -> Path:
    """Take every free byte of ``directory``'s filesystem with one file."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        block = b"\0" * 65536
        while block:
            try:
                os.write(fd, block)
            except OSError:
                block = block[: len(block) // 2]
    finally:
        os.close(fd)
    return filler


@needs_root
def test_a_full_dump_area_pauses_and_never_burns_samples(
    tiny_model_dir: Path, tmpfs: Callable[[str], Path], tmp_path: Path
) -> None:
    """A 6 MiB dump area (a busy GPU node's /dev/shm, where one dump can be 100 MB): the
    window of requests in flight shrinks to what it holds; then filled to the last byte,
    the workers' dump writes fail with ENOSPC and the run pauses instead of failing them."""
    dumps = tmpfs("6m")
    data, out, log = tmp_path / "data.jsonl", tmp_path / "out", tmp_path / "log"
    valid, malformed = runkit.dataset(data, 120)
    proc = runkit.start(
        tiny_model_dir,
        data,
        out,
        "--dump-dir",
        str(dumps),
        "--batch-tokens",
        "512",
        fault="worker_slow:150",
        log=log,
    )
    with runkit.reaped(proc):
        runkit.wait_for(lambda: len(runkit.records(out, "sample_saved")) >= 5, 120, "5 saves")
        filler = _fill(dumps)

        def paused_yet() -> bool:
            _fill(dumps)  # and what the daemon's commits free meanwhile, until a dump fails
            return any(r.get("state") == "paused" for r in runkit.records(out, "run_state"))

        runkit.wait_for(paused_yet, 60, "a run_state paused record", step=0.05)
        paused = next(r for r in runkit.records(out, "run_state") if r.get("state") == "paused")
        assert "(ENOSPC) writing to the dump area" in paused["reason"], paused
        time.sleep(3)
        assert proc.poll() is None, _tail(log)
        assert not _burnt(out, malformed)
        filler.unlink()
        assert runkit.exit_code(proc, 180, log) == 0, _tail(log)
    states = [r.get("state") for r in runkit.records(out, "run_state")]
    assert "paused" in states and states[-1] == "running", states
    assert not _burnt(out, malformed)
    runkit.assert_complete(out, valid, malformed)
    # The window followed the area's free space: never more dumps planned than it held.
    assert "DumpWriteError" not in {r.get("error") for r in _burnt(out, malformed)}


# -- 2. the output made unwritable -------------------------------------------------------------


def _without_dac_override(args: list[str]) -> list[str]:
    """``args`` run as root without CAP_DAC_OVERRIDE: permissions bind, as for a service user."""
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", "--bounding-set", caps, "--inh-caps", caps, "--", *args]


@needs_root
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv not installed")
def test_an_unwritable_output_pauses_and_resumes(slow_model_dir: Path, tmp_path: Path) -> None:
    data, out, log = tmp_path / "data.jsonl", tmp_path / "out", tmp_path / "log"
    valid, malformed = runkit.dataset(data, 60)
    args = [*runkit.run_args(slow_model_dir, data, out), *SMALL]
    with open(log, "wb") as logf:
        proc = subprocess.Popen(
            _without_dac_override(args),
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=runkit.env_without_faults(),
            start_new_session=True,
        )
    rows = out / paths.rows_dir(0)
    with runkit.reaped(proc):
        runkit.wait_for(lambda: runkit.records(out, "sample_saved"), 120, "a saved sample")
        rows.chmod(0o555)  # no new file in the row directory
        try:
            runkit.wait_for(
                lambda: any(r.get("state") == "paused" for r in runkit.records(out, "run_state")),
                60,
                "a run_state paused record",
            )
            paused = [r for r in runkit.records(out, "run_state") if r.get("state") == "paused"]
            assert f"permission denied (EACCES) writing to the output {rows}" in paused[0]["reason"]
            time.sleep(3)
            assert proc.poll() is None, _tail(log)
            assert not _burnt(out, malformed)
            top = _once(out)
            assert top.returncode == 2 and "permission denied" in top.stdout, top.stdout
        finally:
            rows.chmod(0o755)
        os.kill(proc.pid, signal.SIGHUP)  # try again now rather than at the next probe
        assert runkit.exit_code(proc, 180, log) == 0, _tail(log)
    assert "SIGHUP: trying the paused area(s) again now" in log.read_text()
    states = [r.get("state") for r in runkit.records(out, "run_state")]
    assert states[-1] == "running" and "paused" in states, states
    assert not _burnt(out, malformed)
    runkit.assert_complete(out, valid, malformed)


# -- 1. the output removed or moved ------------------------------------------------------------


@pytest.mark.parametrize("how", ["removed", "moved"])
def test_an_output_removed_or_moved_stops_at_once(
    how: str, slow_model_dir: Path, tmp_path: Path
) -> None:
    data, out, log = tmp_path / "data.jsonl", tmp_path / "out", tmp_path / "log"
    valid, malformed = runkit.dataset(data, 60)
    moved = tmp_path / "moved"
    proc = runkit.start(slow_model_dir, data, out, *SMALL, log=log)
    with runkit.reaped(proc):
        runkit.wait_for(lambda: runkit.records(out, "sample_saved"), 120, "a saved sample")
        if how == "removed":
            # As `rm -rf` by hand: a commit may add a file to a row directory while the walk
            # is under way (ENOTEMPTY), so remove again until nothing is left.
            while out.exists():
                shutil.rmtree(out, ignore_errors=True)
        else:
            out.rename(moved)
        assert runkit.exit_code(proc, 60, log) == 4, _tail(log)
    text = log.read_text()
    if how == "removed":
        # rm -rf removes what is inside (the journal, row folders) before the output itself;
        # the daemon names the first of them it finds gone.
        inside = rf"(journal( directory)?|row folder) {re.escape(str(out))}/\S*"
        assert re.search(
            rf"the (output directory {re.escape(str(out))}|{inside}) was removed during the run",
            text,
        ), _tail(log)
    else:
        assert f"the output directory {out} was moved away" in text, _tail(log)
    assert "finished: saved" not in text and "the run is not finished" in text
    assert not out.exists(), "nothing may be made again at the old path"
    if how == "removed":
        return
    # The journal at the new place says nothing more: no run_finished, no failed sample.
    assert not runkit.check(moved).finished
    assert not _burnt(moved, malformed)
    top = _once(moved)
    assert "FINISHED" not in top.stdout and top.returncode != 0, top.stdout
    moved.rename(out)  # put back where it was: the same command resumes exactly
    r = runkit.run(slow_model_dir, data, out, *SMALL, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    runkit.assert_complete(out, valid, malformed)


# -- 3. one live shard layout per output --------------------------------------------------------


def test_a_different_shard_count_is_refused_live_and_takes_over_after(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Another N while a daemon of the old layout runs: exit 7, nothing written. Once it
    has ended, the new layout is accepted and takes only what no journal settled (here:
    nothing; docs/slurm.md, "Changing N between runs")."""
    data, out, log = tmp_path / "data.jsonl", tmp_path / "out", tmp_path / "log"
    valid, _ = runkit.dataset(data, 40, malformed=False)
    first = runkit.start(
        tiny_model_dir, data, out, "--batch-tokens", "256", fault="worker_slow:200", log=log
    )
    with runkit.reaped(first):
        runkit.wait_for(lambda: b" up; window " in log.read_bytes(), 120, "the first daemon")
        before = {p.name for p in (out / ".eagle3d" / "journal").iterdir()}
        r = runkit.run(tiny_model_dir, data, out, "--shard", "1/2", "--socket", f"{out}.2.sock")
        assert r.returncode == 7, r.stderr[-2000:]
        assert "shard-0-of-1" in r.stderr and "shard 1/2" in r.stderr, r.stderr
        assert {p.name for p in (out / ".eagle3d" / "journal").iterdir()} == before
        assert runkit.exit_code(first, 180, log) == 0, _tail(log)
    r = runkit.run(tiny_model_dir, data, out, "--shard", "0/2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "shard count changed to 2" in r.stderr and "nothing to do" in r.stderr, r.stderr
    runkit.assert_complete(out, valid, set())


# -- 4. inputs ---------------------------------------------------------------------------------


def _demo_rows(kind: str, n: int) -> list[str]:
    """The first ``n`` demo lines of one kind: chat (either key) or pre-tokenized."""
    lines = runkit.DEMO.read_text(encoding="utf-8").splitlines()
    pick = [ln for ln in lines if ln.startswith('{"input_ids"') == (kind == "ids")]
    return [ln for ln in pick if not crashcheck.expected_malformed(ln)][:n]


def _write_format(path: Path, fmt: str, rows: list[str]) -> Path:
    body = "\n".join(rows) + "\n"
    objs = [json.loads(r) for r in rows if r.strip()]
    if fmt == "jsonl.gz":
        path.write_bytes(gzip.compress(body.encode()))
    elif fmt == "jsonl.zst":
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress(body.encode()))
    elif fmt == "json":
        path.write_text("[\n" + ",\n".join(r for r in rows if r.strip()) + "\n]\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if fmt == "parquet-ids":
            cols = {k: [o[k] for o in objs] for k in ("input_ids", "loss_mask")}
        else:  # ShareGPT from/value and role/content turns in one struct column
            cols = {"conversations": [o.get("conversations") or o["messages"] for o in objs]}
        cols["source"] = ["demo"] * len(objs)
        pq.write_table(pa.table(cols), path)
    return path


@pytest.mark.parametrize("fmt", ["jsonl.gz", "jsonl.zst", "json", "parquet", "parquet-ids"])
def test_datasets_in_other_formats(fmt: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    lines = _demo_rows("ids" if fmt == "parquet-ids" else "chat", 12)
    rows = [*lines[:5], "", *lines[5:]]  # a blank line: skipped, not failed
    data = _write_format(tmp_path / f"data.{fmt.removesuffix('-ids')}", fmt, rows)
    out = tmp_path / "out"
    args = runkit.run_args(tiny_model_dir, data, out)
    at = args.index("--dump-dir")
    del args[at : at + 2]  # the default per-job dump folder: removed at the end of the run
    r = subprocess.run(
        args, capture_output=True, text=True, timeout=180, env=runkit.env_without_faults()
    )
    assert r.returncode == 0, r.stderr[-3000:]
    blank = fmt.startswith("jsonl")
    want = set(range(13)) - {5} if blank else set(range(12))  # ids are row numbers
    c = runkit.check(out)
    assert c.saved == want and not c.failed and not c.bad, (sorted(c.saved), c.failed)
    if blank:
        assert "1 blank line(s)" in r.stderr
    started = runkit.records(out, "run_started")[-1]
    assert started["total"] == 12 and started.get("skipped", 0) == (1 if blank else 0)
    assert started["job"]["dataset_bytes"] == data.stat().st_size  # the file as stored
    rep = runkit.verify(out)
    assert rep["_rc"] == 0 and rep["checked"] == 12
    run8 = started["run"][:8]
    assert not list(Path("/dev/shm").glob(f"eagle3d-*/{run8}-*")), "empty dump folder left"


@pytest.mark.parametrize("what", ["directory", "binary", "csv", "broken array", "bad gzip"])
def test_unreadable_datasets_are_refused_before_the_run(
    what: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    if what == "directory":
        data.mkdir()
    elif what == "binary":
        data.write_bytes(os.urandom(4096).replace(b"{", b"x"))
    elif what == "csv":
        data.write_text("role,content\nuser,hello\n")
    elif what == "broken array":
        data.write_text('[{"messages": [{"role": "user", "content": "hi"}]},\n{"messa')
    else:
        data.write_bytes(gzip.compress(b'{"messages": []}\n')[:20])
    out = tmp_path / "out"
    r = runkit.run(tiny_model_dir, data, out)
    assert r.returncode == 3, (r.returncode, r.stderr[-2000:])
    assert str(data) in r.stderr and ("JSONL" in r.stderr or "JSON" in r.stderr), r.stderr
    assert not out.exists(), "refused before anything is written"


# -- "finished" means something --------------------------------------------------------------


def test_a_run_where_every_sample_failed_is_no_success(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    data.write_text("".join(f'{{"broken": {i}\n' for i in range(6)))
    r = runkit.run(tiny_model_dir, data, out)
    assert r.returncode == 9, r.stderr[-2000:]
    assert "finished: saved 0 / 6 (0 %), 6 failed" in r.stderr
    assert "every sample failed" in r.stderr
    top = _once(out)
    assert top.returncode == 2, top.stdout  # CRITICAL
    assert "saved 0 / 6 (0.0%), 6 failed" in top.stdout
    again = runkit.run(tiny_model_dir, data, out)
    assert again.returncode == 9 and "nothing to do" in again.stderr, again.stderr[-2000:]


def test_failures_over_the_threshold_exit_9_and_warn(tiny_model_dir: Path, tmp_path: Path) -> None:
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    runkit.dataset(data, 10)  # 3 of 13 malformed: 23 %
    r = runkit.run(tiny_model_dir, data, out, "--max-failed-fraction", "0.05")
    assert r.returncode == 9, r.stderr[-2000:]
    assert "too many samples failed" in r.stderr
    assert runkit.records(out, "run_finished")[-1].get("exit_code") == 9
    top = _once(out)
    assert top.returncode == 1 and "3 of 13 samples failed" in top.stdout, top.stdout
    assert "saved 10 / 13 (76.9%), 3 failed" in top.stdout
    ok = runkit.run(tiny_model_dir, data, out, "--max-failed-fraction", "0.25")
    assert ok.returncode == 0, ok.stderr[-2000:]


# -- 5 and 6. verify, and repair ---------------------------------------------------------------


def test_verify_says_ok_only_when_it_exits_0(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for out in (tmp_path / "missing", empty):
        for flag in ("--output", "-o"):
            r = subprocess.run(
                [sys.executable, "-m", "eagle3d", "verify", flag, str(out)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert r.returncode == 2, r
            assert "OK" not in r.stdout.split(), r.stdout
            assert "NOTHING TO VERIFY" in r.stdout


def test_verify_repair_then_run_redoes_exactly_the_damaged(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    valid, _ = runkit.dataset(data, 10, malformed=False)
    assert runkit.run(tiny_model_dir, data, out).returncode == 0
    flipped, deleted = out / paths.sample_relpath(3), out / paths.sample_relpath(7)
    b = bytearray(flipped.read_bytes())
    b[len(b) // 2] ^= 0x10
    flipped.write_bytes(bytes(b))
    deleted.unlink()
    assert runkit.verify(out)["_rc"] == 1
    r = subprocess.run(
        [sys.executable, "-m", "eagle3d", "verify", "-o", str(out), "--repair"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "REPAIRED" in r.stdout and "OK" not in r.stdout.split(), r.stdout
    kept = list((out / ".eagle3d" / "damaged").rglob("data_3.ckpt.*"))
    assert len(kept) == 1 and kept[0].read_bytes() == bytes(b), "moved aside, never deleted"
    assert not flipped.exists()
    invalid = runkit.records(out, "sample_invalid")
    assert {x["idx"] for x in invalid} == {3, 7}
    seq = max(x["seq"] for x in invalid)
    rerun = runkit.run(tiny_model_dir, data, out)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    redone = {x["idx"] for x in runkit.records(out, "sample_saved") if x["seq"] > seq}
    assert redone == {3, 7}
    runkit.assert_complete(out, valid, set())
