"""``eagle3-top --once --format prometheus`` and ``--textfile``: parsed by the official
``prometheus_client`` parser, against a real daemon's committed files, written atomically."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import runkit
from eagle3proto import events as ev
from eagle3proto import paths
from eagle3top import once, prometheus
from eagle3top.model import Row
from monitor_helpers import EAGLE3_TOP, PY, hold_lock, run_events, stats, top, write_journal
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(180)


def families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def by_shard(text: str, name: str) -> dict[str, float]:
    return {dict(k)["shard"]: v for k, v in samples(text, name).items()}


@pytest.fixture(scope="module")
def finished_job(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real daemon run to its end on 24 demo lines (three of them malformed)."""
    base = tmp_path_factory.mktemp("prom")
    data, out = base / "data.jsonl", base / "out"
    runkit.dataset(data, 21)
    p = runkit.run(tiny_model_dir, data, out, "--workers", "1")
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def test_the_saved_counter_is_the_committed_files(finished_job: Path) -> None:
    p = top("--once", "--format", "prometheus", "--output", str(finished_job))
    assert p.returncode == 0, p.stdout
    files = sorted(finished_job.rglob("*.ckpt"))
    fams = families(p.stdout)
    saved = by_shard(p.stdout, "eagle3d_samples_saved_total")
    assert saved == {"shard-0-of-1": len(files)} and len(files) == 21
    assert fams["eagle3d_samples_saved"].type == "counter"  # type: ignore[attr-defined]
    assert by_shard(p.stdout, "eagle3d_samples_failed_total")["shard-0-of-1"] == 3
    assert by_shard(p.stdout, "eagle3d_samples")["shard-0-of-1"] == 24
    committed = sum(f.stat().st_size for f in files)
    assert by_shard(p.stdout, "eagle3d_bytes_saved_total")["shard-0-of-1"] == committed
    # Attempts sent and dumps that arrived: one each per saved sample in a clean run.
    assert by_shard(p.stdout, "eagle3d_samples_sent_total")["shard-0-of-1"] == 21
    assert by_shard(p.stdout, "eagle3d_samples_dumped_total")["shard-0-of-1"] == 21
    state = samples(p.stdout, "eagle3d_state")
    ones = {dict(k)["shard"]: dict(k)["state"] for k, v in state.items() if v == 1}
    assert ones == {"shard-0-of-1": "finished"}
    assert by_shard(p.stdout, "eagle3d_status") == {"shard-0-of-1": 0}
    # --format json is --json, and the text line carries the same numbers as perfdata.
    j1 = json.loads(top("--once", "--json", "-o", str(finished_job)).stdout)
    j2 = json.loads(top("--once", "--format", "json", "-o", str(finished_job)).stdout)
    for d in (j1, j2):
        d.pop("now"), d.pop("age_s"), [s.pop("age_s") for s in d["shards"]]
    assert j1 == j2
    head = top("--once", "-o", str(finished_job)).stdout.splitlines()[0]
    assert head.startswith("EAGLE3D OK - finished: 21 saved, 3 failed; saved 21 / 24 (87.5%)")
    perf = dict(item.split("=", 1) for item in head.split(" | ", 1)[1].split())
    assert perf["saved"] == "21;;;0;24" and perf["failed"] == "3;;;0;24"
    assert perf["percent"] == "87.5%;;;0;100"


def test_every_family_has_help_and_type_and_shards_carry_a_label(tmp_path) -> None:
    out = str(tmp_path)
    t0 = time.time() - 100
    for i in range(2):
        evs = run_events(t0, total=10, saved=3 + i, bytes_each=500)
        evs.append(stats(time.time() - 1, free=10**12))
        write_journal(out, evs, paths.Shard(i, 2))
    with hold_lock(out, paths.Shard(0, 2)), hold_lock(out, paths.Shard(1, 2)):
        p = top("--once", "--format", "prometheus", "--output", out)
    text = p.stdout
    names = {ln.split()[2] for ln in text.splitlines() if ln.startswith("# HELP")}
    types = {ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE")}
    assert names == types and len(names) >= 25
    fams = families(text)  # the official parser accepts the whole document
    assert {"eagle3d_samples_saved", "eagle3d_eta_seconds", "eagle3d_disk_free_bytes"} <= set(fams)
    # One series per shard and no aggregate beside them: sum() is the job's total.
    saved = by_shard(text, "eagle3d_samples_saved_total")
    assert saved == {"shard-0-of-2": 3, "shard-1-of-2": 4}
    assert 'shard="total"' not in text
    free = samples(text, "eagle3d_disk_free_bytes")
    assert list(free.values()) == [10**12]  # per host, not per shard
    assert p.returncode == 0  # both running: saves 96 s ago, stats a second ago
    ones = {
        dict(k)["shard"]: dict(k)["state"] for k, v in samples(text, "eagle3d_state").items() if v
    }
    assert ones == {"shard-0-of-2": "running", "shard-1-of-2": "running"}


def test_labels_are_escaped_and_gpus_exported() -> None:
    from eagle3proto import reducer

    st = reducer.new_state()
    reducer.apply_all(st, [ev.RunStarted(ts=1.0, total=5)])
    st.stats = ev.Stats(
        ts=2.0,
        gpus=[
            ev.GpuInfo(
                index=0,
                name='H"200\\',
                util_percent=50.0,
                throttle=["hw_thermal"],
                xid_errors=2,
                last_xid=79,
                last_xid_ts=2.0,
            )
        ],
    )
    row = Row(label='sh"ard\n', host="h", output="/o", state=st, alive=True)
    doc, _ = once.build([row], 3.0)
    text = prometheus.exposition(doc)
    got = samples(text, "eagle3d_gpu_xid_errors_total")
    assert [dict(k)["name"] for k in got] == ['H"200\\'] and list(got.values()) == [2]
    assert samples(text, "eagle3d_gpu_utilization_ratio").popitem()[1] == 0.5
    throttled = samples(text, "eagle3d_gpu_throttled")
    assert [dict(k)["reason"] for k in throttled] == ["hw_thermal"]
    assert 'sh"ard\n' in by_shard(text, "eagle3d_samples_saved_total")
    assert by_shard(text, "eagle3d_status")['sh"ard\n'] == 2  # a fresh XID is critical


def test_textfile_is_written_atomically(finished_job: Path, tmp_path: Path) -> None:
    """A reader polling the file while it is rewritten sees whole documents only, and no
    temporary file is left where node_exporter's ``*.prom`` glob would read it."""
    target = tmp_path / "collector" / "eagle3d.prom"
    target.parent.mkdir()
    stop = threading.Event()
    seen: list[str] = []
    bad: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                text = target.read_text()
            except FileNotFoundError:
                continue
            seen.append(text)
            if not text.endswith("\n") or "eagle3d_gpu_throttled" not in text:
                bad.append(text)
            else:
                list(text_string_to_metric_families(text))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(8):
            p = subprocess.run(
                [EAGLE3_TOP, "--textfile", str(target), "--output", str(finished_job)],
                capture_output=True,
                text=True,
                check=False,
            )
            assert p.returncode == 0 and p.stdout == "", p.stdout  # --textfile alone is quiet
    finally:
        stop.set()
        t.join()
    assert seen and not bad
    assert os.listdir(target.parent) == ["eagle3d.prom"]
    assert oct(target.stat().st_mode & 0o777) == "0o644"
    assert by_shard(target.read_text(), "eagle3d_samples_saved_total")["shard-0-of-1"] == 21


def test_textfile_write_leaves_nothing_when_it_fails(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "x.prom"
    target.write_text("old\n")

    def boom(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        prometheus.write_textfile(str(target), "new\n")
    assert os.listdir(tmp_path) == ["x.prom"] and target.read_text() == "old\n"


def test_systemd_timer_and_service_are_shipped_and_valid() -> None:
    from test_unit_file import ANALYZE, REPO, parse_unit

    svc = REPO / "systemd" / "eagle3-top-textfile@.service"
    timer = REPO / "systemd" / "eagle3-top-textfile@.timer"
    s, t = parse_unit(svc.read_text()), parse_unit(timer.read_text())
    assert s["Service"]["Type"] == ["oneshot"]
    cmd = s["Service"]["ExecStart"][0]
    assert "--textfile" in cmd and "--output" in cmd
    assert set(s["Service"]["SuccessExitStatus"][0].split()) == {"1", "2", "3"}
    assert t["Timer"]["OnUnitActiveSec"] and t["Install"]["WantedBy"] == ["timers.target"]
    if ANALYZE is None:
        pytest.skip("systemd-analyze is not installed")
    p = subprocess.run(
        [ANALYZE, "verify", "--man=no", str(timer)], capture_output=True, text=True, check=False
    )
    # ExecStart names /opt/eagle3d (absent here): only that complaint is allowed.
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and "/opt/eagle3d" not in ln]
    assert not lines, p.stderr


def test_prometheus_and_textfile_stay_light(tmp_path: Path) -> None:
    """Like --once: a cron job or a timer pays for no Textual, Rich or torch import."""
    t0 = time.time() - 100
    write_journal(str(tmp_path), [*run_events(t0, 2, 2), ev.RunFinished(ts=t0 + 3, saved=2)])
    prom = str(tmp_path / "m.prom")
    code = (
        "import sys; from eagle3top.cli import main; rc = main(['--once', '--format', "
        f"'prometheus', '--textfile', {prom!r}, '--output', {str(tmp_path)!r}]); "
        "heavy = sorted(m for m in ('textual', 'torch', 'rich', 'sglang') if m in sys.modules); "
        "print('HEAVY', heavy, file=sys.stderr); sys.exit(rc)"
    )
    p = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=False)
    assert "HEAVY []" in p.stderr and p.returncode == 0, p.stderr
    assert p.stdout == Path(prom).read_text()  # what it prints is what it wrote


def test_textfile_into_a_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    target = tmp_path / "no-such-dir" / "eagle3d.prom"
    p = top("--textfile", str(target), "--output", str(tmp_path))
    assert p.returncode == 3, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    assert f"the folder {target.parent} does not exist" in p.stderr
    assert not target.parent.exists()
