"""Where the machine's CPU goes while ``eagle3d run`` works (HF producer, reference model).

The end-to-end ratio of ``bench_pipeline.py forward`` splits into two factors on a CPU
producer, and this measures both in one run:

* the share of the machine the workers' forward threads get (the rest goes to the daemon's
  threads, the workers' dump writers, the kernel, or nothing);
* what the forward threads make of it: tokens per CPU-second of the forward threads against
  the bare loop's processes (in the daemon's layout), measured right after.

Every thread of the daemon and its workers is sampled from ``/proc`` every 0.2 s by its kernel
name (:mod:`eagle3d.remote.threadnames`), and counted over the journal's working span (first
``sample sent`` to ``run finished``).

    .venv/bin/python bench/cpu_share.py [--rounds N] [--markdown]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_pipeline as bp

TICK = os.sysconf("SC_CLK_TCK")
Key = tuple[str, str]  # (process role, thread name)
Snapshot = tuple[float, tuple[float, float], dict[tuple[int, int], tuple[Key, float]]]


def _threads(pid: int, role: str, into: dict[tuple[int, int], tuple[Key, float]]) -> None:
    for task in os.scandir(f"/proc/{pid}/task"):
        try:
            with open(f"{task.path}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"{task.path}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if int(task.name) == pid:
            name = "forward (main)" if role == "worker" else "event loop (main)"
        into[(pid, int(task.name))] = ((role, name), (int(fields[11]) + int(fields[12])) / TICK)


def _idle_busy() -> tuple[float, float]:
    """The machine's idle and busy CPU-seconds since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:9]]
    idle = cpu[3] + cpu[4]
    return idle / TICK, (sum(cpu) - idle) / TICK


class ThreadSampler:
    """Snapshots of every thread's CPU time in the daemon and its workers, and of the
    machine's idle and busy time, every 0.2 s (its own CPU counts as "other": a slow poll
    keeps it small)."""

    def __init__(self, pid: int) -> None:
        self.daemon = psutil.Process(pid)
        self.snaps: list[Snapshot] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while True:
            snap: dict[tuple[int, int], tuple[Key, float]] = {}
            try:
                _threads(self.daemon.pid, "daemon", snap)
                for child in self.daemon.children(recursive=True):
                    _threads(child.pid, "worker", snap)
            except (OSError, psutil.Error):
                pass
            self.snaps.append((time.time(), _idle_busy(), snap))
            if self._stop.wait(0.2):
                return

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def sampled_run(model: Path, out: Path, workers: int) -> tuple[dict[Key, float], float, int, float]:
    """Run the daemon; CPU-seconds per (role, thread) over the working span (with the rest
    of the machine's busy time as ``("other", ...)``), the span, the tokens saved, and the
    machine's idle CPU-seconds in it."""
    samplers: list[ThreadSampler] = []

    def watch(pid: int) -> ThreadSampler:
        samplers.append(ThreadSampler(pid))
        return samplers[-1]

    d = bp.run_daemon(
        model,
        bp.DEMO,
        out,
        "--batch-tokens",
        str(bp.BATCH_TOKENS),
        "--concurrency",
        str(bp.WINDOW * workers),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        watch=watch,
    )
    snaps = samplers[0].snaps
    a = min(snaps, key=lambda s: abs(s[0] - d["first"]))
    # The last sample before the exit: threads that end with the process leave /proc after.
    b = min((s for s in snaps if s[0] <= d["end"] + 0.05), key=lambda s: abs(s[0] - d["end"]))
    cpu: dict[Key, float] = {}
    for tid, (key, t) in b[2].items():
        before = a[2].get(tid, (key, 0.0))[1]
        cpu[key] = cpu.get(key, 0.0) + t - before
    busy = b[1][1] - a[1][1]
    cpu[("other", "processes, kernel threads, interrupts")] = busy - sum(cpu.values())
    return cpu, b[0] - a[0], int(d["tokens"]), b[1][0] - a[1][0]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-cpu-", dir=os.path.dirname(__file__)))
    base.mkdir(parents=True, exist_ok=True)
    ncpu = bp.usable_cpus()
    model = bp.build_model(base)
    workers, threads = bp.daemon_layout(model)
    shares: dict[Key, list[float]] = {}
    idle, efficiency, ratio = [], [], []
    try:
        for k in range(args.rounds):
            cpu, span, tokens, idle_s = sampled_run(model, base / "out", workers)
            machine = span * ncpu
            for key, s in cpu.items():
                shares.setdefault(key, []).append(s / machine)
            idle.append(idle_s / machine)
            forward = sum(s for (role, name), s in cpu.items() if name == "forward (main)")
            # The bare loop in the daemon's layout keeps its threads busy: CPU-s = wall-s each.
            bare = bp.bare_forward_split(model, bp.DEMO, workers, threads)
            efficiency.append(tokens / forward / (bare / (workers * threads)))
            ratio.append(tokens / span / bare)
            print(
                f"round {k + 1}: forward share {forward / machine:.1%}, tokens per forward "
                f"CPU-second {efficiency[-1]:.2f} x the bare loop's, end to end "
                f"{ratio[-1]:.2f}",
                file=sys.stderr,
            )
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    rows = sorted(shares.items(), key=lambda kv: -statistics.median(kv[1]))
    med = statistics.median
    lines = [
        f"CPU of the machine ({ncpu} CPUs) over the working span, median of {args.rounds} runs",
        "",
        "| process | thread | share of the machine |",
        "|---|---|---|",
    ]
    lines += [f"| {role} | {name} | {med(v):.1%} |" for (role, name), v in rows if med(v) >= 0.0005]
    lines.append(f"| (none) | idle | {med(idle):.1%} |")
    lines += [
        "",
        f"tokens per CPU-second of the forward threads: {med(efficiency):.2f} x the bare "
        f"loop's; end to end: {med(ratio):.2f} x the bare loop "
        f"({', '.join(f'{r:.2f}' for r in ratio)})",
    ]
    print("\n".join(lines) if args.markdown else "\n".join(lines).replace("|", " "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
