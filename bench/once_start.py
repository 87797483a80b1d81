#!/usr/bin/env python3
"""``eagle3-top --once`` against the interpreter's own start: the whole process, timed from
outside, paired run by run (``--once``, then ``python -c pass``, and again), so that a
machine whose speed drifts moves both sides of each ratio alike.

Prints the median wall seconds of each, the median of the per-pair ratios, and the median
CPU seconds (user + system of the child, from ``os.wait4``: steadier than wall time on a
loaded machine). The monitor's code is whatever ``PYTHONPATH`` / the venv gives; with
``PYTHONDONTWRITEBYTECODE=1`` and no ``__pycache__`` every start compiles its sources.

    .venv/bin/python bench/once_start.py --output OUT [--runs 21] [-- EXTRA ARGS]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def timed(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of ``argv``, its output thrown away."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, _, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = 0
    return wall, ru.ru_utime + ru.ru_stime


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", required=True)
    ap.add_argument("--runs", type=int, default=21)
    ap.add_argument("extra", nargs="*")
    args = ap.parse_args(argv)
    once = [sys.executable, "-m", "eagle3top", "--once", "--output", args.output, *args.extra]
    bare = [sys.executable, "-c", "pass"]
    timed(once), timed(bare)  # warm the page cache
    a, b = [], []
    for _ in range(args.runs):
        a.append(timed(once))
        b.append(timed(bare))
    med = statistics.median
    print(f"--once        wall {med(x for x, _ in a):.3f} s  cpu {med(c for _, c in a):.3f} s")
    print(f"python -c pass wall {med(x for x, _ in b):.3f} s  cpu {med(c for _, c in b):.3f} s")
    print(
        f"ratio (median of pairs): wall {med(x[0] / y[0] for x, y in zip(a, b, strict=True)):.2f}"
        f"  cpu {med(x[1] / y[1] for x, y in zip(a, b, strict=True)):.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
