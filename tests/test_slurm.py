"""eagle3d under a real Slurm: the documented array job and Slurm's own faults.

Every test submits ``docs/eagle3d-array.sbatch`` (the file docs/slurm.md shows) to the
one-node cluster that ``scripts/slurm_env`` runs on this host (real slurmctld, slurmd and
munge; ``scripts/slurm_stage`` is CI's stage), with ``BACKEND=hf`` and the tiny model in place
of SGLang, and acts on it only through Slurm's commands (``sbatch``, ``scancel``,
``scontrol requeue``, ``--time`` with ``--signal``, ``scontrol update ... state=drain``). The
outcome is read from the outside: the crash loop's checker (``crashcheck``: every valid
sample saved exactly once, nothing lost, duplicated, corrupt, unaccounted or burnt),
``eagle3d verify``, and ``eagle3-top --once --json``, whose verdict is compared with what
Slurm says at each step.

Skipped unless ``EAGLE3D_SLURM_E2E=1`` (set by ``scripts/slurm_stage``); with it set, a
cluster that does not answer fails the tests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crashcheck
import pytest
import runkit

REPO = Path(__file__).resolve().parent.parent
SBATCH = REPO / "docs" / "eagle3d-array.sbatch"

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("EAGLE3D_SLURM_E2E") != "1",
        reason="a real Slurm cluster: scripts/slurm_stage (EAGLE3D_SLURM_E2E=1)",
    ),
]

#: A job's states once Slurm is done with it.
ENDED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY")


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """The node's name, once ``sinfo`` shows it idle; the node is left resumed."""
    if shutil.which("sbatch") is None:
        pytest.fail("EAGLE3D_SLURM_E2E=1 but no sbatch: run scripts/slurm_env first")
    r = subprocess.run(["bash", str(REPO / "scripts" / "slurm_env"), "status"], check=False)
    if r.returncode:
        pytest.fail("the Slurm cluster does not answer: run scripts/slurm_env first")
    node = subprocess.run(
        ["sinfo", "-h", "-o", "%n"], capture_output=True, text=True, check=True
    ).stdout.split()[0]
    yield node
    subprocess.run(
        ["scontrol", "update", f"nodename={node}", "state=resume"],
        check=False,
        capture_output=True,  # "Invalid node state" when it is not drained: nothing to do
    )


def _env(**extra: str) -> dict[str, str]:
    """What the job gets (sbatch --export=ALL): this interpreter's ``eagle3d`` first on PATH,
    this tree's code first on PYTHONPATH, no fault unless asked."""
    env = runkit.env_without_faults()
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = f"{bindir}:{env.get('PATH', '')}"
    tree = [str(REPO / d) for d in ("shared", "daemon", "tui")]
    env["PYTHONPATH"] = ":".join([*tree, env.get("PYTHONPATH", "")]).rstrip(":")
    env.update(extra)
    return env


def submit(
    where: Path,
    model: Path,
    data: Path,
    out: Path,
    array: str,
    *run_args: str,
    sbatch: tuple[str, ...] = (),
    fault: str = "",
) -> str:
    """``sbatch`` the documented script as an array over ``out``; returns the job id.

    The site's ``#SBATCH`` lines stand; the command line overrides what a one-node CPU
    cluster cannot give (``--gres``, ``--exclusive``) and the array's size."""
    env = _env(MODEL=str(model), DATASET=str(data), OUTPUT=str(out), BACKEND="hf", **_fault(fault))
    cmd = [
        "sbatch",
        "--parsable",
        f"--array={array}",
        "--gres=none",
        "--oversubscribe",
        "--time=10",
        f"--chdir={where}",
        f"--output={where}/slurm-%A_%a.out",
        "--export=ALL",
        *sbatch,
        str(SBATCH),
        *runkit.FAILED_FRACTION,
        *run_args,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def _fault(fault: str) -> dict[str, str]:
    return {"EAGLE3D_FAULT": fault} if fault else {}


def tasks(job: str) -> dict[int, tuple[str, str]]:
    """Array task -> (state, reason), from squeue (every state, finished ones included)."""
    r = subprocess.run(
        ["squeue", "-h", "-r", "--states=all", "-j", job, "-o", "%K|%T|%r"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    out: dict[int, tuple[str, str]] = {}
    for line in r.stdout.splitlines():
        k, state, reason = line.split("|")
        if k.isdigit():
            out[int(k)] = (state, reason)
    return out


def show(job_task: str) -> dict[str, str]:
    """``scontrol show job -o`` as a dict (JobState, ExitCode, Restarts, ...)."""
    r = subprocess.run(
        ["scontrol", "show", "job", "-o", job_task], capture_output=True, text=True, timeout=30
    )
    fields: dict[str, str] = {}
    for tok in r.stdout.split():
        k, sep, v = tok.partition("=")
        if sep:
            fields.setdefault(k, v)
    return fields


def wait_tasks(job: str, pred: Any, what: str, timeout: float = 240) -> dict[int, tuple[str, str]]:
    deadline = time.monotonic() + timeout
    seen: dict[int, tuple[str, str]] = {}
    while time.monotonic() < deadline:
        seen = tasks(job)
        if pred(seen):
            return seen
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; squeue: {seen}")


def _seconds(runtime: str) -> int:
    """``[D-]HH:MM:SS`` (scontrol's RunTime) in seconds."""
    days, _, hms = runtime.rpartition("-")
    h, m, sec = (int(x) for x in hms.split(":"))
    return (int(days) if days else 0) * 86400 + h * 3600 + m * 60 + sec


def ended(n: int) -> Any:
    return lambda t: len(t) == n and all(s in ENDED for s, _ in t.values())


def saved_by(out: Path, shard: str) -> int:
    """Samples the shard's journal holds as saved (the independent reader)."""
    jdir = out / ".eagle3d" / "journal" / shard
    recs = crashcheck.read_journal(str(jdir)).records
    return sum(1 for r in recs if r.get("kind") == "sample_saved")


def last_record(out: Path, shard: str, kinds: tuple[str, ...]) -> dict[str, Any]:
    jdir = out / ".eagle3d" / "journal" / shard
    recs = [r for r in crashcheck.read_journal(str(jdir)).records if r.get("kind") in kinds]
    return recs[-1] if recs else {}


def once(out: Path) -> dict[str, Any]:
    """``eagle3-top --output OUT --once --json``: the document, its exit status in ``_rc``."""
    r = subprocess.run(
        [sys.executable, "-m", "eagle3top", "--output", str(out), "--once", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    doc: dict[str, Any] = json.loads(r.stdout)
    doc["_rc"] = r.returncode
    return doc


def shard_doc(doc: dict[str, Any], shard: str) -> dict[str, Any]:
    found = [s for s in doc["shards"] if s["label"] == shard]
    assert found, (shard, [s["label"] for s in doc["shards"]])
    return found[0]


def assert_exactly_once(out: Path, valid: set[int], malformed: set[int]) -> crashcheck.Check:
    """Every valid sample saved once, the malformed ones failed, nothing else; verify OK;
    the monitor over the array agrees (finished, the same counts)."""
    c = crashcheck.check_output(str(out))
    assert not c.bad, c.bad
    assert c.saved == valid, (sorted(valid - c.saved), sorted(c.saved - valid))
    assert c.failed == malformed, ("burnt", sorted(c.failed - malformed))
    assert c.temp_files == 0 and not c.leftovers
    rep = runkit.verify(out)
    assert rep["_rc"] == 0 and rep["ok"] and rep["checked"] == len(valid), rep
    doc = once(out)
    assert doc["state"] == "finished", doc["reason"]
    assert (doc["saved"], doc["failed"], doc["remaining"]) == (len(valid), len(malformed), 0)
    assert doc["total"] == len(valid) + len(malformed)
    assert all(s["state"] == "finished" for s in doc["shards"]), doc["shards"]
    return c


def job_log(where: Path) -> str:
    return "\n".join(
        f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
        for p in sorted(where.glob("slurm-*.out"))
    )


# -- the documented array job ----------------------------------------------------------------


def test_the_documented_array_job(cluster: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """docs/slurm.md's script, 4 tasks over one output, 2 at a time (the other two queue)."""
    data, out = tmp_path / "data.jsonl", tmp_path / "hs"
    valid, bad = runkit.dataset(data, 80)
    job = submit(tmp_path, tiny_model_dir, data, out, "0-3%2")
    t = wait_tasks(job, lambda t: len(t) == 4, "the array's 4 tasks")
    queued = wait_tasks(
        job,
        lambda t: (
            sum(s == "RUNNING" for s, _ in t.values()) == 2
            or sum(s in ENDED for s, _ in t.values()) >= 2
        ),
        "two tasks running",
    )
    assert sum(s == "RUNNING" for s, _ in queued.values()) <= 2, queued
    t = wait_tasks(job, ended(4), "the array's end")
    assert all(s == "COMPLETED" for s, _ in t.values()), (t, job_log(tmp_path))
    for k in range(4):
        assert show(f"{job}_{k}")["ExitCode"] == "0:0"
    assert sorted(os.path.basename(d) for d in crashcheck.journal_dirs(str(out))) == [
        f"shard-{k}-of-4" for k in range(4)
    ]
    assert_exactly_once(out, valid, bad)


# -- Slurm's faults --------------------------------------------------------------------------

#: A run slow enough to act on mid-run: the worker rests after every batch, with at most 4
#: requests in flight, so a drain ends in a few seconds (well inside Slurm's KillWait).
SLOW = "worker_slow:400"
WINDOW = ("--concurrency", "4")


def test_scancel_of_one_task_then_resubmission(
    cluster: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``scancel JOB_1`` mid-run signals every process of the task (daemon, workers, batch
    shell): a clean drain (``run_stopped``, exit 0), nothing failed; the monitor says stopped,
    resumable; the same sbatch again finishes the job exactly once."""
    data, out = tmp_path / "data.jsonl", tmp_path / "hs"
    valid, bad = runkit.dataset(data, 60)
    job = submit(tmp_path, tiny_model_dir, data, out, "0-1", *WINDOW, fault=SLOW)
    runkit.wait_for(lambda: saved_by(out, "shard-1-of-2") >= 3, 120, "shard 1's first saves")
    subprocess.run(["scancel", f"{job}_1"], check=True, timeout=30)
    t = wait_tasks(job, lambda t: t.get(1, ("",))[0] in ENDED, "task 1's end")
    assert t[1][0] == "CANCELLED", t
    stop = last_record(out, "shard-1-of-2", ("run_stopped", "run_finished"))
    assert stop.get("kind") == "run_stopped" and stop.get("exit_code", 0) == 0, stop
    assert "resumable" in (tmp_path / f"slurm-{job}_1.out").read_text()
    doc = once(out)
    s1 = shard_doc(doc, "shard-1-of-2")
    assert s1["state"] == "stopped" and "resumable" in s1["reason"], s1
    assert s1["alive"] is False and s1["remaining"] > 0, s1
    c = crashcheck.check_output(str(out))
    assert not c.bad and not (c.failed - bad), (c.bad, c.failed)
    wait_tasks(job, ended(2), "task 0's end")
    again = submit(tmp_path, tiny_model_dir, data, out, "0-1", *WINDOW)
    t = wait_tasks(again, ended(2), "the resubmitted array's end")
    assert all(s == "COMPLETED" for s, _ in t.values()), (t, job_log(tmp_path))
    assert "nothing to do" in (tmp_path / f"slurm-{again}_0.out").read_text()
    assert_exactly_once(out, valid, bad)


def test_scontrol_requeue_of_a_running_task(
    cluster: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Preemption: ``scontrol requeue`` of a running ``--requeue`` task. Slurm stops it
    (SIGTERM to the task's processes), keeps it pending, then runs it again: the monitor
    says stopped, resumable while it waits, running again once it runs; the job ends
    exactly once."""
    data, out = tmp_path / "data.jsonl", tmp_path / "hs"
    valid, bad = runkit.dataset(data, 60)
    job = submit(tmp_path, tiny_model_dir, data, out, "0-1", *WINDOW, fault=SLOW)
    runkit.wait_for(lambda: saved_by(out, "shard-0-of-2") >= 3, 120, "shard 0's first saves")
    subprocess.run(["scontrol", "requeue", f"{job}_0"], check=True, timeout=30)
    wait_tasks(job, lambda t: t.get(0, ("",))[0] == "PENDING", "task 0 requeued (pending)")
    assert show(f"{job}_0")["Restarts"] == "1"
    runkit.wait_for(
        lambda: (
            last_record(out, "shard-0-of-2", ("run_started", "run_stopped")).get("kind")
            == "run_stopped"
        ),
        60,
        "shard 0's run_stopped",
    )
    # Slurm holds a requeued job back (BeginTime, 2 minutes); the monitor's word meanwhile:
    state, reason = tasks(job)[0]
    assert state == "PENDING", (state, reason)
    s0 = shard_doc(once(out), "shard-0-of-2")
    assert s0["state"] == "stopped" and "resumable" in s0["reason"], s0
    assert s0["alive"] is False and s0["level"] == "WARNING", s0
    stop = last_record(out, "shard-0-of-2", ("run_stopped",))
    assert stop.get("exit_code", 0) == 0, stop
    # ... then it runs again (brought forward: the test does not wait Slurm's 2 minutes).
    subprocess.run(["scontrol", "update", f"jobid={job}_0", "starttime=now"], check=True)
    wait_tasks(job, lambda t: t.get(0, ("",))[0] == "RUNNING", "task 0 running again")
    runkit.wait_for(
        lambda: (
            shard_doc(once(out), "shard-0-of-2")["state"]
            in ("starting", "loading", "running", "finished")
        ),
        60,
        "the monitor to see shard 0 again",
    )
    t = wait_tasks(job, ended(2), "the array's end")
    assert all(s == "COMPLETED" for s, _ in t.values()), (t, job_log(tmp_path))
    starts = [
        r
        for r in crashcheck.read_journal(str(out / ".eagle3d/journal/shard-0-of-2")).records
        if r.get("kind") == "run_started"
    ]
    assert len(starts) == 2 and starts[1]["already_saved"] > 0, starts
    assert_exactly_once(out, valid, bad)


def test_time_limit_with_signal_drains_cleanly(
    cluster: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``--signal=B:TERM@60``, the time limit then brought near with ``scontrol update
    jobid=... TimeLimit=`` once the daemon saves (1-2 minutes left: on a loaded machine a
    short ``--time`` had Slurm's 30 s time-limit tick, which sends the signal up to 30 s
    early, land in the model's load, a clean stop "while starting" that shows no drain).
    Slurm signals the batch shell, which passes SIGTERM to the daemon mid-run: a clean drain,
    exit 0 before the limit (COMPLETED, not TIMEOUT), "resumable"; the monitor agrees; a
    resubmission finishes the job."""
    data, out = tmp_path / "data.jsonl", tmp_path / "hs"
    valid, bad = runkit.dataset(data, 297)
    job = submit(
        tmp_path,
        tiny_model_dir,
        data,
        out,
        "0",
        *WINDOW,
        sbatch=("--time=10", "--signal=B:TERM@60"),
        fault="worker_slow:1500",
    )
    runkit.wait_for(lambda: saved_by(out, "shard-0-of-1") >= 3, 180, "the first saves")
    ran = _seconds(show(f"{job}_0")["RunTime"])
    limit = ran // 60 + 2  # minutes: 60-120 s left, the signal due within the next ticks
    subprocess.run(
        ["scontrol", "update", f"jobid={job}_0", f"TimeLimit={limit}"], check=True, timeout=30
    )
    assert show(f"{job}_0")["TimeLimit"] in (f"00:{limit:02d}:00", f"{limit:02d}:00")
    t = wait_tasks(job, ended(1), "the task's end", timeout=240)
    log = (tmp_path / f"slurm-{job}_0.out").read_text()
    assert t[0][0] == "COMPLETED", (t, log[-3000:])
    assert show(f"{job}_0")["ExitCode"] == "0:0"
    stop = last_record(out, "shard-0-of-1", ("run_stopped", "run_finished"))
    assert stop.get("kind") == "run_stopped" and stop.get("exit_code", 0) == 0, stop
    assert stop["reason"] == "signal SIGTERM", stop  # mid-run, not "... while starting"
    assert "resumable" in log, log[-3000:]
    s0 = shard_doc(once(out), "shard-0-of-1")
    assert s0["state"] == "stopped" and "resumable" in s0["reason"], s0
    c = crashcheck.check_output(str(out))
    assert not c.bad and not (c.failed - bad), (c.bad, c.failed)
    assert 0 < len(c.saved) < len(valid), len(c.saved)
    again = submit(tmp_path, tiny_model_dir, data, out, "0")
    t = wait_tasks(again, ended(1), "the resubmission's end")
    assert t[0][0] == "COMPLETED", job_log(tmp_path)
    assert_exactly_once(out, valid, bad)


def test_a_node_drained_while_a_task_runs(
    cluster: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``scontrol update nodename=... state=drain`` while task 0 runs: it runs to its end,
    task 1 waits (the monitor shows only what ran); ``state=resume`` lets it run; exactly
    once at the end."""
    data, out = tmp_path / "data.jsonl", tmp_path / "hs"
    valid, bad = runkit.dataset(data, 40)
    job = submit(tmp_path, tiny_model_dir, data, out, "0-1%1", *WINDOW, fault=SLOW)
    runkit.wait_for(lambda: saved_by(out, "shard-0-of-2") >= 2, 120, "shard 0's first saves")
    try:
        subprocess.run(
            ["scontrol", "update", f"nodename={cluster}", "state=drain", "reason=eagle3d-test"],
            check=True,
            timeout=30,
        )
        t = wait_tasks(job, lambda t: t.get(0, ("",))[0] in ENDED, "task 0's end")
        assert t[0][0] == "COMPLETED", (t, job_log(tmp_path))
        assert tasks(job)[1][0] == "PENDING"
        doc = once(out)
        assert [s["label"] for s in doc["shards"]] == ["shard-0-of-2"], doc["shards"]
        assert doc["shards"][0]["state"] == "finished", doc["shards"]
        node = subprocess.run(
            ["sinfo", "-h", "-n", cluster, "-o", "%T"], capture_output=True, text=True
        ).stdout.strip()
        assert node.startswith("drain"), node
    finally:
        subprocess.run(["scontrol", "update", f"nodename={cluster}", "state=resume"], check=True)
    t = wait_tasks(job, ended(2), "task 1's end after the resume")
    assert all(s == "COMPLETED" for s, _ in t.values()), (t, job_log(tmp_path))
    assert_exactly_once(out, valid, bad)
