"""Pure formatting and the disk projection (no clock, no I/O)."""

from __future__ import annotations

from eagle3proto import events as ev
from eagle3proto.views import Rates, View
from eagle3top import fmt


def test_duration() -> None:
    assert fmt.duration(None) == "—"
    assert fmt.duration(float("inf")) == "—"
    assert fmt.duration(0) == "0 s"
    assert fmt.duration(42.4) == "42 s"
    assert fmt.duration(303) == "5 m 03 s"
    assert fmt.duration(14 * 60 + 37) == "14 m"
    assert fmt.duration(3 * 3600 + 10 * 60 + 5) == "3 h 10 m"
    assert fmt.duration(52 * 3600) == "2 d 4 h"


def test_size_count_rate_age() -> None:
    assert fmt.size(999) == "999 B"
    assert fmt.size(1_500_000) == "1.5 MB"
    assert fmt.size(3.5e12) == "3.5 TB"
    assert fmt.count(1234567) == "1,234,567"
    assert fmt.rate(1234.4, "tokens") == "1,234 tokens/s"
    assert fmt.rate(0.5, "samples") == "0.50 samples/s"
    assert fmt.age(None) == "never" and fmt.age(0.3) == "now" and fmt.age(75) == "1 m 15 s ago"


def test_clock_time_uses_the_given_offset() -> None:
    now = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC
    assert fmt.clock_time(now + 90, now, 0) == "08:01"
    assert fmt.clock_time(now + 90, now, 3600) == "09:01"
    assert fmt.clock_time(now + 90, now, 0, seconds=True) == "08:01:30"
    assert fmt.clock_time(now + 86400, now, 0) == "Sat 16 Jan 08:00"


def test_sparkline_and_bar() -> None:
    assert fmt.sparkline([]) == ""
    assert fmt.sparkline([0, 0]) == "▁▁"
    assert fmt.sparkline([0, 1, 2, 4]) == "▁▃▅█"
    assert fmt.bar(0.5, 4) == "██░░"
    assert fmt.bar(2.0, 3) == "███"


def _view(saved: int, total: int, bytes_saved: int, bytes_s: float) -> View:
    return View(
        saved=saved,
        total=total,
        remaining=total - saved,
        bytes_saved=bytes_saved,
        rate_1m=Rates(bytes_s=bytes_s),
    )


def _disk(free: int) -> ev.DiskUsage:
    return ev.DiskUsage(
        label="output", total_bytes=10**13, used_bytes=10**13 - free, free_bytes=free
    )


def test_disk_projection_fits_runs_out_full_and_unknown() -> None:
    v = _view(saved=100, total=1100, bytes_saved=100 * 10**8, bytes_s=10**7)  # 100 MB/sample
    fits = fmt.project_disk(v, _disk(200 * 10**9))
    assert fits is not None and fits.fits and fits.needed_bytes == 1000 * 10**8
    assert fits.describe() == "fits (100.0 GB more needed)"
    short = fmt.project_disk(v, _disk(50 * 10**9))
    assert short is not None and short.fits is False
    assert short.runs_out_in_s == 5000  # 50 GB at 10 MB/s
    assert short.describe() == "runs out in 1 h 23 m"
    full = fmt.project_disk(v, _disk(10 << 20))
    assert full is not None and full.full and full.describe() == "FULL (< reserve 268.4 MB)"
    nothing = fmt.project_disk(_view(0, 10, 0, 0.0), _disk(10**12))
    assert nothing is not None and nothing.fits is None
    assert nothing.describe() == "no projection yet"
    assert fmt.project_disk(v, None) is None
    stalled = fmt.project_disk(_view(100, 1100, 100 * 10**8, 0.0), _disk(50 * 10**9))
    assert stalled is not None and stalled.describe() == "does not fit (100.0 GB needed)"
