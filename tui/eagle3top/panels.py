"""Pure renderers for the TUI panels: (rows, now) in, Rich ``Text`` out.

No widgets and no clock here, so every panel can be tested as plain text and the screen is
deterministic for a given ``now``. Colours are the 16 named ANSI ones (readable in 256
colours over ssh, where ``COLORTERM`` does not pass).
"""

from __future__ import annotations

from collections.abc import Iterator

from eagle3proto import reducer
from eagle3proto.events import Stats
from eagle3proto.reducer import View
from rich.text import Text

from . import fmt
from .model import STALE_AFTER_S, Row, health, totals, worst

OK, WARN, BAD, DIM, ACCENT = "green", "yellow", "bold red", "bright_black", "cyan"
STATE_STYLE = {
    "running": "bold green",
    "finished": "bold cyan",
    "stalled": "bold yellow",
    "stopped": "bold yellow",
    "down": "bold red",
    "unknown": "bold magenta",
}
SPARK_SECONDS = 300
SPARK_BINS = 30


def overall(rows: list[Row], now: float) -> View:
    """The view the single-value panels show: the one shard, or the sum of all."""
    if len(rows) == 1:
        return rows[0].view(now)
    return totals(rows, now)


def overall_state(rows: list[Row], now: float) -> str:
    return worst([health(r, now).state for r in rows]) if rows else "unknown"


def header(rows: list[Row], now: float, paused: bool, tz_offset_s: float | None = None) -> Text:
    t = Text()
    t.append(" eagle3-top ", style="bold reverse")
    st = overall_state(rows, now)
    t.append("  ")
    t.append(f" {st.upper()} ", style=f"{STATE_STYLE.get(st, '')} reverse")
    outputs = sorted({r.output for r in rows if r.output})
    hosts = sorted({r.host for r in rows if r.host})
    if outputs:
        t.append(f"  {outputs[0]}" + (f" (+{len(outputs) - 1})" if len(outputs) > 1 else ""))
    if hosts:
        t.append(f"  on {', '.join(hosts)}", style=DIM)
    t.append(f"  {fmt.clock_time(now, now, tz_offset_s)}", style=DIM)
    if paused:
        t.append("  ")
        t.append(" PAUSED (p to resume) ", style="bold black on yellow")
    return t


def connection_text(row: Row, now: float) -> tuple[str, str]:
    """One row's connection as words and a style: live / STALE / journal / disconnected."""
    retry = ""
    if row.retry_at is not None:
        retry = f", retrying in {max(int(row.retry_at - now + 0.999), 0)} s"
    if row.conn == "live":
        quiet = now - row.last_msg if row.last_msg is not None else None
        if quiet is not None and quiet > STALE_AFTER_S:
            return f"STALE for {int(quiet)} s: no message from the daemon ({row.source})", BAD
        return f"live ({row.source})", OK
    if row.conn == "journal":
        who = {True: "daemon up, socket unreachable", False: "daemon down"}.get(
            row.alive,  # type: ignore[arg-type]
            "daemon state unknown",
        )
        newest = row.view(now).age_s
        # No retry countdown here: the journal is being read, and a line that changes every
        # second would repaint an otherwise idle screen every second.
        via = f" ({row.source})" if row.source not in ("", "journal") else ""  # ssh/journal
        return (
            f"journal{via}: {who}; newest record {fmt.age(newest)}",
            WARN if row.alive else BAD,
        )
    if row.conn == "connecting":
        return "connecting...", WARN
    why = f": {row.error}" if row.error else ""
    return f"disconnected{why}{retry}", BAD


def connection(rows: list[Row], now: float) -> Text:
    t = Text()
    for i, r in enumerate(rows):
        words, style = connection_text(r, now)
        if i:
            t.append("\n")
        if len(rows) > 1:
            t.append(f"{r.label}: ", style=DIM)
        t.append("● ", style=style)
        t.append(words, style=style if style != OK else "")
    return t


def _changed(rows: list[Row], now: float, key: str) -> float | None:
    ages = [r.view(now).changed_ago.get(key) for r in rows if r.state is not None]
    known = [a for a in ages if a is not None]
    return min(known) if known else None


def pipeline(rows: list[Row], now: float) -> Text:
    v = overall(rows, now)
    cols = [("sent", v.sent), ("dumped", v.dumped), ("saved", v.saved), ("failed", v.failed)]
    t = Text()
    for name, _ in cols:
        t.append(f"{name:<16}", style="bold")
    t.append("\n")
    for name, n in cols:
        style = BAD if name == "failed" and n else ("bold green" if name == "saved" else "")
        t.append(f"{fmt.count(n):<16}", style=style)
    t.append("\n")
    for name, _ in cols:
        t.append(f"{fmt.age(_changed(rows, now, name)):<16}", style=DIM)
    t.append("\n")
    total = "?" if v.total < 0 else fmt.count(v.total)
    t.append(f"total {total}  {v.percent:5.1f}% ")
    t.append(fmt.bar(v.percent / 100, 30), style="green")
    t.append(f" {fmt.count(v.remaining)} left", style=DIM)
    t.append(f"\nin flight (sent-dumped) {fmt.count(v.in_flight):<8}")
    t.append(f"committing (dumped-saved) {fmt.count(v.committing)}")
    return t


def _series(rows: list[Row], now: float, field: str) -> list[int]:
    per = SPARK_SECONDS // SPARK_BINS
    total = [0] * SPARK_SECONDS
    for r in rows:
        if r.state is None:
            continue
        for i, x in enumerate(reducer.sparkline(r.state.history, now, SPARK_SECONDS, field)):
            total[i] += x
    return [sum(total[i : i + per]) for i in range(0, SPARK_SECONDS, per)]


def throughput(rows: list[Row], now: float) -> Text:
    v = overall(rows, now)
    t = Text()
    span = f"last {SPARK_SECONDS // 60} min"
    t.append(f"{'':8}{'10 s':<13}{'1 min':<13}{span}\n", style=DIM)
    lines = [
        ("samples", f"{v.rate.samples_s:.2f}/s", f"{v.rate_1m.samples_s:.2f}/s", "samples"),
        ("tokens", f"{v.rate.tokens_s:,.0f}/s", f"{v.rate_1m.tokens_s:,.0f}/s", "tokens"),
        ("MB", f"{v.rate.bytes_s / 1e6:,.1f}/s", f"{v.rate_1m.bytes_s / 1e6:,.1f}/s", "bytes"),
    ]
    for i, (label, a, b, field) in enumerate(lines):
        if i:
            t.append("\n")
        t.append(f"{label:8}{a:<13}{b:<13}")
        t.append(fmt.sparkline(_series(rows, now, field)), style=ACCENT)
    return t


def eta(rows: list[Row], now: float, tz_offset_s: float | None = None) -> Text:
    v = overall(rows, now)
    t = Text()
    st = overall_state(rows, now)
    if v.state == "finished" or st == "finished":
        t.append("finished", style="bold cyan")
        return t
    t.append(f"ETA  {fmt.duration(v.eta_s)}", style="bold")
    if v.eta_s is not None and v.eta_s > 0:
        t.append(f"\nfinish  {fmt.clock_time(now + v.eta_s, now, tz_offset_s)}")
    else:
        t.append("\nfinish  —", style=DIM)
    starts = [r.state.session_start_ts for r in rows if r.state and r.state.session_start_ts]
    if starts:
        t.append(f"\nrunning for  {fmt.duration(now - min(starts))}", style=DIM)
    if v.eta_s is None and v.remaining:
        t.append("\n(no saved samples in the last minute)", style=DIM)
    return t


def _host_stats(rows: list[Row]) -> Iterator[tuple[Row, Stats]]:
    """Each host's newest stats, once per host (its shards share its disks and GPUs)."""
    seen: set[str] = set()
    for r in rows:
        stats = r.state.stats if r.state else None
        if stats is None or r.host in seen:
            continue
        seen.add(r.host)
        yield r, stats


def disk(rows: list[Row], now: float) -> Text:
    t = Text()
    for r, stats in _host_stats(rows):
        v = overall([x for x in rows if x.host == r.host], now)
        for d in stats.disk:
            if t:
                t.append("\n")
            used = d.total_bytes - d.free_bytes
            frac = used / d.total_bytes if d.total_bytes else 0.0
            style = BAD if frac > 0.95 else (WARN if frac > 0.85 else "")
            host = f" @{r.host}" if len({x.host for x in rows}) > 1 else ""
            t.append(f"{d.label}{host} ", style="bold")
            t.append(f"{fmt.size(used)} used, {fmt.size(d.free_bytes)} free", style=style)
            t.append(f" ({frac * 100:.0f}% full)", style=style or DIM)
            if d.label == "output":
                p = fmt.project_disk(v, d)
                if p is not None:
                    good = p.fits and not p.full
                    t.append(f"\n  at completion: {p.describe()}", style=OK if good else BAD)
    if not t:
        t.append("no stats yet (the daemon sends disk usage every second)", style=DIM)
    return t


def gpus(rows: list[Row], now: float) -> Text:
    t = Text()
    for r, stats in _host_stats(rows):
        host = f"@{r.host} " if len({x.host for x in rows}) > 1 else ""
        if not stats.gpus:
            t.append(f"{host}{stats.gpu_note or 'no GPU'}\n", style=DIM)
        for g in stats.gpus:
            mem = g.mem_used_bytes / g.mem_total_bytes if g.mem_total_bytes else 0.0
            hot = g.temperature_c >= 85 or g.ecc_errors or any("hw" in x for x in g.throttle)
            t.append(f"{host}gpu{g.index} ", style="bold")
            t.append(f"{g.util_percent:3.0f}% ", style=OK if g.util_percent >= 50 else WARN)
            t.append(f"{g.mem_used_bytes / 1e9:.0f}/{g.mem_total_bytes / 1e9:.0f} GB ")
            t.append(f"{g.temperature_c:.0f}C {g.power_w:.0f} W", style="" if mem < 0.95 else WARN)
            if g.ecc_errors:
                t.append(f" ECC {g.ecc_errors}", style=BAD)
            if g.throttle:
                t.append(f" throttle: {','.join(g.throttle)}", style=BAD if hot else WARN)
            t.append("\n")
    t.rstrip()
    if not t:
        t.append("no stats yet", style=DIM)
    return t


def producer(rows: list[Row], now: float) -> Text:
    """Producer and daemon health: three lines for one shard, one compact line per shard."""
    t = Text()
    compact = len(rows) > 1
    for r in rows:
        s = r.state
        if s is None:
            continue
        if t:
            t.append("\n")
        v = r.view(now)
        p = s.stats.producer if s.stats else None
        if compact:
            t.append(f"{r.label[:24]:25}", style=DIM)
        if p is None:
            t.append("producer: no stats yet", style=DIM)
        else:
            t.append(f"{p.name or 'producer'} ")
            t.append("up" if p.up else "DOWN", style=OK if p.up else BAD)
            t.append(f"  latency {p.latency_s:.2f} s  restarts {p.restarts}")
            if not compact and p.detail:
                t.append("\n" + _detail_lines(p.detail), style=DIM)
        if compact:
            if s.stats:
                t.append(f"  cpu {s.stats.cpu_percent:.0f}%", style=DIM)
            continue
        t.append(f"\nrequests {fmt.count(v.requests)}  retries {fmt.count(v.retries)}")
        t.append(f"  orphans {fmt.count(v.orphans)}")
        if s.stats:
            t.append(
                f"\ndaemon cpu {s.stats.cpu_percent:.0f}%  rss {fmt.size(s.stats.rss_bytes)}",
                style=DIM,
            )
            age = v.ages.get("stats")
            if age is not None and age > STALE_AFTER_S:  # fresh stats need no repaint each second
                t.append(f"  stats {fmt.age(age)}", style=WARN)
        if s.recovered:
            t.append(f"\njournal recovered: {s.recovered[-1]}", style=WARN)
    if not t:
        t.append("no data", style=DIM)
    return t


def errors(rows: list[Row], now: float, limit: int = 12, tz_offset_s: float | None = None) -> Text:
    items = []
    for r in rows:
        if r.state is None:
            continue
        for e in r.state.errors:
            items.append((e.ts, r.label, e))
    items.sort(key=lambda x: x[0])
    t = Text()
    for ts, label, e in items[-limit:]:
        if t:
            t.append("\n")
        who = f"{label} " if len(rows) > 1 else ""
        # Wall-clock time, not "N s ago": it matches the daemon's log and needs no repaint.
        t.append(f"{fmt.clock_time(ts, now, tz_offset_s, seconds=True)} ", style=DIM)
        t.append(f"{who}#{e.idx} ")
        t.append(e.error, style=BAD if not e.retry else WARN)
        t.append(f" attempt {e.attempt}{' (retrying)' if e.retry else ''}: {e.message}")
    if not t:
        t.append("none", style=DIM)
    return t


def fleet(rows: list[Row], now: float) -> Text:
    """One line per shard/host plus totals (shown when there is more than one row)."""
    t = Text()
    head = f"{'shard':28}{'state':10}{'saved':>12}{'total':>12}{'%':>7}{'samples/s':>11}{'ETA':>12}  conn"
    t.append(head, style="bold")
    for r in rows:
        v = r.view(now)
        st = health(r, now).state
        conn, style = connection_text(r, now)
        t.append(f"\n{r.label[:27]:28}")
        t.append(f"{st:10}", style=STATE_STYLE.get(st, ""))
        total = "?" if v.total < 0 else fmt.count(v.total)
        t.append(f"{fmt.count(v.saved):>12}{total:>12}{v.percent:6.1f}%{v.rate_1m.samples_s:11.2f}")
        t.append(f"{fmt.duration(v.eta_s):>12}  ")
        t.append(conn.split(":")[0][:24], style=style)
    v = totals(rows, now)
    total = "?" if v.total < 0 else fmt.count(v.total)
    t.append(f"\n{'total':28}{overall_state(rows, now):10}", style="bold")
    t.append(f"{fmt.count(v.saved):>12}{total:>12}{v.percent:6.1f}%{v.rate_1m.samples_s:11.2f}")
    t.append(f"{fmt.duration(v.eta_s):>12}", style="bold")
    return t


def _detail_lines(detail: dict[str, float | str], width: int = 62) -> str:
    """The producer's own facts, ``key value`` pairs sorted by key, wrapped to the panel
    (three lines at most)."""
    lines, line = [], ""
    for k, val in sorted(detail.items()):
        shown = str(int(val)) if isinstance(val, float) and val.is_integer() else str(val)
        item = f"{k} {shown}"
        if line and len(line) + 2 + len(item) > width:
            lines.append(line)
            line = item
        else:
            line = f"{line}  {item}" if line else item
    return "\n".join([*lines, line][:3])
