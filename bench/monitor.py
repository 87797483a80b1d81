"""Monitor benchmarks: ``eagle3-top --once`` wall time, TUI CPU under load, screen staleness.

Every figure has a baseline measured in the same run:

* ``--once`` wall time (the real console script, cold process each time) against the bare
  interpreter start of the same venv (``python -c pass``), via the socket of a live source and
  via a finished 30k-record journal;
* the TUI's CPU while a real event source (JournalWriter + EventServer, output on
  /dev/shm) emits ~1,000 records/s, against the same TUI attached to a finished, quiet
  journal; the TUI runs in a real terminal (tmux, 120x40) at the default 1 s refresh;
* the floor: ``bench/textual_floor.py``, a Textual app that repaints one line per second and
  does nothing else, run beside the TUI in a terminal of its own over the same seconds - what
  any Textual screen at 1 s refresh costs on this machine before it does any work of its own;
* staleness of ``saved`` on screen: the screen is captured every 0.2 s during the loaded
  run; for each capture showing S saved, staleness = capture time - journal ts of save
  S+1 (0 if that save had not happened yet) - how long the screen had been behind.

    .venv/bin/python bench/monitor.py [--seconds 30] [--runs 15]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from eagle3proto import events as ev  # noqa: E402
from eagle3proto import paths  # noqa: E402
from eagle3proto.journalread import iter_events  # noqa: E402
from monitor_helpers import EAGLE3_TOP, PY, run_events, write_journal  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def wall(cmd: list[str], runs: int) -> tuple[list[float], list[float]]:
    """Wall seconds and CPU seconds (user + sys of the child) of ``runs`` cold runs.

    CPU time is what the command itself costs; on a machine shared with other jobs the
    wall time also counts waiting for a core.
    """
    walls, cpus = [], []
    for _ in range(runs):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        walls.append(time.perf_counter() - t)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime))
    return walls, cpus


def start_source(output: str, rate: float, total: int = 10_000_000) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [
            PY,
            os.path.join(ROOT, "tests", "eventsource.py"),
            "--output",
            output,
            "--total",
            str(total),
            "--rate",
            str(rate),
            "--bytes",
            "1000",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    assert p.stdout.readline().startswith("ready")
    return p


class Tmux:
    def __init__(self, cmd: list[str]) -> None:
        self.server = f"eagle3top-bench-{os.getpid()}-{time.monotonic_ns()}"
        self.env = {k: v for k, v in os.environ.items() if k not in ("COLORTERM", "TMUX")}
        self.env["TERM"] = "xterm-256color"
        self.t(
            "new-session", "-d", "-s", "m", "-x", "120", "-y", "40", subprocess.list2cmdline(cmd)
        )

    def t(self, *args: str) -> str:
        return subprocess.run(
            ["tmux", "-L", self.server, "-f", "/dev/null", *args],
            capture_output=True,
            text=True,
            env=self.env,
            check=False,
        ).stdout

    def pid(self, name: str = "eagle3-top") -> int:
        pane = int(self.t("display-message", "-p", "-t", "m", "#{pane_pid}").strip())
        proc = psutil.Process(pane)
        for p in [proc, *proc.children(recursive=True)]:
            if any(name in c for c in p.cmdline()):
                return p.pid
        return pane

    def screen(self) -> str:
        return self.t("capture-pane", "-p", "-t", "m")

    def kill(self) -> None:
        self.t("kill-server")


def saved_on_screen(text: str) -> int | None:
    lines = text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if re.search(r"\bsent\s+dumped\s+saved\s+failed\b", line):
            nums = re.findall(r"[\d,]+", lines[i + 1])
            if len(nums) >= 3:
                return int(nums[2].replace(",", ""))
    return None


def _cpu_s(proc: psutil.Process) -> float:
    c = proc.cpu_times()
    return c.user + c.system


def tui_cpu(
    output: str, seconds: float, sample_screen: bool
) -> tuple[float, float, list[tuple[float, int]]]:
    """CPU percent of one core used by the TUI over ``seconds``, the same for the floor app
    running beside it over the same seconds, and (time, saved) captures.

    The two run side by side so that whatever this machine does to every process that
    wakes (the cost moves by 2x from one minute to the next) weighs on both alike.
    """
    tm = Tmux([EAGLE3_TOP, "--output", output, "--interval", "1"])
    fl = Tmux([PY, os.path.join(HERE, "textual_floor.py"), "1"])
    caps: list[tuple[float, int]] = []
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (
            saved_on_screen(tm.screen()) is None or "saved" not in fl.screen()
        ):
            time.sleep(0.2)
        time.sleep(3.0)  # warm-up: initial snapshot, first redraws
        procs = [psutil.Process(tm.pid()), psutil.Process(fl.pid("textual_floor"))]
        c0 = [_cpu_s(p) for p in procs]
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            if sample_screen:
                s = saved_on_screen(tm.screen())
                t = time.time()
                if s is not None:
                    caps.append((t, s))
            time.sleep(0.2)
        c1 = [_cpu_s(p) for p in procs]
        elapsed = time.monotonic() - t0
        tui, floor = (100.0 * (b - a) / elapsed for a, b in zip(c0, c1, strict=True))
        return tui, floor, caps
    finally:
        tm.kill()
        fl.kill()


def staleness(caps: list[tuple[float, int]], jdir: str) -> list[float]:
    events, _ = iter_events(jdir)
    save_ts = [e.ts for e in events if isinstance(e, ev.SampleSaved)]
    out = []
    for t, s in caps:
        nxt = save_ts[s] if s < len(save_ts) else None
        out.append(max(0.0, t - nxt) if nxt is not None else 0.0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--runs", type=int, default=15)
    a = ap.parse_args()
    base = tempfile.mkdtemp(
        prefix="e3top-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    try:
        finished = os.path.join(base, "finished")
        t0 = time.time() - 20_000
        evs = run_events(t0, total=10_000, saved=10_000, step=1.0)
        evs.append(ev.RunFinished(ts=t0 + 10_001, saved=10_000))
        write_journal(finished, evs)
        live = os.path.join(base, "live")
        src = start_source(live, 1000.0)
        try:
            interp = wall([PY, "-c", "pass"], a.runs)
            sock = wall([EAGLE3_TOP, "--once", "--json", "--output", live], a.runs)
            jour = wall([EAGLE3_TOP, "--once", "--json", "--output", finished], a.runs)
            busy, busy_floor, caps = tui_cpu(live, a.seconds, True)
            src_proc = psutil.Process(src.pid)
            src_cpu = src_proc.cpu_percent(1.0)
        finally:
            src.terminate()
            src.wait(10)
        jdir = paths.journal_dir(live, paths.Shard())
        events, _ = iter_events(jdir)
        span = events[-1].ts - events[0].ts
        rec_rate = len(events) / span if span > 0 else 0.0
        idle, idle_floor, _ = tui_cpu(finished, a.seconds, False)
        stale = staleness(caps, jdir)

        def ms(xs: list[float]) -> str:
            return f"{statistics.median(xs) * 1000:.0f} ms (p90 {pct(xs, 0.9) * 1000:.0f})"

        iw, ic = interp
        for name, (w, c) in (("--once via socket", sock), ("--once via 30k-record journal", jour)):
            print(
                f"{name:32} wall {ms(w)} ratio {statistics.median(w) / statistics.median(iw):.2f}x"
                f" | cpu {ms(c)} ratio {statistics.median(c) / statistics.median(ic):.2f}x"
            )
        print(f"{'interpreter (python -c pass)':32} wall {ms(iw)} | cpu {ms(ic)}")
        print(f"source: {rec_rate:.0f} records/s over {span:.0f} s (its own cpu {src_cpu:.0f}%)")
        for name, tui, floor in (
            ("under load", busy, busy_floor),
            ("idle journal", idle, idle_floor),
        ):
            print(
                f"TUI cpu at 1 s refresh, {name}: {tui:.2f}% of one core; the floor beside it"
                f" {floor:.2f}%; ratio {tui / floor if floor else float('nan'):.2f}x"
            )
        print(
            f"staleness of saved on screen: p50 {statistics.median(stale):.2f} s, "
            f"p95 {pct(stale, 0.95):.2f} s, max {max(stale):.2f} s over {len(stale)} captures"
        )
        print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
