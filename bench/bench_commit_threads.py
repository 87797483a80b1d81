"""Capacity of the commit path alone, by number of commit threads, on one disk.

Each thread validates nothing and reads nothing: it commits one in-memory dump over and over
(``torch.save`` with checksum, fdatasync, rename, directory fsync), so the figure is what
the output disk and this CPU allow per thread count, the ceiling of ``--commit-threads``.

    .venv/bin/python bench/bench_commit_threads.py [--dir DIR] [--tokens 300] [--hidden 256]
        [--dtype float32] [--samples 400] [--threads 1,2,4,8]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default=os.path.dirname(os.path.abspath(__file__)))
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--samples", type=int, default=400)
    p.add_argument("--threads", default="1,2,4,8")
    p.add_argument(
        "--journal",
        action="store_true",
        help="each commit also appends its durable 'saved' record to a journal on the same disk",
    )
    a = p.parse_args()

    import torch
    from eagle3d.dumps.format import read_dump
    from eagle3d.remote.dumpfile import write_dump
    from eagle3d.store.committer import Committer
    from eagle3proto import events as ev
    from eagle3proto.journal import JournalWriter

    t, h, dtype = a.tokens, a.hidden, getattr(torch, a.dtype)
    base = tempfile.mkdtemp(prefix="bench-commit-", dir=a.dir)
    try:
        ids = torch.randint(0, 1000, (t,))
        path = write_dump(
            base, "r", ids, torch.randn(t, 3 * h).to(dtype), torch.randn(t, h).to(dtype), [2, 4, 5]
        )
        dump = read_dump(path)
        ids_list, mask = ids.tolist(), [1] * t
        print(
            f"| commit threads | samples/s | MB/s | CPU ms per sample |  ({t} tokens, h{h}, {a.dtype}, {dump.nbytes / 1e6:.1f} MB per sample)"
        )
        print("|---|---|---|---|")
        for n in (int(x) for x in a.threads.split(",")):
            out = os.path.join(base, f"out-{n}")
            c = Committer(out)
            c.warm_up()
            journal = JournalWriter(os.path.join(out, "journal")) if a.journal else None
            if journal is not None:
                journal.open()

            def one(i: int, c: Committer = c, journal: JournalWriter | None = journal) -> None:
                done = c.commit(i, ids_list, mask, dump)
                if journal is not None:
                    journal.append(
                        ev.SampleSaved(
                            idx=i,
                            path=done.relpath,
                            bytes=done.nbytes,
                            tokens=t,
                            checksum=done.checksum,
                        )
                    )

            cpu, wall = time.process_time(), time.perf_counter()
            with ThreadPoolExecutor(n) as ex:
                list(ex.map(one, range(a.samples)))
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if journal is not None:
                journal.close()
            rate = a.samples / wall
            print(
                f"| {n} | {rate:,.0f} | {rate * dump.nbytes / 1e6:,.0f} | {cpu / a.samples * 1e3:.2f} |"
            )
            shutil.rmtree(out)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
