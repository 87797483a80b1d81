"""Pure formatting and projection: numbers in, short strings out. No I/O, no clock.

Durations and rates are :mod:`eagle3proto.units`'s, shared with the daemon's STATUS line and
progress line.

Everything a screen or ``--once`` prints goes through here, so the TUI, the text report
and the tests agree on "3 h 10 m", "1.2 GB" and whether the disk fits.
"""

from __future__ import annotations

import textwrap
import time

import msgspec
from eagle3proto import events as ev
from eagle3proto.units import duration as duration  # re-exported: fmt.duration, fmt.rate, fmt.size
from eagle3proto.units import rate as rate
from eagle3proto.units import size as size
from eagle3proto.views import View

_SPARK = "▁▂▃▄▅▆▇█"


def count(n: int) -> str:
    return f"{n:,}"


def age(seconds: float | None) -> str:
    """Age of a fact: ``now``, ``3 s ago``, ``2 m 10 s ago``; ``never`` when unknown."""
    if seconds is None:
        return "never"
    if seconds < 1:
        return "now"
    return f"{duration(seconds)} ago"


def clock_time(
    ts: float, now: float, tz_offset_s: float | None = None, seconds: bool = False
) -> str:
    """Wall-clock time of ``ts`` as ``HH:MM[:SS]`` (with the date if not ``now``'s day)."""
    off = _tz_offset(ts) if tz_offset_s is None else tz_offset_s
    t = time.gmtime(ts + off)
    n = time.gmtime(now + off)
    hm = "%H:%M:%S" if seconds else "%H:%M"
    if (t.tm_year, t.tm_yday) == (n.tm_year, n.tm_yday):
        return time.strftime(hm, t)
    return time.strftime(f"%a %d %b {hm}", t)


def _tz_offset(ts: float) -> float:
    lt = time.localtime(ts)
    return float(lt.tm_gmtoff or 0)


def sparkline(values: list[int] | list[float]) -> str:
    """Unicode block sparkline scaled to the maximum of ``values``."""
    if not values:
        return ""
    top = max(values)
    if top <= 0:
        return _SPARK[0] * len(values)
    return "".join(
        _SPARK[min(int(v / top * (len(_SPARK) - 1) + 0.5), len(_SPARK) - 1)] for v in values
    )


def chart(values: list[int] | list[float], rows: int) -> list[str]:
    """A bar chart ``rows`` lines high (top line first), one column per value, scaled to the
    maximum; eighth blocks give each column ``8 * rows`` steps."""
    top = max(values, default=0)
    steps = [round(v / top * 8 * rows) if top > 0 else 0 for v in values]
    out = []
    for r in range(rows - 1, -1, -1):
        line = []
        for n in steps:
            level = n - 8 * r
            line.append("█" if level >= 8 else (" " if level <= 0 else _SPARK[level - 1]))
        out.append("".join(line))
    return out


def bar(fraction: float, width: int) -> str:
    """A text progress bar of ``width`` cells."""
    f = min(max(fraction, 0.0), 1.0)
    full = int(f * width)
    return "█" * full + "░" * (width - full)


#: The default ``--space-reserve``: below this much free space the output filesystem counts
#: as full where the journal does not record the job's own reserve.
DISK_FULL_BYTES = 256 << 20


class DiskProjection(msgspec.Struct, frozen=True):
    """Will the rest of the job fit on the output filesystem?"""

    free_bytes: int
    total_bytes: int
    needed_bytes: int | None  # bytes still to write at the current mean sample size
    fits: bool | None  # None: nothing saved yet, cannot project
    runs_out_in_s: float | None  # at the current write rate, when it does not fit
    full: bool  # below the job's reserve (the run's --space-reserve)
    reserve_bytes: int = DISK_FULL_BYTES  # the job's, or the default where not recorded

    def describe(self) -> str:
        if self.full:
            return f"FULL (< reserve {size(self.reserve_bytes)})"
        if self.fits is None:
            return "no projection yet"
        if self.fits:
            return f"fits ({size(self.needed_bytes)} more needed)"
        if self.runs_out_in_s is not None:
            return f"runs out in {duration(self.runs_out_in_s)}"
        return f"does not fit ({size(self.needed_bytes)} needed)"

    def numbers(self) -> str:
        """The free space, the reserve and what the rest needs, in words."""
        said = f"{size(self.free_bytes)} free, reserve {size(self.reserve_bytes)}"
        if self.needed_bytes is not None:
            said += f", the job needs ~{size(self.needed_bytes)} more"
        return said


def project_disk(v: View, disk: ev.DiskUsage | None, reserve: int = -1) -> DiskProjection | None:
    """Project the size at completion against the free space of the output filesystem.

    ``reserve`` is the job's space reserve (``run_started``'s ``space_reserve_bytes``; -1:
    not recorded, the default reserve is assumed): the disk is full only below it."""
    if disk is None:
        return None
    reserve = reserve if reserve >= 0 else DISK_FULL_BYTES
    full = disk.free_bytes < reserve
    if v.saved <= 0 or v.total < 0:
        return DiskProjection(disk.free_bytes, disk.total_bytes, None, None, None, full, reserve)
    per_sample = v.bytes_saved / v.saved
    needed = int(per_sample * v.remaining)
    fits = needed <= disk.free_bytes
    runs_out = None
    if not fits and v.rate_1m.bytes_s > 0:
        runs_out = disk.free_bytes / v.rate_1m.bytes_s
    return DiskProjection(disk.free_bytes, disk.total_bytes, needed, fits, runs_out, full, reserve)


def find_disk(stats: ev.Stats | None, label: str) -> ev.DiskUsage | None:
    if stats is None:
        return None
    return next((d for d in stats.disk if d.label == label), None)


def wrap(words: str, width: int, indent: int = 2, start: int = 0) -> str:
    """``words`` wrapped at ``width`` when the first line starts at column ``start``, later
    lines indented by ``indent`` (a note or a reason must never be cut)."""
    lines = textwrap.wrap(
        words, max(width, 20), initial_indent=" " * start, subsequent_indent=" " * indent
    )
    return "\n".join(lines or [""])[start:]


def truncation(truncated: int, dropped: int, saved: int) -> str:
    """``12 of 601 saved samples truncated to max_length (3,400 tokens dropped)``."""
    lost = f" ({count(dropped)} tokens dropped)" if dropped else ""
    return f"{count(truncated)} of {count(saved)} saved samples truncated to max_length{lost}"
