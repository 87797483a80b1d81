"""Where the daemon's own CPU goes on the SGLang path, against a real SGLang 0.5.21 server.

``bench/sglang_server.py`` finds the daemon's whole process at ~0.6 of a bare client's tokens/s
on this CPU while its working span is ~0.9, and counts ~5 CPU-seconds more for the same job.
This splits those seconds: every thread of ``eagle3d run --backend sglang`` is sampled from
``/proc`` every 0.2 s (by its kernel name, :mod:`eagle3d.remote.threadnames`), and its CPU is
cut at the journal's first ``sample sent`` and ``run finished`` into the start (imports, the
tokenizer, the first samples encoded), the working span and the drain; the process's own
total comes from its rusage. The server's CPU over the same run is given beside it.

    flock /tmp/eagle3d-bench.lock .venv/bin/python bench/sglang_cpu.py [--rounds 3]
        [--convs 160] [--concurrency 8]    # needs scripts/sglang_env (or EAGLE3D_SGLANG_PYTHON)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from cpu_share import Snapshot, ThreadSampler  # noqa: E402

PHASES = ("start", "span", "drain")


def _cpu_at(snaps: list[Snapshot], ts: float) -> dict[str, float]:
    """CPU-seconds per thread name at the last snapshot no later than ``ts``."""
    before = [s for s in snaps if s[0] <= ts] or snaps[:1]
    out: dict[str, float] = {}
    for (_role, name), secs in before[-1][2].values():
        out[name] = out.get(name, 0.0) + secs
    return out


def one_run(cmd: list[str], out: Path, server_pid: int) -> dict[str, dict[str, float]]:
    """Run the daemon once; {phase: {thread: CPU-s}}, with totals under "(all)"."""
    from eagle3proto import events as ev
    from eagle3proto import paths
    from eagle3proto.journalread import iter_events
    from sglang_server import ENV, group_cpu

    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    s0 = group_cpu(server_pid)
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sampler = ThreadSampler(proc.pid)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    sampler.stop()
    s1 = group_cpu(server_pid)
    if proc.returncode != 0:
        err = proc.stderr.read().decode() if proc.stderr else ""
        raise RuntimeError(f"eagle3d run failed ({proc.returncode}): {err[-3000:]}")
    evs, _ = iter_events(paths.journal_dir(str(out), paths.Shard()))
    first = next(e.ts for e in evs if isinstance(e, ev.SampleSent))
    end = next(e.ts for e in reversed(evs) if isinstance(e, ev.RunFinished))
    snaps = sampler.snaps
    cuts = [_cpu_at(snaps, t0), _cpu_at(snaps, first), _cpu_at(snaps, end), _cpu_at(snaps, 1e18)]
    got: dict[str, dict[str, float]] = {}
    for k, phase in enumerate(PHASES):
        a, b = cuts[k] if k else {}, cuts[k + 1]
        got[phase] = {n: b[n] - a.get(n, 0.0) for n in b}
    total = usage.ru_utime + usage.ru_stime
    seen = sum(sum(v.values()) for v in got.values())
    # Threads that ended between two snapshots, and the last 0.2 s before the exit.
    got["drain"]["(not sampled: the exit, short-lived threads)"] = total - seen
    got["(all)"] = {
        "daemon process (rusage)": total,
        "server processes": s1 - s0,
        "wall": time.time() - t0,
        "start (to the first send)": first - t0,
        "drain (run finished to exit)": time.time() - end,
    }
    return got


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--convs", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    a = ap.parse_args()

    import sglang_real as sr
    from bench_pipeline import build_model
    from sglang_server import demo_subset

    work = Path(tempfile.mkdtemp(prefix="e3d-bench-sgcpu-"))
    shm = Path(tempfile.mkdtemp(prefix="e3d-bench-sgcpu-", dir="/dev/shm"))
    model = build_model(work, a.layers, a.hidden)
    data, samples = demo_subset(work, model, a.convs)
    tokens = sum(map(len, samples))
    (shm / "hooked").mkdir()
    server = sr.Server(model, shm / "hooked", work, threads=None)
    runs: list[dict[str, dict[str, float]]] = []
    try:
        server.start()
        # as sglang_server.py counts it: the last main process and everything below it
        pid = server.main_pids()[-1] if server.main_pids() else server.proc.pid  # type: ignore[union-attr]
        for k in range(a.rounds):
            shutil.rmtree(shm / "hooked", ignore_errors=True)
            (shm / "hooked").mkdir()
            cmd = [
                sys.executable,
                "-m",
                "eagle3d",
                "run",
                "--backend",
                "sglang",
                "--server",
                server.url,
                "--model",
                str(model),
                "--dataset",
                str(data),
                "--output",
                str(work / "out"),
                "--dump-dir",
                str(shm / "hooked"),
                "--concurrency",
                str(a.concurrency),
            ]
            runs.append(one_run(cmd, work / "out", pid))
            all_ = runs[-1]["(all)"]
            print(
                f"round {k + 1}: daemon {all_['daemon process (rusage)']:.2f} CPU-s, server "
                f"{all_['server processes']:.2f} CPU-s, wall {all_['wall']:.1f} s",
                file=sys.stderr,
            )
    finally:
        if server.proc is not None:
            server.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    print(
        f"{a.convs} conversations, {tokens} tokens, concurrency {a.concurrency}, "
        f"h{a.hidden}/L{a.layers} fp32; CPU-seconds, median of {a.rounds} runs\n"
    )
    print("| phase | thread | CPU-s (timings: wall s) |\n|---|---|---|")
    for phase in PHASES:
        names = sorted({n for r in runs for n in r[phase]}, key=lambda n: -runs[0][phase].get(n, 0))
        for n in names:
            v = med(r[phase].get(n, 0.0) for r in runs)
            if abs(v) >= 0.005:
                print(f"| {phase} | {n} | {v:.2f} |")
    for n in runs[0]["(all)"]:
        print(f"| (all) | {n} | {med(r['(all)'][n] for r in runs):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
