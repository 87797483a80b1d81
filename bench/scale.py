#!/usr/bin/env python3
"""A job at its real size: what resume, ``--once``, the TUI, ``verify`` and ``export`` cost at N
samples against the same figures at a baseline N (10k), in the same run.

For each N (the baseline first): a dataset of N pre-tokenized rows of 16 tokens (tiny states:
the job's size is its count, so it fits here), ``eagle3d run --backend synthetic`` killed with
SIGKILL at ``--kills`` random points and started again until it finishes. Then:

* resume: seconds from the restart's process start to "producer ... up" in its log (the
  replay, the checks, the producer's start), the median over the kills;
* ``eagle3-top --once`` with the daemon down: wall seconds and peak RSS (the real console
  script, cold process), against ``python -c pass`` (the interpreter's start) measured beside
  it; and once with the checkpoint taken away (the whole journal replayed) for comparison;
* the TUI (``eagle3-top`` in a tmux terminal, 120x40) on the finished journal: RSS and CPU
  seconds over ``--tui-seconds``;
* ``eagle3d verify``: MB/s and peak RSS, against ``cat`` reading the same files
  (``xargs cat > /dev/null`` over the journal's list of paths, no tree walk) just before;
* ``eagle3d export --format specforge``, then ``speculators``, of the job's own output, each
  stopped with SIGINT after ``--export-seconds`` (180) unless it ends first (an export resumes
  after any stop), so the two take under ~7 min at any N: samples/s over the span from its
  first sample (the export's own progress line: the steady per-sample rate), the wait before
  the first sample per job sample (the journals' two passes, O(N)), and peak RSS at the end
  or the stop (by then the whole job's catalog is in memory: the part that grows with N).
  Each row says "whole" (the export ended by itself, index files written) or "prefix a/b"
  (samples exported at the baseline / at N before the stop). On a quiet machine specforge
  (hard links, ~8k samples/s) is whole even at 1M; speculators (a copy in another layout,
  ~700 samples/s) is a prefix from ~100k on;
* the journal's and the checkpoint's bytes.

The result is each figure's ratio to the baseline's (per sample where the figure grows with N
by nature: journal bytes, seconds of a whole verify). Nothing here asserts a time.

    nice -n 10 .venv/bin/python bench/scale.py --n 1000000 [--baseline 10000] [--kills 3]
        [--dir /tmp/e3d-scale] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
PY = sys.executable


def dataset(path: Path, n: int, seed: int = 0) -> Path:
    if path.exists():
        with open(path, "rb") as f:
            if sum(1 for _ in f) == n:
                return path
    r = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            ids = [r.randrange(1, 900) for _ in range(16)]
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 4 + [1] * 12}) + "\n")
    return path


def waited(proc: subprocess.Popen[bytes]) -> tuple[int, float, int]:
    """(exit status, CPU seconds, peak RSS bytes) of a child, from wait4."""
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, ru.ru_utime + ru.ru_stime, ru.ru_maxrss * 1024


def timed(argv: list[str], env: dict[str, str] | None = None) -> dict[str, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env or ENV
    )
    rc, cpu, rss = waited(proc)
    return {"rc": rc, "s": time.perf_counter() - t0, "cpu_s": cpu, "rss": rss}


#: Journal bytes a sample takes (sent, dumped, saved records; measured: 411-413).
JOURNAL_BYTES_PER_SAMPLE = 412


def saved_estimate(out: Path) -> int:
    """Samples saved so far, from the journal's size (reading it would cost O(N) a poll)."""
    jdir = out / ".eagle3d" / "journal" / "shard-0-of-1"
    try:
        size = sum(e.stat().st_size for e in os.scandir(jdir) if e.name.endswith(".e3j"))
    except FileNotFoundError:
        return 0
    return size // JOURNAL_BYTES_PER_SAMPLE


def run_job(model: Path, data: Path, out: Path, n: int, kills: int, seed: int) -> dict[str, Any]:
    """The job with SIGKILLs at random points; resume seconds after each."""
    argv = [PY, "-m", "eagle3d", "run", "--model", str(model), "--dataset", str(data)]
    argv += ["--output", str(out), "--backend", "synthetic", "--dump-dir", f"{out}.dumps"]
    argv += ["--socket", f"{out}.sock", "--max-failed-fraction", "0.5"]
    r = random.Random(seed)
    points = sorted(r.uniform(0.1, 0.9) * n for _ in range(kills))
    resumes: list[float] = []
    peak_rss = 0
    cpu = 0.0
    t0 = time.monotonic()
    session = 0
    while True:
        session += 1
        log = out.parent / f"{out.name}.log{session}"
        start = time.monotonic()
        with open(log, "wb") as logf:
            proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=ENV)
        up = 0.0
        killed = False
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(0.2)
            if not up and b"up; window" in log.read_bytes()[-20000:]:
                up = time.monotonic() - start
            if points and saved_estimate(out) >= points[0]:
                points.pop(0)
                proc.kill()
                killed = True
        rc = os.waitstatus_to_exitcode(status)
        proc.returncode = rc
        c, rss = ru.ru_utime + ru.ru_stime, ru.ru_maxrss * 1024
        cpu += c
        peak_rss = max(peak_rss, rss)
        if session > 1 and up:
            resumes.append(up)
        print(
            f"  session {session}: {'killed' if killed else f'exit {rc}'}, up after {up:.1f} s",
            flush=True,
        )
        if not killed:
            if rc != 0:
                raise SystemExit(f"the job exited {rc}; see {log}")
            break
    # Dumps a SIGKILL left are removed by the next start; the dump area ends empty.
    return {
        "job_s": time.monotonic() - t0,
        "samples_s": n / (time.monotonic() - t0),
        "resume_s": statistics.median(resumes) if resumes else None,
        "resumes": resumes,
        "daemon_peak_rss": peak_rss,
        "daemon_cpu_s": cpu,
    }


def tui(out: Path, seconds: float) -> dict[str, float]:
    """eagle3-top in a real terminal on the finished journal: RSS and CPU seconds."""
    import psutil

    if shutil.which("tmux") is None:
        return {}
    name = f"e3d-scale-{os.getpid()}"
    cmd = f"{PY} -m eagle3top --output {out}"
    subprocess.run(
        ["tmux", "new-session", "-d", "-s", name, "-x", "120", "-y", "40", cmd], env=ENV, check=True
    )
    try:
        pane = subprocess.run(
            ["tmux", "list-panes", "-t", name, "-F", "#{pane_pid}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        p = psutil.Process(int(pane[0]))
        t0 = time.monotonic()
        # Caught up: the screen shows the finished job (polled, never a fixed sleep).
        while time.monotonic() - t0 < 120:
            screen = subprocess.run(
                ["tmux", "capture-pane", "-p", "-t", name], capture_output=True, text=True
            ).stdout
            if "FINISHED" in screen.upper() and "saved" in screen:
                break
            time.sleep(0.2)
        caught_up = time.monotonic() - t0
        c0 = sum(p.cpu_times()[:2])
        time.sleep(seconds)
        c1 = sum(p.cpu_times()[:2])
        return {
            "catch_up_s": caught_up,
            "rss": p.memory_info().rss,
            "cpu_share": (c1 - c0) / seconds,
        }
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], check=False)


def sample_paths(out: Path) -> Path:
    """The journal's list of sample files (the shard's records: no tree walk)."""
    from eagle3proto import events as ev
    from eagle3proto import paths
    from eagle3proto.journalread import replay

    lst = out.parent / f"{out.name}.files"
    with open(lst, "w") as f:

        def sink(batch: list[Any]) -> None:
            for e in batch:
                if isinstance(e, ev.SampleSaved):
                    f.write(f"{out}/{e.path}\0")

        replay(paths.journal_dir(str(out), paths.Shard()), sink)
    return lst


def verify_vs_cat(out: Path) -> dict[str, float]:
    lst = sample_paths(out)
    # Twice: the first read brings the files into the page cache, the second is timed, so
    # that cat and verify (after it) both read warm files (neither measures the disk).
    for _ in range(2):
        t0 = time.perf_counter()
        subprocess.run(f"xargs -0 -n 2000 cat < {lst} > /dev/null", shell=True, check=True)
        cat_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [PY, "-m", "eagle3d", "verify", "-o", str(out), "--json"], stdout=subprocess.PIPE, env=ENV
    )
    doc = json.loads(proc.stdout.read() if proc.stdout else b"{}")
    rc, cpu, rss = waited(proc)
    s = time.perf_counter() - t0
    mb = doc["bytes_checked"] / 1e6
    return {
        "rc": rc,
        "ok": doc["ok"],
        "checked": doc["checked"],
        "s": s,
        "mb": mb,
        "mb_s": mb / s,
        "cat_mb_s": mb / cat_s,
        "of_cat": (mb / s) / (mb / cat_s),
        "rss": rss,
        "cpu_s": cpu,
    }


#: A progress line of ``eagle3d export`` (not on a terminal: one every 2 s, and the last).
_PROGRESS = re.compile(r"export: ([\d,]+)/([\d,]+) samples .* ([\d,.]+) samples/s")


def export(out: Path, seconds: float) -> dict[str, float]:
    """``eagle3d export`` of the job's own output in ``specforge`` then ``speculators``, each
    stopped with SIGINT after ``seconds`` if it has not ended (an export resumes after any
    stop; a job of another size would say nothing of N). Per format: the samples exported
    and their rate over the span from the first sample (the export's own progress line),
    the seconds before the first sample (the journals' two passes), peak RSS at the end or
    the stop (the whole catalog is read by then: what grows with N), and ``whole`` (1: the
    export ended by itself, its index files written; 0: a prefix)."""
    res: dict[str, float] = {}
    for fmt in ("specforge", "speculators"):
        dest = out.parent / f"{out.name}-exported-{fmt}"
        shutil.rmtree(dest, ignore_errors=True)
        argv = [PY, "-m", "eagle3d", "export", "-o", str(out), "--format", fmt, "--to", str(dest)]
        one = _bounded_export([*argv, "--progress"], seconds)
        shutil.rmtree(dest, ignore_errors=True)
        key = "" if fmt == "specforge" else f"{fmt}_"
        res.update({f"{key}{k}": v for k, v in one.items()})
    return res


def _bounded_export(argv: list[str], seconds: float) -> dict[str, float]:
    """Run one export, SIGINT after ``seconds``; its figures from its progress lines."""
    lines: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)

    def read() -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            lines.append((time.perf_counter() - t0, raw.decode(errors="replace")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    whole = 1.0
    while True:  # wait4 (not Popen.poll, which reaps without the rusage)
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if whole and time.perf_counter() - t0 > seconds:
            proc.send_signal(signal.SIGINT)
            whole = 0.0
        time.sleep(0.2)
    rc, rss = os.waitstatus_to_exitcode(status), ru.ru_maxrss * 1024
    proc.returncode = rc
    reader.join(timeout=10)
    got = [(t, m) for t, line in lines if (m := _PROGRESS.search(line))]
    first = got[0][0] if got else float("nan")
    n = int(got[-1][1].group(1).replace(",", "")) if got else 0
    rate = float(got[-1][1].group(3).replace(",", "")) if got else 0.0
    return {"rc": rc, "rss": rss, "samples": n, "samples_s": rate, "first_s": first, "whole": whole}


def measure(n: int, args: argparse.Namespace, model: Path) -> dict[str, Any]:
    base = Path(args.dir) / f"n{n}"
    base.mkdir(parents=True, exist_ok=True)
    data = dataset(base / "d.jsonl", n)
    out = base / "out"
    if out.exists():
        shutil.rmtree(out)
    print(f"N={n:,}: the job", flush=True)
    job = run_job(model, data, out, n, args.kills, args.seed)
    print(f"N={n:,}: resume after a repair", flush=True)
    job["repaired"] = resume_after_repair(model, data, out, n)
    return measure_output(out, n, job, model, data, args)


def resume_once(model: Path, data: Path, out: Path) -> dict[str, Any]:
    """A job cut short (its bench ran out of time): one more start, timed to the producer up
    (the resume), then SIGTERM; the job's figures from that start only."""
    argv = [PY, "-m", "eagle3d", "run", "--model", str(model), "--dataset", str(data)]
    argv += ["--output", str(out), "--backend", "synthetic", "--dump-dir", f"{out}.dumps"]
    argv += ["--socket", f"{out}.sock", "--max-failed-fraction", "0.5"]
    log = out.parent / f"{out.name}.log-resume"
    start = time.monotonic()
    with open(log, "wb") as logf:
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=ENV)
    up = 0.0
    while not up and proc.poll() is None and time.monotonic() - start < 300:
        time.sleep(0.1)
        if b"up; window" in log.read_bytes()[-20000:]:
            up = time.monotonic() - start
    proc.send_signal(2)
    _rc, _cpu, rss = waited(proc)
    # Its CPU per sample means nothing here (one short start): not a figure of this run.
    return {"resume_s": up, "daemon_peak_rss": rss, "daemon_cpu_s": float("nan"), "resumes": [up]}


def measure_output(
    out: Path, n: int, job: dict[str, Any], model: Path, data: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """Everything but the job itself, on a finished (or cut short: ``n`` saved) output."""
    from eagle3proto import checkpoint, paths

    res: dict[str, Any] = {"n": n, "job": job}
    jdir = paths.journal_dir(str(out), paths.Shard())
    res["journal_bytes"] = sum(
        os.path.getsize(os.path.join(jdir, f)) for f in os.listdir(jdir) if f.endswith(".e3j")
    )
    ck = checkpoint.path_in(jdir)
    res["checkpoint_bytes"] = os.path.getsize(ck) if os.path.exists(ck) else 0
    print("  --once", flush=True)
    interp = [timed([PY, "-c", "pass"])["s"] for _ in range(5)]
    once = [timed([PY, "-m", "eagle3top", "--once", "--output", str(out)]) for _ in range(5)]
    res["interpreter_s"] = statistics.median(interp)
    res["once_s"] = statistics.median(o["s"] for o in once)
    res["once_rss"] = max(o["rss"] for o in once)
    res["once_of_interpreter"] = res["once_s"] / res["interpreter_s"]
    os.rename(ck, ck + ".aside")
    full = timed([PY, "-m", "eagle3top", "--once", "--output", str(out)])
    os.rename(ck + ".aside", ck)
    res["once_full_replay_s"], res["once_full_replay_rss"] = full["s"], full["rss"]
    print("  TUI", flush=True)
    res["tui"] = tui(out, args.tui_seconds)
    print("  verify", flush=True)
    res["verify"] = verify_vs_cat(out)
    if "export" not in args.skip:
        print("  export", flush=True)
        res["export"] = export(out, args.export_seconds)
    print(json.dumps(res, indent=1), flush=True)
    return res


def ratios(base: dict[str, Any], big: dict[str, Any]) -> list[tuple[str, float, float, float]]:
    """(figure, baseline, at N, ratio); per-sample figures where the quantity grows with N."""
    nb, nn = base["n"], big["n"]
    rows = [
        (
            "resume after a kill, to producer up s (median)",
            base["job"]["resume_s"],
            big["job"]["resume_s"],
        ),
        (
            "resume after a repair, to the first save s",
            base["job"].get("repaired", {}).get("first_save_s"),
            big["job"].get("repaired", {}).get("first_save_s"),
        ),
        (
            "resume to producer up s",
            base["job"].get("repaired", {}).get("up_s"),
            big["job"].get("repaired", {}).get("up_s"),
        ),
        ("--once s", base["once_s"], big["once_s"]),
        ("--once peak RSS MB", base["once_rss"] / 1e6, big["once_rss"] / 1e6),
        ("--once / interpreter start", base["once_of_interpreter"], big["once_of_interpreter"]),
        ("--once, whole journal, s", base["once_full_replay_s"], big["once_full_replay_s"]),
        (
            "daemon peak RSS MB",
            base["job"]["daemon_peak_rss"] / 1e6,
            big["job"]["daemon_peak_rss"] / 1e6,
        ),
        (
            "daemon CPU ms / sample",
            1e3 * base["job"]["daemon_cpu_s"] / nb,
            1e3 * big["job"]["daemon_cpu_s"] / nn,
        ),
        ("TUI RSS MB", base["tui"].get("rss", 0) / 1e6, big["tui"].get("rss", 0) / 1e6),
        ("TUI CPU share", base["tui"].get("cpu_share", 0), big["tui"].get("cpu_share", 0)),
        ("TUI catch-up s", base["tui"].get("catch_up_s", 0), big["tui"].get("catch_up_s", 0)),
        ("verify MB/s", base["verify"]["mb_s"], big["verify"]["mb_s"]),
        ("verify / cat", base["verify"]["of_cat"], big["verify"]["of_cat"]),
        ("verify peak RSS MB", base["verify"]["rss"] / 1e6, big["verify"]["rss"] / 1e6),
        *_export_rows(base.get("export", {}), big.get("export", {}), nb, nn),
        ("journal bytes / sample", base["journal_bytes"] / nb, big["journal_bytes"] / nn),
        ("checkpoint KB", base["checkpoint_bytes"] / 1e3, big["checkpoint_bytes"] / 1e3),
    ]
    return [
        (k, a, b, (b / a) if a else float("nan"))
        for k, a, b in rows
        if a is not None and b is not None
    ]


def _export_rows(
    base: dict[str, float], big: dict[str, float], nb: int, nn: int
) -> list[tuple[str, float, float]]:
    """The export's figures, each format's label saying whether it is the whole job's or a
    prefix's (stopped after ``--export-seconds``: "prefix a/b" of the baseline / at N); the
    wait for the first sample (the journals' passes, O(N)) per sample of the job. None
    where the export was skipped."""
    if not base or not big:
        return []
    rows = []
    for fmt, key in (("specforge", ""), ("speculators", "speculators_")):
        span = (
            "whole"
            if base[f"{key}whole"] and big[f"{key}whole"]
            else (f"prefix {base[f'{key}samples']:,.0f}/{big[f'{key}samples']:,.0f}")
        )
        rows += [
            (f"export {fmt} samples/s ({span})", base[f"{key}samples_s"], big[f"{key}samples_s"]),
            (f"export {fmt} peak RSS MB ({span})", base[f"{key}rss"] / 1e6, big[f"{key}rss"] / 1e6),
            (
                f"export {fmt} µs / job sample before the first",
                1e6 * base[f"{key}first_s"] / nb,
                1e6 * big[f"{key}first_s"] / nn,
            ),
        ]
    return rows


def resume_after_repair(model: Path, data: Path, out: Path, n: int) -> dict[str, Any]:
    """A resume of the finished job at its full size: one row folder taken away (2,000
    samples, the middle one), ``verify --repair --quick`` journals them missing, then
    ``eagle3d run`` again, timed to "producer up" and to the first sample saved again (the
    folder's first file); the run then finishes the 2,000. Its journal and checkpoint are the
    whole job's, its dataset all N rows: what a resume after a crash or damage pays."""
    from eagle3proto import paths

    g = (n // 2) // paths.GROUP_SIZE * paths.GROUP_SIZE
    folder = out / paths.rows_dir(g)
    aside = out.parent / f"{out.name}.aside"
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(folder, aside)
    repair = timed([PY, "-m", "eagle3d", "verify", "-o", str(out), "--repair", "--quick"])
    argv = [PY, "-m", "eagle3d", "run", "--model", str(model), "--dataset", str(data)]
    argv += ["--output", str(out), "--backend", "synthetic", "--dump-dir", f"{out}.dumps"]
    argv += ["--socket", f"{out}.sock", "--max-failed-fraction", "0.5"]
    log = out.parent / f"{out.name}.log-repaired"
    start = time.monotonic()
    with open(log, "wb") as logf:
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=ENV)
    up = first = 0.0
    while True:
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        time.sleep(0.05)
        now = time.monotonic() - start
        if not up and b"up; window" in log.read_bytes()[-20000:]:
            up = now
        if not first and folder.is_dir() and any(folder.iterdir()):
            first = now
    rc = os.waitstatus_to_exitcode(status)
    cpu, rss = ru.ru_utime + ru.ru_stime, ru.ru_maxrss * 1024
    shutil.rmtree(aside, ignore_errors=True)
    return {
        "repair_s": repair["s"],
        "repair_rc": repair["rc"],
        "rc": rc,
        "up_s": up,
        "first_save_s": first,
        "cpu_s": cpu,
        "rss": rss,
    }


def remeasure(n_dirs: list[Path], args: argparse.Namespace, model: Path) -> int:
    """The figures of finished jobs (made by an earlier run of this bench: its n<N> folders)
    measured again with this checkout's code: the resume after a repair, then
    everything :func:`measure_output` measures. The jobs' own figures (daemon RSS and CPU
    per sample, the resumes after each kill) are the earlier run's, from its --json."""
    from eagle3proto import paths
    from eagle3top.sources import fold_journal

    earlier = json.loads(Path(args.json).read_text()) if args.json else []
    results = []
    for i, d in enumerate(n_dirs):
        out, data = d / "out", d / "d.jsonl"
        state, _rep, _ = fold_journal(paths.journal_dir(str(out), paths.Shard()))
        n = state.saved
        print(f"N={n:,}: resume after a repair", flush=True)
        job = dict(earlier[i]["job"]) if i < len(earlier) else {}
        job["repaired"] = resume_after_repair(model, data, out, n)
        results.append(measure_output(out, n, job, model, data, args))
    if args.json:
        Path(args.json + ".remeasured").write_text(json.dumps(results, indent=1))
    print(f"\n| figure | N={results[0]['n']:,} | N={results[1]['n']:,} | ratio |")
    print("|---|---|---|---|")
    for k, a, b, r in ratios(results[0], results[1]):
        print(f"| {k} | {a:.4g} | {b:.4g} | {r:.2f} |")
    return 0


def partial(base: Path, args: argparse.Namespace, model: Path) -> int:
    from eagle3proto import paths
    from eagle3top.sources import fold_journal

    out, data = base / "out", base / "d.jsonl"
    job = resume_once(model, data, out)
    state, _rep, _ = fold_journal(paths.journal_dir(str(out), paths.Shard()))
    res = measure_output(out, state.saved, job, model, data, args)
    baseline = json.loads(Path(args.json).read_text())[0] if args.json else None
    if args.json:
        Path(args.json).write_text(json.dumps([baseline, res], indent=1))
    if baseline is not None:
        print(f"\n| figure | N={baseline['n']:,} | N={res['n']:,} | ratio |\n|---|---|---|---|")
        for k, a, b, r in ratios(baseline, res):
            print(f"| {k} | {a:.4g} | {b:.4g} | {r:.2f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--baseline", type=int, default=10_000)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--dir", default="/tmp/e3d-scale")
    ap.add_argument("--tui-seconds", type=float, default=10.0)
    ap.add_argument("--json", default="")
    ap.add_argument(
        "--export-seconds",
        type=float,
        default=180.0,
        help="each export format's span before SIGINT (a prefix of the job, said in the table)",
    )
    ap.add_argument(
        "--partial",
        default="",
        metavar="DIR",
        help="measure a job the run ran out of time for (DIR: its n<N> folder, the daemon "
        "stopped): one more start for the resume, then the rest, at the samples it saved",
    )
    ap.add_argument(
        "--remeasure",
        nargs=2,
        default=None,
        metavar="DIR",
        help="measure two finished jobs again (the baseline's and N's n<N> folders) with "
        "this checkout's code; --json names the earlier run's results (read) and gets "
        "'.remeasured' for the new ones",
    )
    ap.add_argument(
        "--skip",
        default="",
        help="steps of the measurement left out, comma-separated (export: measured apart)",
    )
    args = ap.parse_args(argv)
    sys.path[:0] = [str(ROOT / "shared"), str(ROOT / "daemon"), str(ROOT / "tui")]
    # Bytecode as an installed package has it (pip compiles a wheel's modules at install):
    # where PYTHONDONTWRITEBYTECODE is set, a source checkout would otherwise compile every
    # module at every start, and --once against the interpreter would measure the compiler.
    import compileall

    for d in ("shared", "daemon", "tui"):
        compileall.compile_dir(str(ROOT / d), quiet=1)
    model = Path(args.dir) / "tiny"
    if not (model / "config.json").exists():
        # In a child: this process stays small, since a child's peak RSS (wait4) counts
        # what it had between its fork and its exec.
        subprocess.run([PY, "-m", "eagle3d", "tiny-model", str(model)], env=ENV, check=True)
    if args.partial:
        return partial(Path(args.partial), args, model)
    if args.remeasure:
        return remeasure([Path(d) for d in args.remeasure], args, model)
    results = [measure(args.baseline, args, model)]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    results.append(measure(args.n, args, model))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"\n| figure | N={args.baseline:,} | N={args.n:,} | ratio |\n|---|---|---|---|")
    for k, a, b, r in ratios(results[0], results[1]):
        print(f"| {k} | {a:.4g} | {b:.4g} | {r:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
