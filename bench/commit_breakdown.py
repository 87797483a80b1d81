"""Where a commit's time goes against the disk's own limit, one layer of the commit path at a
time, in the same run, interleaved rounds.

The baseline is ``dd if=/dev/zero bs=16M oflag=direct`` writing the same bytes to the same
disk (one file, no sync per block: what the disk takes). Then, each with the daemon's
commit threads (``--threads``) over ``--samples`` samples of ``--tokens`` x ``--hidden``
bfloat16 states (the archive the commit writes):

1. ``one file per sample``: each sample's archive bytes written with ``O_DIRECT`` from a
   prepared buffer into a file of its own, no sync;
2. ``+ fdatasync``: and each file fdatasync'ed (its allocation made durable);
3. ``+ rename, dir fsync``: and renamed into place, one directory fsync per batch of 8
   (the durability contract of docs/journal.md);
4. ``+ read and check the dump``: the daemon's ``Committer.commit_files`` over real dumps
   in /dev/shm: each dump read into the archive buffer (a copy), checked (ids, shapes,
   NaN/Inf), checksummed, then 1-3;
5. ``+ journal record``: and one durable ``sample_saved`` record per sample in a journal
   on the same disk (one group-committed append per batch), then the dump's unlink on the
   commit thread (the daemon's commit path before the reaper);
6. ``the reaper``: as 5, the dumps handed to the daemon's :class:`eagle3d.run.reaper.Reaper`
   instead (removed on a thread of its own at the lowest CPU priority, bounded), and the
   clock stops once it has removed them all: the daemon's commit path now;
7. ``the reaper at nice 0``: as 6, the reaper at the commit threads' priority (for the
   choice of the lowest).

    flock /tmp/eagle3d-bench.lock .venv/bin/python bench/commit_breakdown.py [--rounds 3] [--layers 4,5,6]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

BATCH = 8


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dd(base: str, nbytes: int) -> tuple[float, float]:
    target = os.path.join(base, "dd.bin")
    count = max(1, nbytes // (16 << 20))
    os.sync()
    t = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={count}", "oflag=direct"],
        check=True,
        capture_output=True,
    )
    dt = time.perf_counter() - t
    os.unlink(target)
    return count * (16 << 20) / dt / 1e6, 0.0


def raw(base: str, n: int, size: int, threads: int, level: int) -> tuple[float, float]:
    """Layers 1-3: O_DIRECT files of ``size`` bytes from a prepared buffer per thread."""
    out = tempfile.mkdtemp(prefix="raw-", dir=base)
    local = threading.local()
    padded = -(-size // 4096) * 4096

    def batch(first: int) -> None:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = mmap.mmap(-1, padded)
            buf.write(b"\x01" * padded)
        names = []
        for i in range(first, min(first + BATCH, n)):
            tmp = os.path.join(out, f".data_{i}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
            os.pwrite(fd, memoryview(buf), 0)
            if level >= 2:
                os.fdatasync(fd)
            os.close(fd)
            names.append((tmp, os.path.join(out, f"data_{i}.ckpt")))
        if level >= 3:
            for tmp, final in names:
                os.rename(tmp, final)
            _fsync_dir(out)

    os.sync()
    t, c = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(batch, range(0, n, BATCH)))
    dt, cpu = time.perf_counter() - t, time.process_time() - c
    shutil.rmtree(out)
    return n * padded / dt / 1e6, cpu / n * 1000


def commits(
    base: str,
    dumps: Any,
    tokens: int,
    hidden: int,
    threads: int,
    journal: bool,
    reap: bool = False,
    nice: int = 19,
) -> tuple[float, float]:
    """Layers 4-6: the daemon's Committer over real dumps (and its journal records, the
    dumps' removal on the commit thread or by the reaper)."""
    from eagle3d.remote import storedtype
    from eagle3d.run.reaper import Reaper, limit_for
    from eagle3d.store.committer import Committed, Committer
    from eagle3proto import events as ev
    from eagle3proto.journal import JournalWriter

    out = tempfile.mkdtemp(prefix="commit-", dir=base)
    c = Committer(out, store=storedtype.get("bfloat16"))
    c.warm_up()
    j = JournalWriter(os.path.join(out, ".journal")) if journal else None
    if j is not None:
        j.open()
    ids, mask, layers = list(range(tokens)), [1] * tokens, [2, 16, 29]
    sources = dumps()  # fresh dumps, written before the clock starts
    reaper = Reaper(limit_for(os.path.dirname(sources[0])), nice=nice) if reap else None

    def batch(first: int) -> int:
        part = list(range(first, min(first + BATCH, len(sources))))
        done = c.commit_files([(i, ids, mask, sources[i]) for i in part], hidden, layers)
        assert all(isinstance(r, Committed) for r in done), done
        if j is not None:
            j.append_many(
                [
                    ev.SampleSaved(
                        idx=i, path=r.relpath, bytes=r.nbytes, tokens=tokens, checksum=r.checksum
                    )
                    for i, r in zip(part, done, strict=True)
                    if isinstance(r, Committed)
                ]
            )
            if reaper is not None:
                reaper.remove([(sources[i], os.path.getsize(sources[i])) for i in part])
            else:
                for i in part:
                    os.unlink(sources[i])
        return sum(r.nbytes for r in done if isinstance(r, Committed))

    os.sync()
    t, cpu0 = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(threads) as ex:
        nbytes = sum(ex.map(batch, range(0, len(sources), BATCH)))
    if reaper is not None:
        reaper.close()  # every dump removed: the same work as layer 5's
        print(
            f"  reaper: {reaper.removed} removed on its thread, {reaper.inline} by the commit threads (bound)",
            file=sys.stderr,
        )
    dt, cpu = time.perf_counter() - t, time.process_time() - cpu0
    if j is not None:
        j.close()
    shutil.rmtree(out)
    return nbytes / dt / 1e6, cpu / len(sources) * 1000


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default=os.path.dirname(os.path.abspath(__file__)))
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--threads", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--layers", default="1,2,3,4,5,6,7", help="which layers beside the baseline (e.g. 4,5,6)"
    )
    a = p.parse_args()

    import torch
    from eagle3d.remote.dumpfile import write_dump
    from eagle3d.store import directio, splice

    torch.set_num_threads(1)
    t, h = a.tokens, a.hidden
    base = tempfile.mkdtemp(prefix="bench-breakdown-", dir=a.dir)
    shm = tempfile.mkdtemp(prefix="bench-breakdown-", dir="/dev/shm")
    try:
        aux = torch.randn(t, 3 * h).to(torch.bfloat16)
        hid = torch.randn(t, h).to(torch.bfloat16)
        serial = iter(range(1 << 30))

        def dumps() -> list[str]:
            for old in os.listdir(shm):
                os.unlink(os.path.join(shm, old))
            return [
                write_dump(shm, f"r{next(serial)}", torch.arange(t), aux, hid, [2, 16, 29])
                for _ in range(a.samples)
            ]

        first = dumps()[0]
        size = splice.stage(
            first, list(range(t)), [1] * t, h, [2, 16, 29], directio.DirectBuffer(), 1 << 34
        )
        assert size is not None
        nbytes = size.written.nbytes
        layers: list[tuple[str, Any]] = [
            (
                "dd bs=16M oflag=direct, the same bytes (baseline)",
                lambda: dd(base, a.samples * nbytes),
            ),
            (
                "1. one O_DIRECT file per sample, no sync",
                lambda: raw(base, a.samples, nbytes, a.threads, 1),
            ),
            ("2. + fdatasync per file", lambda: raw(base, a.samples, nbytes, a.threads, 2)),
            (
                "3. + rename, directory fsync per batch of 8",
                lambda: raw(base, a.samples, nbytes, a.threads, 3),
            ),
            (
                "4. + read the dump into the archive buffer, check, checksum",
                lambda: commits(base, dumps, t, h, a.threads, False),
            ),
            (
                "5. + a durable journal record per sample, the dump's unlink",
                lambda: commits(base, dumps, t, h, a.threads, True),
            ),
            (
                "6. as 5, the dumps removed by the reaper",
                lambda: commits(base, dumps, t, h, a.threads, True, reap=True),
            ),
            (
                "7. as 6, the reaper at the commit threads' priority (nice 0)",
                lambda: commits(base, dumps, t, h, a.threads, True, reap=True, nice=0),
            ),
        ]
        wanted = {int(x) for x in a.layers.split(",") if x}
        layers = [layers[0], *(layer for k, layer in enumerate(layers[1:], 1) if k in wanted)]
        results: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in layers}
        ratios: dict[str, list[float]] = {name: [] for name, _ in layers}
        for r in range(a.rounds):
            order = layers if r % 2 == 0 else [layers[0], *reversed(layers[1:])]
            got = {name: f() for name, f in order}
            for name, v in got.items():
                results[name].append(v)
                ratios[name].append(v[0] / got[layers[0][0]][0])
            print(
                f"round {r + 1} (load {os.getloadavg()[0]:.1f}): "
                + ", ".join(f"{v[0]:.0f}" for v in got.values()),
                file=sys.stderr,
            )
        print(
            f"{a.samples} samples of {nbytes / 1e6:.1f} MB ({t} tokens, H={h}, bfloat16), "
            f"{a.threads} threads, {a.rounds} interleaved rounds; medians\n"
        )
        print("| layer | MB/s | ratio to dd (each round) | CPU ms per sample |")
        print("|---|---|---|---|")
        for name, _ in layers:
            mbs = statistics.median(v[0] for v in results[name])
            cpu = statistics.median(v[1] for v in results[name])
            each = ", ".join(f"{x:.2f}" for x in ratios[name])
            print(
                f"| {name} | {mbs:,.0f} | **{statistics.median(ratios[name]):.2f}** ({each}) | "
                f"{cpu:.1f} |"
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
