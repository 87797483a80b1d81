"""The daemon's CPU per committed byte against the floor for those bytes, in the same run.

On a GPU node the server writes its dumps on cores of its own, and what the daemon spends
per byte is multiplied by ~1 GB/s per GPU (issue #32). This measures that cost alone:

* **the daemon**: ``eagle3d run --backend synthetic`` with ``EAGLE3D_SYNTHETIC_LINK=1``
  (every dump after a conversation's first is a hard link: the producer costs the daemon
  nothing), an h2048 model config (``--layers`` decoder layers, 3 captured), ``--samples``
  samples of ``--convs`` distinct conversations repeated, the output on ``--dir``'s disk,
  the dumps in /dev/shm; its CPU (user + system, every thread) from ``getrusage``;
* **its fixed start**, as every resume pays it: the job is first started and killed once
  its first batch of samples is journaled (``EAGLE3D_FAULT=kill:before_dump_removal:1``: a
  first start, the tokenizer loaded by transformers, the space check's rows read, both kept
  beside the journal), then resumed and killed the same way (imports, the kept tokenizer
  and rows, the journal, the orphans of the kill, one batch): that resume's CPU is the
  start; the measured run is the resume to the end (start included). ``--fresh`` measures
  first starts instead (a one-row job for the start, then the whole job on a fresh output);
* **the floor**: one ``memcpy`` of the committed bytes (numpy, in this process: the read of
  a dump the daemon cannot avoid) plus ``dd if=/dev/zero bs=16M oflag=direct conv=fsync``
  writing them to the same disk (``dd``'s user + system CPU);
* **a second reference**: ``dd bs=16M oflag=direct conv=fsync`` moving the same number of
  bytes from a file in the dump area (tmpfs) to that disk: the bytes' own way, where the
  read from tmpfs is the kernel's copy out of 4 KiB page-cache pages, not one memcpy.

``--fresh-fs`` puts each measurement's output, and its ``dd``, on a new journaled ext4 (an
image in ``--dir`` on a loop device doing direct I/O: ``--dir``'s disk underneath), as a
node's data disk is: on the disk of a filesystem that earlier runs just filled and emptied,
creating a file may cost many times a fresh one's (see ``scratch.fresh_fs``).

``--pages spliced,mapped`` runs each with a v2 dump's pages spliced into the write or
written from its mapping (``EAGLE3D_SPLICE_PAGES``; default: the daemon's choice by the
dump area's pages). ``--layouts sample,safetensors`` runs each format with the synthetic producer's dumps in
each layout (``EAGLE3D_SYNTHETIC_LAYOUT``): the sample file's (v2, the default: the commit
maps the dump and writes it out from the mapping) and safetensors' (v1: the commit reads
the states into its buffer, checks and checksums them there). For v1 the synthetic
producer makes its dumps with torch, in the daemon's process (its threads are counted
apart, "the producer's threads"); for v2 it makes them without torch.

It prints, per storage format (and layout), the daemon's CPU over the floor's with the start included
and without (the whole run less the one-sample run), and the CPU by thread (the kernel's
per-thread counters, read until the threads end: commit threads, reaper, journal flush,
loop, feeder). ``--strace`` runs the daemon once more under ``strace -f -c`` for its syscall
counts (slower: not part of the ratio); ``--py-spy`` records where the daemon's threads
spend their Python (py-spy ``--gil``: the thread holding the GIL) in one more resume, where
py-spy is installed.

    flock /tmp/eagle3d-bench.lock .venv/bin/python bench/commit_cpu.py [--formats bfloat16,fp8]

The samples total ``samples * tokens * 4 * hidden * bytes``. The defaults are issue #32's own
job: 600 samples of ~800 tokens at h2048, 7.9 GB of bf16 (the issue: 7-9 GB), fp8 half
that; ``--samples 3000 --tokens 400`` is the harder case of many small files (3.3 MB
fp8), where the per-file costs weigh most. Everything written is removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from scratch import fresh_fs

ROOT = Path(__file__).resolve().parent.parent
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "EAGLE3D_SYNTHETIC_LINK": "1",
}
TICKS = os.sysconf("SC_CLK_TCK")


def model_dir(base: Path, hidden: int, layers: int) -> Path:
    """A config-only model of this shape with the tiny model's tokenizer (the synthetic
    producer reads only the config and the tokenizer)."""
    from eagle3d.tools.tinymodel import build_tiny_model

    tiny = base / "tiny"
    if not (tiny / "config.json").exists():
        build_tiny_model(str(tiny), layers=4, hidden=64, heads=4, kv_heads=2)
    m = base / f"config-h{hidden}-L{layers}"
    m.mkdir(exist_ok=True)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, m / f.name)
    cfg = json.loads((tiny / "config.json").read_text())
    cfg.update(hidden_size=hidden, num_hidden_layers=layers, dtype="bfloat16")
    (m / "config.json").write_text(json.dumps(cfg))
    return m


def dataset(path: Path, samples: int, convs: int, tokens: int) -> Path:
    """``samples`` pretokenized rows: ``convs`` distinct ones of about ``tokens`` tokens
    (+-25 %), repeated in turn."""
    rnd = random.Random(7)
    rows = []
    for _ in range(convs):
        n = rnd.randrange(tokens * 3 // 4, tokens * 5 // 4 + 1)
        ids = [rnd.randrange(7, 500) for _ in range(n)]
        rows.append(json.dumps({"input_ids": ids, "loss_mask": [i % 2 for i in range(n)]}))
    path.write_text("".join(rows[i % convs] + "\n" for i in range(samples)))
    return path


class ThreadCpu:
    """The CPU seconds of each thread of a process by its kernel name, read every
    ``period`` s until :meth:`stop` (a thread's last reading stands once it ends)."""

    def __init__(self, pid: int, period: float = 0.1) -> None:
        self.pid = pid
        self.last: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._t.start()

    def _run(self, period: float) -> None:
        while not self._stop.wait(period):
            self.read()

    def read(self) -> None:
        task = f"/proc/{self.pid}/task"
        try:
            tids = os.listdir(task)
        except OSError:
            return
        for tid in tids:
            try:
                stat = Path(f"{task}/{tid}/stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            cpu = (int(fields[11]) + int(fields[12])) / TICKS
            self.last[int(tid)] = (name, cpu)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._t.join()
        by: dict[str, float] = {}
        for name, cpu in self.last.values():
            key = name.rstrip("0123456789_-") or name
            by[key] = by.get(key, 0.0) + cpu
        return by


#: Kills the daemon once its first batch of samples is journaled (their dumps not yet
#: removed): a start, and the least of a run, every sample of it on record.
FIRST_BATCH = "kill:before_dump_removal:1"


def run_daemon(
    model: Path,
    data: Path,
    out: Path,
    dumps: str,
    fmt: str,
    threads: int,
    wrap: list[str] | None = None,
    extra: tuple[str, ...] = (),
    fresh: bool = True,
    env: dict[str, str] | None = None,
    fault: str = "",
) -> dict[str, Any]:
    """One ``eagle3d run`` (on a fresh output, or resuming the one there; ``fault``: its
    ``EAGLE3D_FAULT``, a kill expected); its CPU, its CPU by thread, what the output holds
    after it."""
    for stale in (out, Path(dumps)) if fresh else ():
        shutil.rmtree(stale, ignore_errors=True)
    os.sync()
    cmd = [
        *(wrap or []),
        sys.executable,
        "-m",
        "eagle3d",
        "run",
        "--model",
        str(model),
        "--dataset",
        str(data),
        "--output",
        str(out),
        "--dump-dir",
        dumps,
        "--socket",
        str(out) + ".sock",
        "--backend",
        "synthetic",
        "--store-dtype",
        fmt,
        "--commit-threads",
        str(threads),
        *extra,
        *(() if fresh else ("--force-resume",)),
    ]
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    env = {**(env or ENV), **({"EAGLE3D_FAULT": fault} if fault else {})}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    threads_cpu = ThreadCpu(proc.pid) if wrap is None else None
    _, err = proc.communicate()
    wall = time.monotonic() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    by_thread = threads_cpu.stop() if threads_cpu is not None else {}
    if proc.returncode != (137 if fault else 0):
        raise RuntimeError(f"eagle3d run failed ({proc.returncode}): {err.decode()[-3000:]}")
    nbytes = samples = 0
    for root, _dirs, files in os.walk(out):
        for f in files:
            if f.startswith("data_") and f.endswith(".ckpt"):
                nbytes += os.path.getsize(os.path.join(root, f))
                samples += 1
    cpu = ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime
    return {
        "cpu": cpu,
        "user": ru1.ru_utime - ru0.ru_utime,
        "sys": ru1.ru_stime - ru0.ru_stime,
        "wall": wall,
        "bytes": nbytes,
        "samples": samples,
        "threads": by_thread,
        "stderr": err.decode(),
    }


def memcpy_cpu(nbytes: int, chunk: int = 64 << 20) -> float:
    """CPU seconds of copying ``nbytes`` once, ``chunk`` at a time (warm buffers)."""
    import numpy as np

    src = np.ones(chunk, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # pages faulted in before the clock
    c = time.process_time()
    left = nbytes
    while left > 0:
        n = min(left, chunk)
        np.copyto(dst[:n], src[:n])
        left -= n
    return time.process_time() - c


def dd_cpu(base: Path, nbytes: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of ``dd oflag=direct conv=fsync`` writing ``nbytes``."""
    target = base / "dd.bin"
    count = max(1, -(-nbytes // (16 << 20)))
    os.sync()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.monotonic()
    cmd = ["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={count}"]
    subprocess.run(
        [*cmd, "oflag=direct", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    wall = time.monotonic() - t
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    target.unlink()
    return ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime, wall


def dd_from_dumps_cpu(shm: str, base: Path, nbytes: int) -> float:
    """CPU seconds of ``dd bs=16M oflag=direct conv=fsync`` moving ``nbytes`` from a file in
    the dump area (tmpfs) to the disk: the bytes' own way, a reference beside the floor."""
    src = os.path.join(shm, "dd-source.bin")
    fd = os.open(src, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)
    target = base / "dd.bin"
    os.sync()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cmd = ["dd", f"if={src}", f"of={target}", "bs=16M", "oflag=direct", "conv=fsync"]
    subprocess.run(cmd, check=True, capture_output=True)
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    target.unlink()
    os.unlink(src)
    return ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime


def _fits(shm: str, nbytes: int) -> bool:
    """Whether the dump area holds a file of ``nbytes`` with room to spare (a job larger
    than memory has no "dd from the dump area" reference: nan)."""
    st = os.statvfs(shm)
    return nbytes < st.f_bavail * st.f_frsize // 2


def strace_counts(run: Any, base: Path) -> str:
    """The daemon's syscalls (``strace -f -c``), the top 15 by time."""
    out = base / "strace.txt"
    run(["strace", "-f", "-c", "-o", str(out)])
    lines = out.read_text().splitlines()
    return "\n".join(lines[:17])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default=str(ROOT / "bench"), help="where the output goes (its disk)")
    p.add_argument(
        "--dump-area",
        default="/dev/shm",
        help="where the dumps go: a tmpfs (mounted with huge=within_size for 2 MiB pages)",
    )
    p.add_argument("--samples", type=int, default=600)
    p.add_argument("--convs", type=int, default=10)
    p.add_argument("--tokens", type=int, default=800)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--threads", type=int, default=2, help="commit threads")
    p.add_argument("--formats", default="bfloat16,fp8")
    p.add_argument(
        "--layouts",
        default="sample",
        help="the dumps' layouts, comma-separated: sample (v2), safetensors (v1)",
    )
    p.add_argument(
        "--pages",
        default="auto",
        help="a v2 dump's pages, comma-separated: auto (the daemon's choice), spliced, mapped",
    )
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--strace", action="store_true")
    p.add_argument("--py-spy", action="store_true")
    p.add_argument(
        "--py-spy-keep", default="", help="a folder to keep py-spy's collapsed stacks in"
    )
    p.add_argument("--json", default="", help="also write the figures here")
    p.add_argument("--fresh", action="store_true", help="first starts (see the docstring)")
    p.add_argument(
        "--fresh-fs",
        action="store_true",
        help="each measurement's output and dd on a new journaled ext4 in --dir (root)",
    )
    a = p.parse_args()

    base = Path(tempfile.mkdtemp(prefix="bench-commit-cpu-", dir=a.dir))
    shm = tempfile.mkdtemp(prefix="bench-commit-cpu-", dir=a.dump_area)
    results: dict[str, Any] = {}
    try:
        model = model_dir(base, a.hidden, a.layers)
        data = dataset(base / "data.jsonl", a.samples, a.convs, a.tokens)
        one = dataset(base / "one.jsonl", 1, 1, a.tokens)  # the first row of data.jsonl
        for r in range(a.rounds):
            for fmt, layout, pages in itertools.product(
                a.formats.split(","), a.layouts.split(","), a.pages.split(",")
            ):
                key = ", ".join(
                    [fmt]
                    + ([layout] if a.layouts != "sample" else [])
                    + ([pages] if a.pages != "auto" else [])
                )

                with output_disk(a, base, fmt) as disk:
                    row = measure(a, model, data, one, shm, disk, fmt, layout, pages)
                results.setdefault(key, []).append(row)
                report(key, r + 1, row)
        summary(results)
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1))
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return 0


def output_disk(a: argparse.Namespace, base: Path, fmt: str) -> AbstractContextManager[Path]:
    """Where a measurement's output and its ``dd`` go: ``base``, or with ``--fresh-fs`` a
    new journaled ext4 in ``--dir`` sized for both."""
    from eagle3d.remote import storedtype
    from eagle3d.store.sizing import file_bytes_at_most

    if not a.fresh_fs:
        return contextlib.nullcontext(base)
    job = a.samples * file_bytes_at_most(a.tokens, a.hidden, 3, storedtype.get(fmt))
    return fresh_fs(a.dir, 2 * job + (2 << 30))


def measure(
    a: argparse.Namespace,
    model: Path,
    data: Path,
    one: Path,
    shm: str,
    disk: Path,
    fmt: str,
    layout: str,
    pages: str,
) -> dict[str, Any]:
    """One measurement: the daemon's runs with the output in ``disk``, and the floor there."""

    def run(
        wrap: list[str] | None = None,
        d: Path = data,
        fmt: str = fmt,
        fresh: bool = True,
        layout: str = layout,
        pages: str = pages,
        fault: str = "",
    ) -> dict[str, Any]:
        out = disk / "out"
        env = {**ENV, "EAGLE3D_SYNTHETIC_LAYOUT": layout}
        if pages != "auto":
            env["EAGLE3D_SPLICE_PAGES"] = "1" if pages == "spliced" else "0"
        return run_daemon(
            model, d, out, shm, fmt, a.threads, wrap, fresh=fresh, env=env, fault=fault
        )

    if a.fresh:
        first = start = run(d=one)
        full = run()
        nbytes = full["bytes"]
    else:
        first = run(fault=FIRST_BATCH)
        start = run(fresh=False, fault=FIRST_BATCH)
        full = run(fresh=False)
        nbytes = full["bytes"] - start["bytes"]
    copy = memcpy_cpu(nbytes)
    dd, dd_wall = dd_cpu(disk, nbytes)
    floor = copy + dd
    moved = dd_from_dumps_cpu(shm, disk, nbytes) if _fits(shm, nbytes) else math.nan
    row = {
        "load": os.getloadavg()[0],
        "bytes": nbytes,
        "samples": full["samples"],
        "daemon_cpu": full["cpu"],
        "daemon_user": full["user"],
        "daemon_sys": full["sys"],
        "daemon_wall": full["wall"],
        "start_cpu": start["cpu"],
        "first_start_cpu": first["cpu"],
        "resumed": not a.fresh,
        "memcpy_cpu": copy,
        "dd_cpu": dd,
        "dd_wall": dd_wall,
        "floor": floor,
        "dd_from_dumps_cpu": moved,
        "ratio_to_dd_from_dumps": full["cpu"] / moved,
        "ratio_less_producer_to_dd_from_dumps": (
            full["cpu"] - full["threads"].get("synthetic", 0.0)
        )
        / moved,
        "ratio_with_start": full["cpu"] / floor,
        "ratio_without_start": (full["cpu"] - start["cpu"]) / floor,
        "cpu_s_per_gb": (full["cpu"] - start["cpu"]) / (nbytes / 1e9),
        # The synthetic producer runs in the daemon's process: its own threads
        # (writing each conversation's first dump, linking the rest) are the
        # benchmark's producer, not the commit path.
        "producer_cpu": full["threads"].get("synthetic", 0.0),
        "ratio_less_producer": (full["cpu"] - full["threads"].get("synthetic", 0.0)) / floor,
        "ratio_commit_path": (full["cpu"] - start["cpu"] - full["threads"].get("synthetic", 0.0))
        / floor,
        "threads": full["threads"],
        "start_threads": start["threads"],
    }
    if a.strace:
        row["strace"] = strace_counts(run, disk)
    if a.py_spy and shutil.which("py-spy"):
        svg = disk / f"py-spy-{fmt}.txt"
        spy = ["py-spy", "record", "--format", "raw", "--gil", "-t", "-r", "500"]
        run(fault=FIRST_BATCH)  # as measured: a resume after a first start
        run([*spy, "-o", str(svg), "--"], fresh=False)
        row["py_spy"] = top_frames(svg)
        if a.py_spy_keep:
            Path(a.py_spy_keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(svg, Path(a.py_spy_keep) / svg.name)
    return row


def top_frames(path: Path, n: int = 25) -> str:
    """py-spy's collapsed stacks (``--format raw``), the functions with the most self samples,
    each with its thread."""
    self_samples: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        # py-spy's -t puts the thread first: "thread (0x7f…): commit_0" (its name, if any).
        leaf = f"[{frames[0].rpartition(': ')[2][:16]}] {frames[-1]}"
        self_samples[leaf] = self_samples.get(leaf, 0) + int(count)
        total += int(count)
    top = sorted(self_samples.items(), key=lambda kv: -kv[1])[:n]
    return "\n".join(f"{c / max(total, 1):6.1%}  {f}" for f, c in top)


def report(fmt: str, r: int, row: dict[str, Any]) -> None:
    gb = row["bytes"] / 1e9
    print(
        f"{fmt} round {r} (load {row['load']:.1f}): {row['samples']} samples, {gb:.2f} GB; "
        f"daemon {row['daemon_cpu']:.2f} CPU-s (user {row['daemon_user']:.2f}, "
        f"sys {row['daemon_sys']:.2f}, wall {row['daemon_wall']:.1f} s), "
        f"{'resumed' if row['resumed'] else 'a first start'}; start "
        f"{row['start_cpu']:.2f} (a first start {row['first_start_cpu']:.2f}); floor {row['floor']:.2f} (memcpy {row['memcpy_cpu']:.2f} "
        f"+ dd {row['dd_cpu']:.2f}, dd wall {row['dd_wall']:.1f} s); "
        f"ratio {row['ratio_with_start']:.2f} with the start, "
        f"{row['ratio_without_start']:.2f} without, {row['ratio_commit_path']:.2f} without "
        f"the producer's threads either ({row['producer_cpu']:.2f}); "
        f"{row['cpu_s_per_gb']:.2f} CPU-s/GB beyond the start; against dd from the dump "
        f"area ({row['dd_from_dumps_cpu']:.2f} CPU-s): {row['ratio_to_dd_from_dumps']:.2f}, "
        f"{row['ratio_less_producer_to_dd_from_dumps']:.2f} without the producer's threads",
        flush=True,
    )
    busy = sorted(row["threads"].items(), key=lambda kv: -kv[1])
    print("  by thread: " + ", ".join(f"{k} {v:.2f}" for k, v in busy if v >= 0.01), flush=True)
    start = sorted(row["start_threads"].items(), key=lambda kv: -kv[1])
    print("  start by thread: " + ", ".join(f"{k} {v:.2f}" for k, v in start if v >= 0.01))
    for key in ("strace", "py_spy"):
        if key in row:
            print(f"  {key}:\n{row[key]}", flush=True)


def summary(results: dict[str, list[dict[str, Any]]]) -> None:
    print(
        "\n| format | GB | daemon CPU-s | start CPU-s | floor CPU-s (memcpy + dd) | "
        "ratio, start included | the same less the producer's threads | "
        "ratio, without the start | the commit path alone (less the start and the "
        "producer's threads) | CPU-s/GB beyond the start | dd from the dump area, CPU-s | "
        "ratio to it, start included, less the producer |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for fmt, rows in results.items():

        def med(k: str, rows: list[dict[str, Any]] = rows) -> float:
            return statistics.median(x[k] for x in rows)

        print(
            f"| {fmt} | {med('bytes') / 1e9:.2f} | {med('daemon_cpu'):.2f} | "
            f"{med('start_cpu'):.2f} | {med('floor'):.2f} ({med('memcpy_cpu'):.2f} + "
            f"{med('dd_cpu'):.2f}) | **{med('ratio_with_start'):.2f}** | "
            f"{med('ratio_less_producer'):.2f} | "
            f"{med('ratio_without_start'):.2f} | {med('ratio_commit_path'):.2f} | "
            f"{med('cpu_s_per_gb'):.2f} | {med('dd_from_dumps_cpu'):.2f} | "
            f"{med('ratio_less_producer_to_dd_from_dumps'):.2f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
