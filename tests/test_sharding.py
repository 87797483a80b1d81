"""Sharding without a cluster: the documented sbatch script, the shard from the environment
(Slurm, torchrun, Kubernetes), and a change of the shard count between runs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import crashcheck
import pytest
import runkit
from eagle3d import config
from eagle3d.core.reshard import OtherJournal, refusal, settle
from eagle3d.core.sample import PENDING, SKIPPED
from eagle3d.exitcodes import CODES
from eagle3proto import events as ev
from eagle3proto import layouts, reducer
from eagle3proto.paths import Shard
from eagle3top.model import OK, Row, health, totals

REPO = Path(__file__).resolve().parent.parent


def test_the_slurm_doc_shows_the_tested_script() -> None:
    """docs/slurm.md's script is docs/eagle3d-array.sbatch, byte for byte: the file that
    tests/test_slurm.py submits to a real Slurm."""
    doc = (REPO / "docs" / "slurm.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```\n", doc, flags=re.S)
    assert blocks, "no sh block in docs/slurm.md"
    assert blocks[0] == (REPO / "docs" / "eagle3d-array.sbatch").read_text()


# -- a change of the shard count: the rule, pure ------------------------------------------------


def _journal(shard: Shard, *events: ev.Event, locked: bool = False) -> OtherJournal:
    o = OtherJournal(shard, locked=locked, owner="pid 7 on nodeA" if locked else "")
    o.sink(list(events))
    return o


def _saved_rec(idx: int) -> ev.SampleSaved:
    return ev.SampleSaved(
        idx=idx, path=f"rows_0-2000/data_{idx}.ckpt", bytes=1, tokens=1, checksum=""
    )


START = ev.RunStarted(ts=1.0, total=5, job=ev.JobInfo(shard_index=1, shard_count=4))


def test_a_live_daemon_of_another_layout_refuses_the_start() -> None:
    why = refusal(Shard(0, 3), [_journal(Shard(1, 4), START, locked=True)])
    assert "4-shard layout is running: shard-1-of-4 (pid 7 on nodeA)" in why
    assert "shard 0/3" in why


@pytest.mark.parametrize(
    ("tail", "refused"),
    [
        ((ev.SampleSent(idx=1),), True),  # killed with a sample in flight
        ((ev.SampleSent(idx=1), ev.SampleDumped(idx=1)), True),  # ... or committing
        ((ev.SampleSent(idx=1), _saved_rec(1)), False),  # killed, nothing in flight
        ((ev.SampleSent(idx=1), ev.RunStopped(reason="signal SIGTERM")), False),
        ((ev.SampleSent(idx=1), _saved_rec(1), ev.RunFinished(saved=1)), False),
        ((), False),  # killed during the model load
    ],
)
def test_a_dead_daemon_refuses_only_with_samples_in_flight(
    tail: tuple[ev.Event, ...], refused: bool
) -> None:
    why = refusal(Shard(0, 3), [_journal(Shard(1, 4), START, *tail)])
    assert bool(why) == refused, why
    if refused:
        assert "shard-1-of-4 ended without run_stopped" in why and "--shard 1/4" in why


def test_settle_leaves_what_other_layouts_settled_to_them() -> None:
    """Saved or failed for good elsewhere: not this shard's. Pending again elsewhere (a
    retry, a signal's failure an older version recorded, a repair): this shard's."""
    old = _journal(
        Shard(1, 4),
        START,
        _saved_rec(1),
        ev.SampleFailed(idx=5, error="bad_json", message="line 6"),
        ev.SampleFailed(idx=9, error="ProducerCrashed", message="exited with code -15"),
        _saved_rec(13),
        ev.SampleInvalid(idx=13),
        ev.SampleFailed(idx=17, error="Timeout", retry=True),
    )
    status = bytearray(20)
    status[3] = SKIPPED  # a blank line
    taken = settle(status, Shard(1, 2), [old])
    assert taken == 2
    assert [i for i in range(1, 20, 2) if status[i] == SKIPPED] == [1, 3, 5]
    assert all(status[i] == PENDING for i in (7, 9, 11, 13, 15, 17, 19))
    assert all(status[i] == PENDING for i in range(0, 20, 2))  # not this shard's: untouched


def test_the_newest_session_names_the_current_layout() -> None:
    assert layouts.current_count([(4, 10.0), (4, 12.0), (3, 20.0), (6, 15.0)]) == 3
    assert layouts.current_count([]) == 0
    s = reducer.apply_all(
        reducer.new_state(),
        [START, _saved_rec(1), ev.RunStopped(reason="signal SIGTERM")],
    )
    assert layouts.closed_by(s, 4) == 0 and layouts.closed_by(s, 3) == 3
    closed = layouts.closed_view(s, 3)
    assert (closed.total, closed.state, s.total, s.state) == (1, "finished", 5, "stopped")
    assert "3-shard layout" in closed.state_reason


def _row(output: str, shard: Shard, ts: float, saved: int, total: int) -> Row:
    job = ev.JobInfo(output=output, shard_index=shard.index, shard_count=shard.count)
    s = reducer.apply_all(
        reducer.new_state(),
        [
            ev.RunStarted(ts=ts, total=total, job=job),
            *(_saved_rec(shard.index + shard.count * k) for k in range(saved)),
            ev.RunStopped(ts=ts + 1, reason="signal SIGTERM"),
        ],
    )
    return Row(label=shard.name, output=output, state=s, alive=False)


def test_the_monitor_closes_the_old_layout_of_each_job_it_watches() -> None:
    """Job A went from 2 shards to 3; job B (another output, one shard, newer than all of
    A's sessions) is its own job: its count closes nothing of A's."""
    a_old = _row("/a", Shard(0, 2), 10.0, saved=4, total=10)
    a_new = _row("/a", Shard(0, 3), 20.0, saved=1, total=5)
    b = _row("/b", Shard(0, 1), 30.0, saved=2, total=9)
    rows = [a_old, a_new, b]
    tot = totals(rows, 100.0)
    assert [r.closed_by for r in rows] == [3, 0, 0]
    assert (tot.total, tot.saved) == (4 + 5 + 9, 4 + 1 + 2)
    h = health(a_old, 100.0)
    assert (h.state, h.level) == ("finished", OK) and "3-shard layout" in h.reason, h
    assert health(a_new, 100.0).state == "stopped"


# -- a change of the shard count: real daemons ---------------------------------------------------


def _layout(model: Path, data: Path, out: Path, full: list[int], stopped: list[int], n: int) -> str:
    """Run shards ``full`` of layout ``n`` to their end and ``stopped`` until each has saved a
    few samples, then SIGTERM them (a clean stop), all at once; returns their logs."""
    procs: dict[int, tuple[Any, Path]] = {}
    tmp = out.parent
    for k in full + stopped:
        log = tmp / f"{k}-of-{n}.log"
        extra = ["--socket", f"{tmp}/{k}-of-{n}.sock", "--dump-dir", f"{tmp}/{k}-of-{n}.dumps"]
        slow = ("--concurrency", "2") if k in stopped else ()
        fault = "worker_slow:300" if k in stopped else ""
        procs[k] = (
            runkit.start(
                model, data, out, "--shard", f"{k}/{n}", *FAST, *slow, *extra, fault=fault, log=log
            ),
            log,
        )
    try:
        for k in stopped:
            proc, log = procs[k]
            jdir = out / ".eagle3d" / "journal" / f"shard-{k}-of-{n}"
            runkit.wait_for(lambda j=jdir: _saved(j) >= 3, 180, f"shard {k}/{n}'s first saves")
            proc.send_signal(signal.SIGTERM)
        for k, (proc, log) in procs.items():
            assert runkit.exit_code(proc, 300, log) == 0, log.read_text()[-3000:]
            if k in stopped:
                assert "resumable" in log.read_text()
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return "".join(log.read_text() for _, log in procs.values())


def _saved(jdir: Path) -> int:
    recs = crashcheck.read_journal(str(jdir)).records
    return sum(1 for r in recs if r.get("kind") == "sample_saved")


#: One worker each: several daemons at once on a small machine.
FAST = ("--workers", "1")


def test_a_4_shard_job_resharded_to_3_then_6_exactly_once(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Layout 4 (one shard stopped mid-run, one finished, two never started), then layout
    3 (one stopped mid-run, one finished, one never started), then layout 6 to the end:
    every valid sample saved exactly once, each in one journal; the malformed ones failed
    once; verify and the monitor read the three layouts as one job."""
    m, data, out = tiny_model_dir, tmp_path / "data.jsonl", tmp_path / "out"
    valid, bad = runkit.dataset(data, 60)
    _layout(m, data, out, full=[0], stopped=[1], n=4)
    logs = _layout(m, data, out, full=[1], stopped=[2], n=3)
    assert "shard count changed to 3" in logs, logs[-2000:]
    mid = crashcheck.check_output(str(out))
    assert not mid.bad and not (mid.failed - bad), (mid.bad, mid.failed)
    doc = _once(out)
    assert doc["saved"] == len(mid.saved) and doc["failed"] == len(mid.failed), doc
    closed = {s["label"]: s for s in doc["shards"] if s["label"].endswith("-of-4")}
    assert all(
        s["state"] == "finished" and "3-shard layout" in s["reason"] for s in closed.values()
    )
    assert all(s["remaining"] == 0 for s in closed.values()), closed
    _layout(m, data, out, full=list(range(6)), stopped=[], n=6)
    c = crashcheck.check_output(str(out))
    assert not c.bad, c.bad
    assert c.saved == valid and c.failed == bad, (sorted(valid - c.saved), c.failed)
    assert c.temp_files == 0 and not c.leftovers
    by_layout: dict[int, set[int]] = {n: set() for n in (3, 4, 6)}
    for jdir in crashcheck.journal_dirs(str(out)):
        n = int(jdir.rsplit("-of-", 1)[1])
        recs = crashcheck.read_journal(jdir).records
        by_layout[n] |= {r["idx"] for r in recs if r.get("kind") == "sample_saved"}
    assert all(by_layout.values()), "each layout saved some"
    assert sum(map(len, by_layout.values())) == len(valid)  # each in exactly one journal
    rep = runkit.verify(out)
    assert rep["_rc"] == 0 and rep["ok"] and rep["checked"] == len(valid), rep
    assert rep["saved"] == len(valid) and rep["failed"] == len(bad)
    assert {s["shard"] for s in rep["shards"] if s["closed_by"] == 6} == {
        "shard-1-of-3",
        "shard-2-of-3",
        "shard-0-of-4",
        "shard-1-of-4",
    }
    doc = _once(out)
    assert (doc["state"], doc["_rc"]) == ("finished", 0), doc["reason"]
    assert (doc["saved"], doc["failed"], doc["remaining"]) == (len(valid), len(bad), 0)
    assert doc["total"] == len(valid) + len(bad)
    r = subprocess.run(
        [sys.executable, "-m", "eagle3d", "report", "-o", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    tot = json.loads(r.stdout)["total"]
    assert (tot["saved"], tot["failed"], tot["left"]) == (len(valid), len(bad), 0), tot
    assert tot["total"] == len(valid) + len(bad)


def _once(out: Path) -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-m", "eagle3top", "--output", str(out), "--once", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    doc: dict[str, Any] = json.loads(r.stdout)
    doc["_rc"] = r.returncode
    return doc


# -- the shard from the launcher's variables ----------------------------------------------------


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, Shard(0, 1)),
        ({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "8"}, Shard(3, 8)),
        ({"RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "0"}, Shard(5, 6)),  # torchrun
        ({"JOB_COMPLETION_INDEX": "2", "EAGLE3D_SHARD_COUNT": "3"}, Shard(2, 3)),  # Kubernetes
        ({"JOB_COMPLETION_INDEX": "0", "EAGLE3D_SHARD_COUNT": "1"}, Shard(0, 1)),
        # first match wins: a Slurm array over torchrun over Kubernetes
        (
            {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2", "RANK": "3"},
            Shard(1, 2),
        ),
        ({"RANK": "1", "WORLD_SIZE": "2", "JOB_COMPLETION_INDEX": "4"}, Shard(1, 2)),
    ],
)
def test_the_shard_from_the_launchers_variables(env: dict[str, str], want: Shard) -> None:
    assert config.JobConfig(model="m", dataset="d", output="o").shard_spec(env) == want


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"JOB_COMPLETION_INDEX": "2"}, "EAGLE3D_SHARD_COUNT"),  # N never guessed
        ({"JOB_COMPLETION_INDEX": "3", "EAGLE3D_SHARD_COUNT": "3"}, "need 0 <= I < N"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK/WORLD_SIZE"),
    ],
)
def test_bad_launcher_variables_are_refused(env: dict[str, str], words: str) -> None:
    with pytest.raises(config.ConfigError, match=re.escape(words)):
        config.JobConfig(model="m", dataset="d", output="o").shard_spec(env)


def test_the_documented_indexed_job_gives_every_pod_its_shard() -> None:
    """docs/kubernetes.md shows docs/eagle3d-indexed-job.yaml; the manifest's
    EAGLE3D_SHARD_COUNT is its completions, and pods 0..N-1 get shards 0/N..N-1/N."""
    import yaml

    path = REPO / "docs" / "eagle3d-indexed-job.yaml"
    doc = (REPO / "docs" / "kubernetes.md").read_text()
    assert re.findall(r"```yaml\n(.*?)```\n", doc, flags=re.S)[0] == path.read_text()
    job = yaml.safe_load(path.read_text())
    assert job["kind"] == "Job" and job["spec"]["completionMode"] == "Indexed"
    n = job["spec"]["completions"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env[config.SHARD_COUNT_VARIABLE] == str(n)
    cfg = config.JobConfig(model="m", dataset="d", output="o")
    got = [cfg.shard_spec({**env, "JOB_COMPLETION_INDEX": str(i)}) for i in range(n)]
    assert got == [Shard(i, n) for i in range(n)]
    refused = set(job["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"])
    # What systemd does not restart, less 5 (LOCKED): a pod replacing one that still drains
    # finds the shard locked for a while; the Job's next pod gets it.
    assert refused == {c.code for c in CODES if not c.restart and c.code} - {5}
