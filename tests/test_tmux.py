"""The real ``eagle3-top`` in a real terminal (tmux), reading the screen like a person would.

Two producers of events: the real event-source process (JournalWriter + EventServer), and
the real daemon (``eagle3d run`` on the tiny model). TERM is xterm-256color with no
COLORTERM, as over ssh.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import pytest
from eagle3proto import paths
from eagle3top.sources import read_journal
from monitor_helpers import EAGLE3_TOP, event_source

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed"),
]
_ids = itertools.count()


class Tmux:
    """One detached tmux session on a private server socket."""

    def __init__(self, command: list[str], width: int = 120, height: int = 40) -> None:
        self.server = f"eagle3top-test-{os.getpid()}-{next(_ids)}"
        env = {k: v for k, v in os.environ.items() if k not in ("COLORTERM", "TMUX")}
        env["TERM"] = "xterm-256color"
        self.env = env
        cmd = " ".join(subprocess.list2cmdline([c]) for c in command)
        self._tmux("new-session", "-d", "-s", "main", "-x", str(width), "-y", str(height), cmd)

    def _tmux(self, *args: str) -> str:
        p = subprocess.run(
            ["tmux", "-L", self.server, "-f", "/dev/null", *args],
            capture_output=True,
            text=True,
            env=self.env,
            check=False,
        )
        return p.stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "main")

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "main", *keys)

    def alive(self) -> bool:
        return "main" in self._tmux("list-sessions", "-F", "#{session_name}")

    def wait_screen(self, pred, timeout: float = 30.0) -> str:  # type: ignore[no-untyped-def]
        end = time.monotonic() + timeout
        text = ""
        while time.monotonic() < end:
            text = self.screen()
            if pred(text):
                return text
            time.sleep(0.2)
        raise AssertionError(f"screen never matched; last screen:\n{text}")

    def kill(self) -> None:
        self._tmux("kill-server")


def saved_on_screen(text: str) -> int:
    """The number under 'saved' in the Pipeline panel."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.search(r"\bsent\s+dumped\s+saved\s+failed\b", line):
            nums = re.findall(r"[\d,]+", lines[i + 1])
            return int(nums[2].replace(",", ""))
    raise AssertionError("no pipeline panel on screen:\n" + text)


def test_tmux_against_the_event_source(tmp_path) -> None:
    out = str(tmp_path)
    with event_source(out, "--total", "100000", "--rate", "300", "--bytes", "1000") as proc:
        t = Tmux([EAGLE3_TOP, "--output", out, "--interval", "0.5"])
        try:
            s = t.wait_screen(lambda s: "live (socket)" in s and saved_on_screen(s) > 0)
            assert "RUNNING" in s and "Pipeline" in s and "Throughput" in s and "Disk" in s
            assert "GPU" in s and "Recent errors" in s and "Producer" in s
            first = saved_on_screen(s)
            t.wait_screen(lambda s: saved_on_screen(s) > first)  # it moves
            t.keys("p")
            s = t.wait_screen(lambda s: "SCREEN FROZEN" in s)
            frozen = saved_on_screen(s)
            time.sleep(1.5)
            assert saved_on_screen(t.screen()) == frozen  # frozen: the numbers hold still
            t.keys("p")
            t.wait_screen(lambda s: "SCREEN FROZEN" not in s and saved_on_screen(s) > frozen)
            t.keys("?")
            t.wait_screen(lambda s: "press any key to close" in s)
            t.keys("Escape")
            t.wait_screen(lambda s: "press any key to close" not in s)
            proc.terminate()  # a clean stop: the monitor must say so, not freeze
            proc.wait(10)
            s = t.wait_screen(lambda s: "daemon down" in s and "STOPPED" in s)
            jstate, _ = read_journal(paths.journal_dir(out, paths.Shard()))
            t.wait_screen(lambda s: saved_on_screen(s) == jstate.saved)
            t.keys("q")
            end = time.monotonic() + 10
            while t.alive() and time.monotonic() < end:
                time.sleep(0.1)
            assert not t.alive()
        finally:
            t.kill()


@pytest.fixture(scope="module")
def slow_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An 8-layer h256 model: the 4-layer h64 one saves 60 samples in a third of a second
    here, between two of the TUI's refreshes, so its running state could never be seen."""
    from eagle3d.tools.tinymodel import build_tiny_model

    return Path(build_tiny_model(tmp_path_factory.mktemp("slow-model"), layers=8, hidden=256))


@pytest.mark.slow
def test_tmux_against_the_real_daemon(tmp_path, slow_model_dir) -> None:
    data = str(resources.files("eagle3d").joinpath("data/demo.jsonl"))
    subset = tmp_path / "data.jsonl"
    with open(data) as f:
        subset.write_text("".join(f.readlines()[:60]))
    out = str(tmp_path / "out")
    # The monitor first, so that it watches the whole run from the daemon's start.
    t = Tmux([EAGLE3_TOP, "--output", out, "--interval", "0.5"])
    try:
        t.wait_screen(lambda s: "eagle3-top" in s, timeout=60)
    except BaseException:
        t.kill()
        raise
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eagle3d",
            "run",
            "--model",
            str(slow_model_dir),
            "--dataset",
            str(subset),
            "--output",
            out,
            "--max-length",
            "512",
            "--dump-dir",
            str(tmp_path / "dumps"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        t.wait_screen(lambda s: "live (socket)" in s and "RUNNING" in s, timeout=60)
        assert daemon.wait(90) == 0
        s = t.wait_screen(lambda s: "FINISHED" in s, timeout=30)
        jstate, _ = read_journal(paths.journal_dir(out, paths.Shard()))
        assert jstate.state == "finished"
        assert saved_on_screen(s) == jstate.saved > 0
        assert "/ 60 saved" in s
        t.keys("q")
    finally:
        t.kill()
        if daemon.poll() is None:
            daemon.kill()


def test_80x24_shows_the_verdict_and_the_counters(tmp_path) -> None:
    """The smallest usual terminal: the verdict, the three counters, progress and the ETA
    are on screen; the rest scrolls below them."""
    out = str(tmp_path)
    with event_source(out, "--total", "100000", "--rate", "300", "--bytes", "1000"):
        t = Tmux([EAGLE3_TOP, "--output", out, "--interval", "0.5"], width=80, height=24)
        try:
            # Once the rate has a second of data since the producer came up, the ETA is known.
            s = t.wait_screen(lambda s: "RUNNING  OK" in s and re.search(r"│ ETA \d", s))
            lines = s.splitlines()
            assert len(lines) <= 24 and all(len(ln) <= 80 for ln in lines)
            assert "RUNNING  OK" in lines[0]
            assert lines[1].strip().startswith("saving; last sample saved")
            assert "● live (socket)" in lines[2]
            heads = [i for i, ln in enumerate(lines) if re.search(r"sent\s+dumped\s+saved", ln)]
            assert heads and heads[0] < 8, s
            assert any(re.search(r"\d+\.\d% .* / 100,000 saved", ln) for ln in lines), s
            assert any(re.search(r"│ ETA \d", ln) for ln in lines), s
            assert "q Quit" in lines[-1]
        finally:
            t.kill()


def test_a_shard_started_after_the_tui_appears_within_5_s(tmp_path) -> None:
    """A Slurm array's second task starts after the monitor: it shows up without a restart."""
    out = str(tmp_path)
    args = ("--total", "100000", "--rate", "100", "--bytes", "1000")
    with event_source(out, "--shard", "0/2", *args):
        t = Tmux([EAGLE3_TOP, "--output", out, "--interval", "0.5"])
        try:
            t.wait_screen(lambda s: "live (socket)" in s and saved_on_screen(s) > 0)
            assert "shard-1-of-2" not in t.screen()
            jdir = paths.journal_dir(out, paths.Shard(1, 2))
            with event_source(out, "--shard", "1/2", *args):
                assert os.path.isdir(jdir)
                born = time.monotonic()
                s = t.wait_screen(lambda s: "shard-1-of-2" in s, timeout=30)
                seen_after = time.monotonic() - born
                assert seen_after <= 5.0, f"the new shard took {seen_after:.1f} s to appear"
                assert "Shards" in s and "shard-0-of-2" in s
                t.wait_screen(lambda s: re.search(r"shard-1-of-2\s+running", s) is not None)
        finally:
            t.kill()


@pytest.mark.slow
def test_eagle3d_run_draws_one_live_progress_line_on_a_terminal(tmp_path, tiny_model_dir) -> None:
    """On a terminal the daemon redraws one progress line in place (log lines above it)."""
    data = str(resources.files("eagle3d").joinpath("data/demo.jsonl"))
    subset = tmp_path / "data.jsonl"
    with open(data) as f:
        subset.write_text("".join(f.readlines()[:40]))
    out = str(tmp_path / "out")
    cmd = [
        sys.executable,
        "-m",
        "eagle3d",
        "run",
        "--model",
        str(tiny_model_dir),
        "--dataset",
        str(subset),
        "--output",
        out,
        "--workers",
        "1",
        "--dump-dir",
        str(tmp_path / "dumps"),
    ]
    slow = ["env", "EAGLE3D_FAULT=worker_slow:300", *cmd]  # the run lasts long enough to watch
    t = Tmux(["sh", "-c", subprocess.list2cmdline(slow) + "; echo EXITED $?; sleep 600"])
    try:
        seen = set()
        end = time.monotonic() + 120
        while time.monotonic() < end:
            s = t.screen()
            progress = [ln for ln in s.splitlines() if re.search(r"saved \d+/40 \(", ln)]
            assert len(progress) <= 1, s  # in place: never a second progress line
            if progress:
                seen.add(progress[0])
            if "EXITED" in s:
                break
            time.sleep(0.3)
        assert "EXITED 0" in s, s
        assert "loading model" in s and "producer hf up" in s
        assert len(seen) >= 2  # it moved
        final = [ln for ln in s.splitlines() if "finished: saved 40/40 (100.0%)" in ln]
        assert len(final) == 1, s
        assert "saved 0/-1" not in s and "ETA 0s" not in s
    finally:
        t.kill()


_FOR_N_S = re.compile(r"loading model \S+ \(hf[^)]*\) for (\d+) s")


def test_the_header_ticks_with_once_during_a_model_load(tmp_path, tiny_model_dir) -> None:
    """Issue 27, point 11: during a 40 s model load the TUI's state line ("loading model …
    for N s") advances second by second and agrees with ``--once``'s, read between two
    captures of the screen (before: the header said "starting for 0 s" for ~10 s while
    ``--once`` said "loading … for 2 s")."""
    import runkit

    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    runkit.write_jsonl(data, runkit.conversations(5))
    proc = runkit.start(tiny_model_dir, data, out, "--workers", "1", fault="worker_slow_load:40000")
    t = Tmux([EAGLE3_TOP, "--output", str(out)])
    try:
        with runkit.reaped(proc):

            def seconds(screen: str) -> int | None:
                m = _FOR_N_S.search(screen)
                return int(m.group(1)) if m else None

            first = seconds(t.wait_screen(lambda s: seconds(s) is not None, timeout=90))
            assert first is not None
            seen = [first]
            for _ in range(3):  # three ticks, each compared with --once read between captures
                p = subprocess.run(
                    [EAGLE3_TOP, "--once", "--output", str(out)],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                m = _FOR_N_S.search(p.stdout)
                assert m, p.stdout
                told = int(m.group(1))
                later = t.wait_screen(
                    lambda s, told=told: (
                        (seconds(s) or -1) > seen[-1] and (seconds(s) or -1) >= told
                    ),
                    timeout=10,
                )
                now_shown = seconds(later)
                assert now_shown is not None
                # --once read between the two captures: within a second of both
                assert seen[-1] - 1 <= told <= now_shown + 1, (seen, told, now_shown)
                assert now_shown - told <= 2, (told, now_shown, later)
                seen.append(now_shown)
            assert seen == sorted(seen) and len(set(seen)) == len(seen), seen
    finally:
        t.kill()
