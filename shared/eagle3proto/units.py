"""Durations and rates in words: the one formatter of the daemon (STATUS, the progress line,
its log) and the monitor (the TUI, ``--once``), so both say "3 h 10 m" and "1.25 samples/s"
the same way. Pure."""

from __future__ import annotations

import math


def duration(seconds: float | None) -> str:
    """``42 s``, ``5 m 03 s``, ``3 h 10 m``, ``2 d 4 h``; ``—`` when unknown."""
    if seconds is None or math.isnan(seconds) or math.isinf(seconds):
        return "—"
    s = int(max(seconds, 0.0) + 0.5)
    if s < 60:
        return f"{s} s"
    m, s = divmod(s, 60)
    if m < 10:
        return f"{m} m {s:02d} s"
    if m < 60:
        # Seconds are noise at this scale, and a value that changes every second costs a
        # repaint every second.
        return f"{m} m"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h} h {m:02d} m"
    d, h = divmod(h, 24)
    return f"{d} d {h} h"


def rate(x: float, unit: str) -> str:
    """``1.25 samples/s``, ``12.3 tok/s``, ``1,234 MB/s``: the precision that still says something."""
    if x >= 100:
        return f"{x:,.0f} {unit}/s"
    if x >= 10:
        return f"{x:.1f} {unit}/s"
    return f"{x:.2f} {unit}/s"


def size(n: float | None) -> str:
    """Bytes with SI units (powers of 1000, like ``df -H``); ``—`` when unknown."""
    if n is None:
        return "—"
    n = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"  # pragma: no cover
