"""The SGLang path end to end against a real, stock SGLang 0.5.21 server on this CPU.

One server for the module (``eagle3d serve-sglang``, fp32, a 10-layer tiny Llama so that the
three aux layers differ, ``--chunked-prefill-size 64`` with samples several chunks long, mixed
chunks on), its dump area a small tmpfs when run as root. The tests run in file order and share
it: a generated dataset extracted and compared with an independent Hugging Face forward; a dump
that never arrives; the monitor's readings; kill -9 of the daemon and of the server; requests
that are not ours (after the restart, so that the last life of the server saw them); a full
dump area; and last, the stop in order.

    scripts/sglang_env && EAGLE3D_SGLANG_E2E=1 scripts/test tests/test_sglang_real_server.py
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import runkit
import sglang_real as sr

pytestmark = [*sr.needs_real_sglang, pytest.mark.timeout(900)]

DROP_AT = 9  # the hook drops its 9th dump (EAGLE3D_FAULT hook_drop): a dump that never arrives
LAYERS = 10


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("real-sglang")


@pytest.fixture(scope="module")
def model10(work: Path) -> Path:
    from eagle3d.tools.tinymodel import build_tiny_model

    return Path(build_tiny_model(work / "model", layers=LAYERS, hidden=64))


@pytest.fixture(scope="module")
def dumps(work: Path) -> Iterator[Path]:
    if os.geteuid() == 0:  # a small dump area of its own, as /dev/shm is on a GPU node
        with sr.tmpfs(work / "dumps", "64m") as d:
            yield d
    else:
        (work / "dumps").mkdir()
        yield work / "dumps"


@pytest.fixture(scope="module")
def server(model10: Path, dumps: Path, work: Path) -> Iterator[sr.Server]:
    s = sr.Server(
        model10,
        dumps,
        work,
        extra=["--chunked-prefill-size", "64", "--enable-mixed-chunk"],
        env={"EAGLE3D_FAULT": f"hook_drop:{DROP_AT}@{work / 'hook-drop.fired'}"},
    )
    s.start()
    yield s
    if s.proc is not None and s.proc.poll() is None:
        s.kill()


# The states are compared with an fp32 HF forward at 1e-5, so they are stored as computed
# (the default storage dtype of an fp32 model is bfloat16, what SpecForge trains on).
STORE = ("--store-dtype", "float32")


def run(model: Path, data: Path, out: Path, server: sr.Server, *extra: str, timeout: float = 300):
    return runkit.run(
        model,
        data,
        out,
        "--backend",
        "sglang",
        "--server",
        server.url,
        "--dump-dir",
        str(server.dump_dir),
        *STORE,
        *extra,
        timeout=timeout,
    )


def start(model: Path, data: Path, out: Path, server: sr.Server, *extra: str):
    return runkit.start(
        model,
        data,
        out,
        "--backend",
        "sglang",
        "--server",
        server.url,
        "--dump-dir",
        str(server.dump_dir),
        *STORE,
        *extra,
    )


def saved_count(out: Path) -> int:
    try:
        return len(runkit.records(out, "sample_saved"))
    except Exception:  # the journal is being written: count again next time
        return 0


def dataset(
    work: Path, name: str, n: int, seed: int, bad_every: int = 0
) -> tuple[Path, Any, Any, dict[int, Any]]:
    convs = sr.conversations(n, seed=seed)
    path = work / f"{name}.jsonl"
    valid, bad = sr.write_dataset(path, convs, bad_every)
    lines = path.read_text().splitlines()
    by_idx = {i: json.loads(lines[i]) for i in valid}
    return path, valid, bad, by_idx


# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def extraction(model10: Path, server: sr.Server, work: Path) -> dict[str, Any]:
    """48 generated conversations (multi-turn, system prompts, a third of them several chunks
    long) and 4 malformed lines, at concurrency 12 so that SGLang packs several requests and
    chunks into one forward."""
    data, valid, bad, convs = dataset(work, "extract", 48, seed=1, bad_every=12)
    out = work / "extract"
    t0 = time.monotonic()
    r = run(model10, data, out, server, "--concurrency", "12")
    return {
        "r": r,
        "out": out,
        "valid": valid,
        "bad": bad,
        "convs": convs,
        "s": time.monotonic() - t0,
    }


def test_extraction_saves_every_valid_sample_once_equal_to_hf(
    extraction: dict[str, Any], model10: Path, server: sr.Server
) -> None:
    r, out = extraction["r"], extraction["out"]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runkit.assert_complete(out, extraction["valid"], extraction["bad"])  # verify included
    worst = sr.compare_with_hf(out, model10, extraction["convs"])
    assert worst["aux"] <= 1e-5 and worst["final"] <= 1e-5, worst
    server.check_clean()


def test_extraction_was_packed_and_chunked(extraction: dict[str, Any], server: sr.Server) -> None:
    """Several requests per forward, and requests longer than the 64-token chunk."""
    log = server.text()
    seqs = [int(n) for n in re.findall(r"Prefill batch, #new-seq: (\d+)", log)]
    assert seqs and max(seqs) >= 2, seqs
    tokens = [rec["tokens"] for rec in runkit.records(extraction["out"], "sample_saved")]
    assert max(tokens) > 3 * 64 and sum(t > 64 for t in tokens) >= 10, sorted(tokens)


def test_a_dump_that_never_arrives_is_resent(extraction: dict[str, Any]) -> None:
    """The hook dropped one dump after SGLang answered (EAGLE3D_FAULT hook_drop): the client
    reports it missing after the grace, and the sample is saved by its second attempt."""
    fails = runkit.records(extraction["out"], "sample_failed")
    missing = [f for f in fails if f.get("error") == "DumpMissing"]
    assert len(missing) == 1 and missing[0]["retry"], fails
    assert "no dump arrived" in missing[0]["message"] and "bytes free" in missing[0]["message"]
    idx = missing[0]["idx"]
    sent = [s for s in runkit.records(extraction["out"], "sample_sent") if s["idx"] == idx]
    assert [s.get("attempt", 1) for s in sent] == [1, 2]
    assert idx in {s["idx"] for s in runkit.records(extraction["out"], "sample_saved")}


def test_monitor_shows_the_real_servers_readings(extraction: dict[str, Any]) -> None:
    out = extraction["out"]
    p = subprocess.run(
        [sys.executable, "-m", "eagle3top", "--once", "--json", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    doc = json.loads(p.stdout)
    (shard,) = doc["shards"]
    detail = shard["producer_detail"]
    assert shard["producer_up"] is True and detail["server_version"] == "0.5.21", detail
    valid_tokens = sum(r["tokens"] for r in runkit.records(out, "sample_saved"))
    assert detail["prompt_tokens_total"] >= valid_tokens, (detail, valid_tokens)
    for key in ("num_running_reqs", "num_queue_reqs", "server_at", "metrics_at"):
        assert key in detail, detail
    # the monitor's producer panel, from the same journal
    from eagle3proto import paths, reducer
    from eagle3proto.journalread import iter_events
    from eagle3top import hostpanels
    from eagle3top.model import Row

    events, _ = iter_events(paths.journal_dir(str(out), paths.Shard(0, 1)))
    state = reducer.new_state()
    for e in events:
        reducer.apply(state, e)
    text = hostpanels.producer([Row(label="x", state=state, source="journal")], time.time()).plain
    # The run has ended: the panel says the server *was* up, as last seen, with the server's
    # version and its /metrics readings.
    assert "sglang was up" in text and "server 0.5.21" in text, text
    total = int(detail["prompt_tokens_total"])
    assert f"prompt tokens {total:,}" in text and "running 0 · queued 0" in text, text


def test_kill_9_of_the_daemon_mid_run_resumes_exactly_once(
    model10: Path, server: sr.Server, work: Path
) -> None:
    data, valid, bad, convs = dataset(work, "kill-daemon", 80, seed=3, bad_every=40)
    out = work / "kill-daemon"
    proc = start(model10, data, out, server, "--concurrency", "8")
    with runkit.reaped(proc):
        runkit.wait_for(lambda: saved_count(out) >= 15, 120, "15 samples saved")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert saved_count(out) < len(valid)  # it really died mid-run
    r = run(model10, data, out, server, "--concurrency", "8")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runkit.assert_complete(out, valid, bad)
    worst = sr.compare_with_hf(out, model10, convs)
    assert worst["aux"] <= 1e-5 and worst["final"] <= 1e-5, worst


def test_kill_9_of_the_server_mid_run_is_waited_for(
    model10: Path, server: sr.Server, work: Path
) -> None:
    """SGLang's main process is killed with SIGKILL mid-run: serve-sglang restarts it; the
    daemon waits (producer down, no attempt counted), resends, and finishes exactly once."""
    data, valid, bad, convs = dataset(work, "kill-server", 80, seed=4, bad_every=40)
    out = work / "kill-server"
    lives = len(server.main_pids())
    proc = start(model10, data, out, server, "--concurrency", "8", "--request-timeout", "120")
    with runkit.reaped(proc):
        runkit.wait_for(lambda: saved_count(out) >= 10, 120, "10 samples saved")
        os.kill(server.main_pids()[-1], signal.SIGKILL)
        rc = runkit.exit_code(proc, 300, Path(f"{out}.log"))
    assert rc == 0, Path(f"{out}.log").read_text()[-4000:]
    runkit.assert_complete(out, valid, bad)
    assert len(server.main_pids()) == lives + 1, server.tail()
    assert re.search(
        r"serve-sglang: server exited with status 137 after \d+ s; restart \d+", server.text()
    )
    states = [rec["state"] for rec in runkit.records(out, "producer")]
    assert "down" in states and states[-1] == "up", states
    fails = runkit.records(out, "sample_failed")
    assert all(f["retry"] for f in fails if f["idx"] in valid), fails  # none burnt
    worst = sr.compare_with_hf(out, model10, convs)
    assert worst["aux"] <= 1e-5 and worst["final"] <= 1e-5, worst
    server.wait_ready()


def test_requests_that_are_not_ours_write_no_dump(
    model10: Path, server: sr.Server, work: Path
) -> None:
    """A user's /generate requests (decoding 8 tokens, so their decodes share forwards with
    our prefills), /health and /server_info on the same server during a run: no stray dump."""
    data, valid, bad, _ = dataset(work, "foreign", 24, seed=2)
    out = work / "foreign"
    stop = threading.Event()
    answers: list[int] = []

    def user() -> None:
        k = 0
        while not stop.is_set() and k < 400:
            k += 1
            ids = [(k * 7 + j) % 900 + 10 for j in range(20 + k % 50)]
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
            if k % 3 == 0:
                body = {"text": "the model reads", "sampling_params": {"max_new_tokens": 8}}
            answers.append(sr.http(server.url + "/generate", body)[0])
            sr.http(server.url + "/health")
            sr.http(server.url + "/server_info")

    users = [threading.Thread(target=user) for _ in range(3)]
    for t in users:
        t.start()
    try:
        time.sleep(1.0)  # the user is already there when the run starts
        r = run(model10, data, out, server, "--concurrency", "8")
    finally:
        stop.set()
        for t in users:
            t.join(60)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runkit.assert_complete(out, valid, bad)
    assert answers and set(answers) == {200}, answers
    # The server killed in the test before may have finished dumps for requests that run
    # resent after it was gone: this run removes them as left by that earlier run. Anything
    # else the hook wrote (a dump for a user's request) would be an orphan too.
    earlier = {rec.get("run", "")[:8] for rec in _records_of_other_runs(work, out)}
    strays = [
        o
        for o in runkit.records(out, "dump_orphan")
        if o["reason"] != "left by an earlier run" or o["rid"].split("-")[0] not in earlier
    ]
    assert strays == []
    assert os.listdir(server.dump_dir) == []  # nothing but our own dumps was ever written
    server.check_clean()


def _records_of_other_runs(work: Path, out: Path) -> list[dict[str, Any]]:
    """Every journal record of the outputs in `work` other than `out`."""
    recs: list[dict[str, Any]] = []
    for other in work.iterdir():
        if other != out and other.is_dir() and (other / ".eagle3d").is_dir():
            recs += runkit.records(other)
    return recs


@pytest.mark.skipif(os.geteuid() != 0, reason="the dump area is a size-limited tmpfs (root)")
def test_a_full_dump_area_pauses_the_run_and_burns_no_sample(
    model10: Path, server: sr.Server, work: Path, extraction: dict[str, Any]
) -> None:
    """The server's dump area fills up mid-run (the hook's writes fail with ENOSPC): no
    sample is failed for it, the run pauses and waits, and after space is freed it finishes
    exactly once."""
    # The server's one injected drop (hook_drop, armed at its start) must have fired in the
    # extraction, or it would land here as a legitimate, counted attempt.
    assert (work / "hook-drop.fired").exists(), "the extraction should have used up the drop"
    data, valid, bad, _ = dataset(work, "full", 40, seed=5)
    out = work / "full"
    ballast = server.dump_dir / "ballast"
    st = os.statvfs(server.dump_dir)
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o644)
    try:  # leaves less than one dump's room
        os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize - 64 * 1024)
    finally:
        os.close(fd)
    proc = start(model10, data, out, server, "--concurrency", "8")
    try:
        with runkit.reaped(proc):
            time.sleep(20)  # the area stays full a while
            ballast.unlink()
            rc = runkit.exit_code(proc, 300, Path(f"{out}.log"))
    finally:
        ballast.unlink(missing_ok=True)
    assert rc == 0
    runkit.assert_complete(out, valid, bad)
    fails = runkit.records(out, "sample_failed")
    # The hook's failed writes surface as the environment's failures: no attempt counted.
    counted = [f for f in fails if f["idx"] in valid and not f.get("environment")]
    assert not counted, counted
    assert all(f["retry"] for f in fails if f["idx"] in valid), fails
    states = [rec["state"] for rec in runkit.records(out, "run_state")]
    assert "paused" in states, states
    assert len(runkit.records(out, "run_finished")) == 1


def test_the_stop_lets_the_hooks_writer_drain(server: sr.Server) -> None:
    """Last: SIGTERM to serve-sglang stops SGLang's main process first; SGLang drains and
    asks its scheduler to exit by itself, and the hook's writer finishes and says what it saw:
    forwards packing several of our requests, and a continued chunk beside a new request."""
    rc = server.stop()
    log = server.text()
    assert rc == 0, server.tail()
    assert "crashed with exit code" not in log.split("restart")[-1], server.tail()
    finished = re.findall(
        r"dump writer finished: (\d+) written, \d+ lost, \d+ refused; forwards .*EXTEND \d+.*; "
        r"at most (\d+) of our requests in one, (\d+) with a continued chunk beside a new",
        log,
    )
    assert finished, server.tail()
    written, most, beside = map(int, finished[-1])
    assert written > 0 and most >= 2 and beside >= 1, finished
    server.check_clean()
