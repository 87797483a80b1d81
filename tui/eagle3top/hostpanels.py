"""Pure renderers for the panels about the host and the producer: disk, GPU, producer /
server. (rows, now, a width) in, Rich ``Text`` out, like :mod:`eagle3top.panels`.

A daemon that is gone (down, stopped, finished) left these readings behind: they are shown
as its last ones, with their age, and dimmed.
"""

from __future__ import annotations

from collections.abc import Iterator

from eagle3proto.events import GpuInfo, Stats
from eagle3proto.views import View
from rich.text import Text

from . import fmt
from .model import OK, STALE_AFTER_S, Health, Row
from .panels import BAD, DIM, GOOD, LEVEL_STYLE, WARN, overall, verdict
from .report import HW_THROTTLE, XID_CRITICAL_S, Report

#: The producer's own facts (``ProducerHealth.detail``) in words; None: not shown. A count
#: says its span: the producer's life (this session), or an SGLang server's (its own).
DETAIL_LABELS: dict[str, str | None] = {
    "workers": "workers",
    "threads_per_worker": "threads per worker",
    "device": "device",
    "dtype": "dtype",
    "inflight": "at the workers",
    "batch_fill": "batch fill",
    "moved": "moved to idle workers this session",
    "server_version": "server",
    "prompt_tokens_s": "prompt tokens/s",
    "prompt_tokens_total": "server's prompt tokens",
    "generation_tokens_total": "server's generated tokens",
    "cached_tokens_total": "server's cached tokens",
    "num_running_reqs": "running",
    "num_queue_reqs": "queued",
    "metrics": "metrics",
    "dumps": "dumps it made this session",
    "uptime_s": "its own uptime",
    "server_at": None,  # when /server_info was read: the stats age says it already
    "metrics_at": None,
}


def _host_stats(rows: list[Row]) -> Iterator[tuple[Row, Stats]]:
    """Each host's newest stats, once per host (its shards share its disks and GPUs)."""
    seen: set[str] = set()
    for r in rows:
        stats = r.state.stats if r.state else None
        if stats is None or r.host in seen:
            continue
        seen.add(r.host)
        yield r, stats


def _last_seen(t: Text, r: Row, now: float) -> bool:
    """Say that readings are a gone daemon's last ones, with their age; True if so."""
    if not r.gone() or r.state is None:
        return False
    age = r.view(now).ages.get("stats")
    t.append(f"last seen {fmt.age(age)} (the daemon is not running)\n", style=WARN)
    return True


def disk(rows: list[Row], now: float) -> Text:
    t = Text()
    for r, stats in _host_stats(rows):
        v = overall([x for x in rows if x.host == r.host], now)
        old = _last_seen(t, r, now)
        for d in stats.disk:
            if t and not t.plain.endswith("\n"):
                t.append("\n")
            used = d.total_bytes - d.free_bytes
            frac = used / d.total_bytes if d.total_bytes else 0.0
            style = DIM if old else (BAD if frac > 0.95 else (WARN if frac > 0.85 else ""))
            host = f" @{r.host}" if len({x.host for x in rows}) > 1 else ""
            t.append(f"{d.label}{host} ", style="bold")
            t.append(f"{fmt.size(used)} used, {fmt.size(d.free_bytes)} free", style=style)
            t.append(f" ({frac * 100:.0f}% full)", style=style or DIM)
            if d.label == "output" and not old:
                mine = [x.state.space_reserve_bytes for x in rows if x.host == r.host and x.state]
                p = fmt.project_disk(v, d, max(mine, default=-1))
                if p is not None:
                    good = p.fits is not False and not p.full
                    t.append(f"\n  at completion: {p.describe()}", style=GOOD if good else BAD)
    if not t:
        t.append("no stats yet (the daemon sends disk usage every second)", style=DIM)
    t.rstrip()
    return t


def _pack(items: list[tuple[str, str]], width: int, indent: int) -> Text:
    """``(words, style)`` items joined by `` · `` and wrapped at ``width`` (whole items)."""
    t = Text()
    col = indent
    t.append(" " * indent)
    for k, (words, style) in enumerate(items):
        sep = " · " if k else ""
        if k and col + len(sep) + len(words) > width:
            t.append("\n" + " " * indent)
            col, sep = indent, ""
        t.append(sep, style=DIM)
        t.append(words, style=style)
        col += len(sep) + len(words)
    return t


def gpu_lines(g: GpuInfo, now: float, old: bool = False, width: int = 46) -> Text:
    """One device: its readings, then its health (ECC, XID, throttling) wrapped to ``width``."""
    t = Text()
    mem = g.mem_used_bytes / g.mem_total_bytes if g.mem_total_bytes else 0.0
    t.append(f"gpu{g.index} ", style="bold")
    t.append(
        f"{g.util_percent:3.0f}% ", style=DIM if old else (GOOD if g.util_percent >= 50 else WARN)
    )
    t.append(f"{g.mem_used_bytes / 1e9:.0f}/{g.mem_total_bytes / 1e9:.0f} GB ")
    hot = g.temperature_c >= 85
    t.append(f"{g.temperature_c:.0f}C ", style=BAD if hot and not old else "")
    limit = f"/{g.power_limit_w:.0f}" if g.power_limit_w else ""
    t.append(f"{g.power_w:.0f}{limit} W", style="" if mem < 0.95 or old else WARN)
    if g.name and len(t) + 2 + len(g.name) <= width:
        t.append(f"  {g.name}", style=DIM)
    items = [
        (
            f"ECC {g.ecc_errors} uncorrected, {g.ecc_corrected} corrected",
            BAD if g.ecc_errors and not old else DIM,
        )
    ]
    if g.xid_errors:
        ago = now - g.last_xid_ts if g.last_xid_ts else None
        recent = ago is not None and ago <= XID_CRITICAL_S
        more = f" ({g.xid_errors} in all)" if g.xid_errors > 1 else ""
        items.append(
            (f"XID {g.last_xid} {fmt.age(ago)}{more}", BAD if recent and not old else WARN)
        )
    else:
        items.append(("no XID", DIM))
    if g.throttle:
        hw = any(x in HW_THROTTLE for x in g.throttle)
        items.append((f"throttle: {', '.join(g.throttle)}", BAD if hw and not old else WARN))
    t.append("\n")
    t.append_text(_pack(items, width, 5))
    return t


def gpus(rows: list[Row], now: float, width: int = 46) -> Text:
    t = Text()
    for r, stats in _host_stats(rows):
        host = f"@{r.host} " if len({x.host for x in rows}) > 1 else ""
        old = _last_seen(t, r, now)
        if not stats.gpus:
            t.append(fmt.wrap(f"{host}{stats.gpu_note or 'no GPU'}", width) + "\n", style=DIM)
        for g in stats.gpus:
            if host:
                t.append(host, style=DIM)
            t.append_text(gpu_lines(g, now, old, width))
            t.append("\n")
    t.rstrip()
    if not t:
        t.append("no stats yet", style=DIM)
    return t


def _producer_state(t: Text, r: Row, h: Health, now: float, width: int = 62) -> None:
    """The producer's state as the verdict sees it (loading, waiting, down, up)."""
    s = r.state
    assert s is not None
    p = s.stats.producer if s.stats else None
    name = (p.name if p and p.name else "") or (s.job.backend if s.job else "producer")
    t.append(f"{name} ", style="bold")
    if h.state in ("starting", "loading", "waiting", "producer_down"):
        style = LEVEL_STYLE[h.level] if h.level != OK else WARN
        t.append(fmt.wrap(h.reason, width, start=len(name) + 1), style=style)
        return
    if r.gone():
        t.append("was " + ("up" if p is not None and p.up else "down"), style=DIM)
    elif s.producer == "restarting":
        t.append(f"restarting: {s.producer_message}", style=WARN)
    elif p is not None:
        t.append("up" if p.up else "DOWN", style=GOOD if p.up else BAD)
    if p is not None:
        t.append(f"  latency {p.latency_s:.2f} s  restarts {p.restarts} this session")


def producer(rows: list[Row], now: float, report: Report | None = None, width: int = 62) -> Text:
    """Producer and daemon health: a few lines for one shard, one compact line per shard."""
    report = report or verdict(rows, now)
    t = Text()
    compact = len(rows) > 1
    for r, h in report.health:
        s = r.state
        if s is None:
            continue
        if t:
            t.append("\n")
        v = r.view(now)
        if compact:
            t.append(f"{r.label[:24]:25}", style=DIM)
        else:
            _last_seen(t, r, now)
        if s.stats is None and h.state not in ("starting", "loading", "waiting"):
            t.append("producer: no stats yet", style=DIM)
        else:
            _producer_state(t, r, h, now, width)
        p = s.stats.producer if s.stats else None
        if compact:
            if s.stats and not r.gone():
                t.append(f"  cpu {s.stats.cpu_percent:.0f}%", style=DIM)
            continue
        if p is not None and p.detail:
            t.append("\n" + _detail_lines(p.detail, width), style=DIM)
        t.append("\n")
        t.append_text(counters(v))
        if s.stats:
            t.append(
                f"\ndaemon cpu {s.stats.cpu_percent:.0f}%  rss {fmt.size(s.stats.rss_bytes)}",
                style=DIM,
            )
            if s.stats.producer_rss_bytes:
                t.append(f"  workers rss {fmt.size(s.stats.producer_rss_bytes)}", style=DIM)
            age = v.ages.get("stats")
            if age is not None and age > STALE_AFTER_S and not r.gone():
                # Fresh stats need no repaint each second.
                t.append(f"  stats {fmt.age(age)}", style=WARN)
        if s.recovered:
            t.append(f"\njournal recovered: {s.recovered[-1]}", style=WARN)
    if not t:
        t.append("no data", style=DIM)
    return t


#: The daemon's counters, each over two spans: (label, whole-job field, this-session field).
COUNTERS = (
    ("requests", "requests", "session_requests"),
    ("dumps", "dumps", "session_dumps"),
    ("retries", "retries", "session_retries"),
    ("orphan dumps", "orphans", "session_orphans"),
)


def counters(v: View) -> Text:
    """The daemon's own counts (from the journal) as a small table: one row over this
    session, one over the whole job, so no count stands beside one of another span."""
    cols = [(label, max(len(label), 9) + 2) for label, _, _ in COUNTERS]  # 9: "1,000,000"
    t = Text()
    t.append(f"{'':12}" + "".join(f"{label:>{w}}" for label, w in cols), style=DIM)
    for span, pick in (("this session", 2), ("whole job", 1)):
        values = [fmt.count(getattr(v, c[pick])) for c in COUNTERS]
        t.append(f"\n{span:12}", style=DIM)
        t.append("".join(f"{x:>{w}}" for x, (_, w) in zip(values, cols, strict=True)))
    return t


def _detail_value(key: str, val: float | str) -> str:
    if key == "batch_fill" and isinstance(val, float):
        return f"{val * 100:.0f}%"
    if key == "uptime_s" and isinstance(val, float):
        return fmt.duration(val)
    if isinstance(val, float):
        if val.is_integer():
            return f"{int(val):,}"
        return f"{val:,.1f}" if abs(val) >= 10 else f"{val:.3g}"
    return str(val)


def _detail_lines(detail: dict[str, float | str], width: int = 62) -> str:
    """The producer's own facts as ``label value`` pairs in the order of DETAIL_LABELS
    (unknown keys after, in words), wrapped to the panel (three lines at most)."""
    order = {k: i for i, k in enumerate(DETAIL_LABELS)}
    lines, line = [], ""
    for k in sorted(detail, key=lambda k: (order.get(k, len(order)), k)):
        label = DETAIL_LABELS.get(k, k.replace("_", " "))
        if label is None:
            continue
        item = f"{label} {_detail_value(k, detail[k])}"
        if line and len(line) + 3 + len(item) > width:
            lines.append(line)
            line = item
        else:
            line = f"{line} · {item}" if line else item
    return "\n".join([*lines, line][:3])
