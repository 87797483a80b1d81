#!/usr/bin/env python3
"""A commit's moving of one dump's bytes, as the daemon does it against what a commit that
never reads the states would cost: the reference for issue #32's next step.

Over ``--samples`` rounds of one dump-sized file (``--mb``, bfloat16 values) in the dump
area (``--dump-area``, a tmpfs), each round's CPU (``thread_time``):

* **now**: the file read (``preadv``, 256 KiB at a time) into a reused page-aligned buffer,
  each chunk checked for NaN/Inf and CRC'd while in cache, then written with ``O_DIRECT``
  to a file on ``--dir``'s disk and fdatasync'ed (the daemon's fast path, less its Python);
* **mapped**: the file mapped privately, one header page patched (copied on write), the
  whole written with ``O_DIRECT`` straight from the mapping, fdatasync'ed: no copy and no
  pass over the states on this CPU (what a dump already in the sample file's layout, its
  checks made where the states are, would leave to the daemon).

The two alternate, twice each. A tmpfs mounted ``huge=within_size`` keeps the file in 2 MiB
pages: run once with ``/dev/shm`` and once with such a mount to see what the pages cost.

    .venv/bin/python bench/commit_mapped.py [--dump-area /dev/shm] [--mb 6.5] [--samples 200]
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from scratch import scratch

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 256 << 10
BLOCK = 4096


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dump-area", default="/dev/shm")
    p.add_argument("--dir", default=str(ROOT / "bench"), help="where the writes go (its disk)")
    p.add_argument("--mb", type=float, default=6.5, help="the dump's size")
    p.add_argument("--samples", type=int, default=200)
    a = p.parse_args()

    size = int(a.mb * 1e6) // BLOCK * BLOCK + BLOCK  # whole blocks, as the archives are
    print(f"dump area {a.dump_area}, {size / 1e6:.1f} MB x {a.samples} a round:")
    with scratch("bench-commit-mapped-", a.dump_area, a.dir) as (area, disk):
        for kind, lo, hi in measure(os.path.join(area, "dump"), disk, size, a.samples):
            print(f"  {kind:7s} {lo:.3f}-{hi:.3f} CPU-s/GB")
    return 0


def measure(src: str, disk: str, size: int, samples: int) -> list[tuple[str, float, float]]:
    """(way, lowest, highest CPU-s/GB of two rounds) for "now" and "mapped" (docstring)."""
    import numpy as np
    from eagle3d.store.crc import crc32
    from eagle3d.store.validate import finite_bits

    with open(src, "wb") as f:
        f.write(np.full(size // 2, 0x3F00, np.uint16).tobytes())  # bfloat16 0.5
    buf = mmap.mmap(-1, size)

    def write(view: memoryview) -> None:
        out = os.path.join(disk, "sample")
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        try:
            assert os.pwrite(fd, view, 0) == size
            os.fdatasync(fd)
        finally:
            os.close(fd)
        os.unlink(out)

    def now() -> None:
        fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
        mv, crc = memoryview(buf), 0
        for off in range(0, size, CHUNK):
            part = mv[off : off + CHUNK]
            os.preadv(fd, [part], off)
            assert finite_bits(np.frombuffer(part, np.int16), 0x7F80)
            crc = crc32(part, crc)
        os.close(fd)
        write(mv)

    def mapped() -> None:
        fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
        m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        mv = memoryview(m)
        mv[:16] = bytes(16)  # a header field patched: its page copied on write
        write(mv)
        mv.release()
        m.close()

    def cpu(f: Callable[[], None]) -> float:
        t = time.thread_time()
        for _ in range(samples):
            f()
        return (time.thread_time() - t) / (samples * size / 1e9)

    figures: dict[str, list[float]] = {"now": [], "mapped": []}
    for _ in range(2):
        figures["now"].append(cpu(now))
        figures["mapped"].append(cpu(mapped))
    return [(k, min(v), max(v)) for k, v in figures.items()]


if __name__ == "__main__":
    sys.exit(main())
