"""``eagle3d report`` (issue 27, point 2): the whole story of a job from its journals, during
or after it: counts per shard and in total, times, the rate over the working span, every
failure grouped by reason, pauses and restarts; ``--html`` one self-contained page of plots,
opened here in a real headless Chromium (no JavaScript error, the plots drawn)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from eagle3proto import events as ev
from eagle3proto import paths
from monitor_helpers import EAGLE3_TOP, write_journal
from runkit import ENV, conversations, reaped, records, run, start, wait_for_saved, write_jsonl

pytestmark = pytest.mark.timeout(300)

T0 = 1_800_000_000.0
#: Malformed rows, more than --once's 5 and --json's 10: the report must list every one.
BAD = ["{not json", '{"messages": []}', '{"messages": [{"role": "robot", "content": "x"}]}'] * 5


def report(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "eagle3d", "report", "--output", str(out), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )


@pytest.fixture(scope="module")
def resumed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A real job of 40 good and 15 malformed rows, reported on while it runs, stopped by
    SIGTERM midway and resumed."""
    root = tmp_path_factory.mktemp("report")
    rows: list[Any] = list(conversations(40))
    for k, bad in enumerate(BAD):
        rows.insert(2 + 3 * k, bad)
    data = write_jsonl(root / "data.jsonl", rows)
    out = root / "out"
    # One worker, a small window and a rest after every batch: the stop comes midway.
    slow = ("--workers", "1", "--concurrency", "1")
    proc: subprocess.Popen[Any] = start(tiny_model_dir, data, out, *slow, fault="worker_slow:300")
    with reaped(proc):
        wait_for_saved(out, 3, proc)  # type: ignore[arg-type]
        during = report(out, "--json")
        alive = proc.poll() is None
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(120) == 0
    r = run(tiny_model_dir, data, out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "eagle3d report" not in r.stderr  # under the threshold: no failure message
    return {"out": out, "during": during, "alive": alive}


def test_report_tells_the_whole_story_of_a_resumed_job(resumed: dict[str, Any]) -> None:
    out: Path = resumed["out"]
    r = report(out, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    saved = {x["idx"] for x in records(out, "sample_saved")}
    failed = {x["idx"]: x for x in records(out, "sample_failed") if not x.get("retry")}
    tot = doc["total"]
    assert tot["saved"] == len(saved) == 40 and tot["failed"] == len(failed) == len(BAD)
    assert tot["left"] == 0 and tot["total"] == 55
    assert tot["tokens"] == sum(x["tokens"] for x in records(out, "sample_saved"))
    assert tot["bytes"] == sum(x["bytes"] for x in records(out, "sample_saved"))
    # Every failure, not the last 10: row, reason, attempts, message.
    assert {f["idx"] for f in doc["failures"]} == set(failed)
    for f in doc["failures"]:
        rec = failed[f["idx"]]
        assert (f["reason"], f["message"]) == (rec["error"], rec["message"])
        assert f["attempts"] == rec.get("attempt", 1)
    assert sum(tot["failures_by_reason"].values()) == len(BAD)
    # Two sessions: the first stopped by the signal, the second finished; one restart.
    sh = doc["shards"][0]
    assert [(s["session"], s["ended"]) for s in sh["sessions"]] == [(1, "stopped"), (2, "finished")]
    assert "SIGTERM" in sh["sessions"][0]["reason"] and sh["restarts"] == 1
    # Working time is less than wall time (the model loads and the gap between sessions).
    assert 0 < sh["working_s"] < sh["wall_s"]
    assert sh["rate_samples_s"] == pytest.approx(40 / sh["working_s"], rel=1e-3)
    text = report(out).stdout
    for f in doc["failures"]:
        assert f"sample {f['idx']} (attempts {f['attempts']}): {f['message']}" in text
    assert "session 1:" in text and "(stopped: signal SIGTERM" in text
    dur = r"[0-9.]+(?: [hm] [0-9.]+)*(?: [hm])? s"  # "7.87 s", "1 m 34 s"
    assert re.search(rf"wall {dur}, working {dur}; .* over the working span", text), text


def test_report_reads_a_running_job_without_disturbing_it(resumed: dict[str, Any]) -> None:
    r = resumed["during"]
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["shards"][0]["sessions"][0]["ended"] == "running"
    assert doc["total"]["saved"] >= 3 and doc["total"]["left"] > 0
    assert resumed["alive"]  # and the daemon went on (it then stopped cleanly on SIGTERM)


def test_the_exit_9_message_points_at_report(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", [*conversations(3), *BAD[:3]])
    out = tmp_path / "out"
    r = run(tiny_model_dir, data, out, "--max-failed-fraction", "0.1")
    assert r.returncode == 9
    assert "every one, by reason: eagle3d report --output OUTPUT" in r.stderr, r.stderr[-2000:]


def test_no_journal_is_exit_3(tmp_path: Path) -> None:
    r = report(tmp_path)
    assert r.returncode == 3 and "no journal" in r.stderr and "Traceback" not in r.stderr


# -- a journal with pauses, GPU readings and two shards, and the page in a browser ----------


def _shard_events(shard: int, gpus: bool) -> list[ev.Event]:
    t = T0 + shard
    out: list[ev.Event] = [
        ev.RunStarted(ts=t, total=40, job=ev.JobInfo(model="m", shard_index=shard, shard_count=2)),
        ev.RunState(ts=t + 5, state="running"),
    ]
    used = 10**9
    for i in range(40):
        t += 1
        if i == 20:
            out.append(ev.RunState(ts=t, state="paused", reason="disk full writing to /o"))
            t += 30
            out.append(ev.RunState(ts=t, state="running", reason="resumed"))
        idx = 2 * i + shard
        out.append(ev.SampleSent(ts=t - 0.5, idx=idx, tokens=100))
        if i % 13 == 7:
            out.append(ev.SampleFailed(ts=t, idx=idx, error="no_loss", message=f"row {idx} bad"))
            continue
        out.append(
            ev.SampleSaved(
                ts=t, idx=idx, path=paths.sample_relpath(idx), bytes=10**6, tokens=100, checksum="0"
            )
        )
        used += 10**6
        g = [ev.GpuInfo(index=0, name="H200", util_percent=50.0 + i)] if gpus else []
        out.append(
            ev.Stats(
                ts=t + 0.1,
                disk=[
                    ev.DiskUsage(
                        label="output",
                        path="/o",
                        total_bytes=10**10,
                        used_bytes=used,
                        free_bytes=10**10 - used,
                    )
                ],
                gpus=g,
            )
        )
    out.append(ev.RunFinished(ts=t + 1, saved=37, failed=3))
    return out


@pytest.fixture(scope="module")
def two_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("two") / "out"
    for k in range(2):
        write_journal(str(out), _shard_events(k, gpus=True), paths.Shard(k, 2))
    return out


def test_pauses_and_shards_add_up(two_shards: Path) -> None:
    doc = json.loads(report(two_shards, "--json").stdout)
    assert [d["shard"] for d in doc["shards"]] == ["shard-0-of-2", "shard-1-of-2"]
    for d in doc["shards"]:
        assert d["saved"] == 37 and d["failed"] == 3 and d["left"] == 0
        assert [(p["seconds"], p["cause"]) for p in d["pauses"]] == [
            (30.0, "disk full writing to /o")
        ]
        assert d["paused_s"] == 30.0
        # Working: from running (t+5) to the finish, less the 30 s paused.
        assert d["working_s"] == pytest.approx(d["wall_s"] - 5 - 30)
    assert doc["total"]["saved"] == 74 and doc["total"]["failures_by_reason"] == {"no_loss": 6}
    assert len(doc["failures"]) == 6


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: scripts/test_tools installs it (Debian's package)")
        pytest.skip("chromium not installed (scripts/test_tools installs it)")
    return exe


def _render(page: Path, home: Path) -> tuple[str, list[str]]:
    """The page's DOM after its scripts ran in headless Chromium, and its console errors."""
    p = subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=15000",
            f"--user-data-dir={home}",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HOME": str(home)},
    )
    assert p.returncode == 0, p.stderr[-2000:]
    errors = [
        ln
        for ln in p.stderr.splitlines()
        if ":CONSOLE" in ln and ("Uncaught" in ln or "Error" in ln or ":ERROR:CONSOLE" in ln)
    ]
    return p.stdout, errors


def test_the_console_check_catches_a_script_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>throw new Error('e3d-boom')</script></body></html>")
    _, errors = _render(bad, tmp_path / "home")
    assert any("e3d-boom" in e for e in errors), errors


def test_the_html_page_renders_its_plots_in_chromium(two_shards: Path, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    r = report(two_shards, "--html", str(page))
    assert r.returncode == 0, r.stderr
    text = page.read_text()
    assert "<script" in text and "cdn." not in text.split("plotly.js")[0][:200]
    assert 'src="http' not in text  # self-contained: nothing fetched
    dom, errors = _render(page, tmp_path / "home")
    assert errors == [], errors
    # Five plots (saved, tokens/s, disk, depths, GPU) drawn as SVG, each with its traces.
    assert dom.count('class="main-svg"') >= 2
    titles = re.findall(r'class="g-gtitle"|data-unformatted="([^"]+)"', dom)
    for want in ("samples saved and failed", "tokens/s", "output disk used", "in flight", "GPU"):
        assert any(want in t for t in titles), (want, titles[:20])
    assert dom.count("trace scatter") >= 2 * 8  # two shards' traces
    assert "paused" in dom  # the pause shading's label
    assert "no_loss" in dom and "row 14 bad" in dom  # the failures' table


def test_once_never_imports_plotly(two_shards: Path) -> None:
    code = (
        "import sys\n"
        "from eagle3top import cli\n"
        f"try:\n    cli.main(['--once', '--output', {str(two_shards)!r}])\n"
        "except SystemExit:\n    pass\n"
        "assert 'plotly' not in sys.modules, 'plotly imported'\n"
        "print('clean')\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=ENV
    )
    assert p.stdout.strip().endswith("clean"), p.stderr[-2000:]
    assert os.path.exists(EAGLE3_TOP)
