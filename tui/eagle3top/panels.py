"""Pure renderers for the TUI panels: (rows, now, the verdict, a width) in, Rich ``Text`` out
(the disk, GPU and producer panels are in :mod:`eagle3top.hostpanels`).

No widgets and no clock here, so every panel can be tested as plain text and the screen is
deterministic for a given ``now``. The header shows the same :class:`~eagle3top.report.Report`
``--once`` computes. Words are labels an operator reads, not field names. Colours are the 16
named ANSI ones (readable in 256 colours over ssh, where ``COLORTERM`` does not pass).
"""

from __future__ import annotations

from eagle3proto import reducer, views
from eagle3proto.views import View
from rich.text import Text

from . import fmt
from .model import CRITICAL, OK, STALE_AFTER_S, UNKNOWN, WARNING, Row, totals
from .report import Report

GOOD, WARN, BAD, DIM, ACCENT = "green", "yellow", "bold red", "bright_black", "cyan"
LEVEL_STYLE = {OK: "green", WARNING: "yellow", CRITICAL: "red", UNKNOWN: "magenta"}
SPARK_SECONDS = 300


def overall(rows: list[Row], now: float) -> View:
    """The view the single-value panels show: the one shard, or the sum of all."""
    if len(rows) == 1:
        return rows[0].view(now)
    return totals(rows, now)


def verdict(rows: list[Row], now: float) -> Report:
    """The report ``--once`` would print for these rows now."""
    return Report.judge(rows, now)


def _state_word(state: str) -> str:
    return state.replace("_", " ").upper()


def header(
    rows: list[Row],
    now: float,
    frozen: bool,
    tz_offset_s: float | None = None,
    report: Report | None = None,
) -> Text:
    """``eagle3-top  RUNNING  OK  /data/out  on host  12:00``: the verdict, coloured by level."""
    report = report or verdict(rows, now)
    style = LEVEL_STYLE[report.exit_code]
    t = Text()
    t.append(" eagle3-top ", style="bold reverse")
    t.append("  ")
    t.append(f" {_state_word(report.state)} ", style=f"bold {style} reverse")
    t.append(f" {report.level_word} ", style=f"bold {style}")
    outputs = sorted({r.output for r in rows if r.output})
    hosts = sorted({r.host for r in rows if r.host})
    if outputs:
        t.append(f" {outputs[0]}" + (f" (+{len(outputs) - 1})" if len(outputs) > 1 else ""))
    if hosts:
        t.append(f"  on {', '.join(hosts)}", style=DIM)
    t.append(f"  {fmt.clock_time(now, now, tz_offset_s)}", style=DIM)
    if frozen:
        t.append("  ")
        t.append(" SCREEN FROZEN (p to resume) ", style="bold black on yellow")
    return t


def verdict_line(
    report: Report, rows: list[Row], now: float, most: int = 3, width: int = 116
) -> Text:
    """The reason under the header in the level's colour, then up to ``most - 1`` more of
    the report's messages (each in its own level's colour), then how many are left out."""
    style = LEVEL_STYLE[report.exit_code]
    t = Text()
    reason = report.reason
    if not reason:
        if report.state == "running":
            v = overall(rows, now)
            reason = f"saving; last sample saved {fmt.age(_changed(rows, now, 'saved'))}"
            if v.total >= 0 and v.remaining == 0:
                reason = "all samples done"
        else:
            reason = report.state.replace("_", " ")
    # A long reason (an OS error message) wraps once rather than being cut.
    first = fmt.wrap(reason, width - 1, start=0).split("\n")
    cut = "…" if len(first) > 2 else ""
    t.append("\n".join(first[:2]) + cut, style=style if report.exit_code != OK else "")
    most -= len(first[:2]) - 1
    others = report.others
    for lvl, m in others[: most - 1]:
        t.append(f"\n{m}", style=LEVEL_STYLE[lvl])
    if len(others) > most - 1:
        t.append(f"  (+{len(others) - most + 1} more: eagle3-top --once)", style=DIM)
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
        return f"live ({row.source})", GOOD
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
        t.append(words, style=style if style != GOOD else "")
    return t


def _changed(rows: list[Row], now: float, key: str) -> float | None:
    ages = [r.view(now).changed_ago.get(key) for r in rows if r.state is not None]
    known = [a for a in ages if a is not None]
    return min(known) if known else None


def pipeline(
    rows: list[Row],
    now: float,
    width: int = 76,
    tz_offset_s: float | None = None,
    report: Report | None = None,
) -> Text:
    """The three counters (and failed) with their ages, progress and the ETA."""
    v = overall(rows, now)
    cols = [("sent", v.sent), ("dumped", v.dumped), ("saved", v.saved), ("failed", v.failed)]
    col = 16 if width >= 64 else max(width // 4, 10)
    t = Text()
    for name, _ in cols:
        t.append(f"{name:<{col}}", style="bold")
    t.append("\n")
    for name, n in cols:
        style = BAD if name == "failed" and n else ("bold green" if name == "saved" else "")
        t.append(f"{fmt.count(n):<{col}}", style=style)
    t.append("\n")
    for name, _ in cols:
        t.append(f"{fmt.age(_changed(rows, now, name)):<{col}}", style=DIM)
    t.append("\n")
    total = "?" if v.total < 0 else fmt.count(v.total)
    tail = f" {fmt.count(v.saved)} / {total} saved · {fmt.count(v.remaining)} left"
    bar_w = max(min(width - 7 - len(tail), 40), 8)
    t.append(f"{v.percent:5.1f}% ")
    t.append(fmt.bar(v.percent / 100, bar_w), style="green")
    t.append(tail, style=DIM)
    t.append("\n")
    t.append_text(_eta_line(rows, v, now, tz_offset_s, report))
    t.append(f"\nin flight (sent - dumped) {fmt.count(v.in_flight)}", style=DIM)
    t.append(f" · committing (dumped - saved) {fmt.count(v.committing)}", style=DIM)
    if v.truncated:
        t.append(f"\n{fmt.truncation(v.truncated, v.tokens_dropped, v.saved)}", style=WARN)
    return t


def _eta_line(
    rows: list[Row], v: View, now: float, tz: float | None, report: Report | None
) -> Text:
    t = Text()
    state = (report or verdict(rows, now)).state
    if state == "finished" or (v.total >= 0 and v.remaining == 0 and v.saved + v.failed > 0):
        t.append("finished", style="bold cyan")
        return t
    if state in ("starting", "loading", "waiting"):
        t.append("ETA —", style="bold")
        t.append("  from the rate once the producer is up", style=DIM)
        return t
    t.append(f"ETA {fmt.duration(v.eta_s)}", style="bold")
    if v.eta_frozen:
        t.append(f"  frozen: {v.eta_frozen}", style=WARN)
        return t
    if v.eta_s is not None and v.eta_s > 0:
        t.append(f"  finish {fmt.clock_time(now + v.eta_s, now, tz)}")
    rate = fmt.rate(v.rate_eta.samples_s, "samples")
    window = "1 min" if v.eta_window_s <= 60 else f"{v.eta_window_s / 60:.0f} min"
    if v.eta_s is None and v.remaining:
        t.append("  (nothing saved since the producer came up)", style=DIM)
    else:
        t.append(f"  at {rate} (last {window})", style=DIM)
    if v.up_s is not None:
        # Since this session's producer came up, as the journal says (its run_state).
        t.append(f" · running {fmt.duration(v.up_s)} this session", style=DIM)
    return t


def _series(rows: list[Row], now: float, field: str, seconds: int, bins: int) -> list[int]:
    per = max(seconds // bins, 1)
    total = [0] * seconds
    for r in rows:
        if r.state is None:
            continue
        # On the row's timeline, where its history was folded (a stepped clock moves no bar).
        for i, x in enumerate(views.sparkline(r.state.history, r.at(now), seconds, field)):
            total[i] += x
    return [sum(total[i : i + per]) for i in range(0, seconds, per)]


def _span_words(seconds: int) -> str:
    return f"last {seconds // 60} min"


def throughput(rows: list[Row], now: float, width: int = 60, seconds: int = SPARK_SECONDS) -> Text:
    """Rates over 10 s and 1 min (since the producer came up) and a sparkline of each."""
    v = overall(rows, now)
    t = Text()
    spark_w = max(width - 34, 6)
    t.append(f"{'':8}{'10 s':<13}{'1 min':<13}{_span_words(seconds)}\n", style=DIM)
    lines = [
        ("samples", f"{v.rate.samples_s:.2f}/s", f"{v.rate_1m.samples_s:.2f}/s", "samples"),
        ("tokens", f"{v.rate.tokens_s:,.0f}/s", f"{v.rate_1m.tokens_s:,.0f}/s", "tokens"),
        ("MB", f"{v.rate.bytes_s / 1e6:,.1f}/s", f"{v.rate_1m.bytes_s / 1e6:,.1f}/s", "bytes"),
    ]
    bins = _bins(seconds, spark_w)
    for i, (label, a, b, field) in enumerate(lines):
        if i:
            t.append("\n")
        t.append(f"{label:8}{a:<13}{b:<13}")
        t.append(fmt.sparkline(_series(rows, now, field, seconds, bins)), style=ACCENT)
    return t


def _bins(seconds: int, width: int) -> int:
    """The largest number of columns up to ``width`` that divides ``seconds`` evenly."""
    for n in range(min(width, seconds), 0, -1):
        if seconds % n == 0:
            return n
    return 1


def history(rows: list[Row], now: float, width: int = 100, height: int = 4) -> Text:
    """Samples saved over the last 15 minutes as a bar chart ``height`` lines high, and the
    failures under it (shown on a tall terminal)."""
    seconds = reducer.HISTORY_SECONDS
    bins = _bins(seconds, max(width - 8, 10))
    saved = _series(rows, now, "samples", seconds, bins)
    per = seconds // bins
    t = Text()
    top = max(saved, default=0)
    lines = fmt.chart(saved, height)
    for i, line in enumerate(lines):
        label = f"{top / per:5.1f}/s" if i == 0 else ""
        t.append(f"{label:>8}", style=DIM)
        t.append(line, style=ACCENT)
        t.append("\n")
    fails = [0] * bins
    for r in rows:
        for e in r.state.errors if r.state else []:
            k = bins - 1 - int((now - e.ts) // per)
            if not e.retry and 0 <= k < bins:
                fails[k] += 1
    t.append(f"{'failed':>8}", style=DIM)
    t.append("".join("x" if n else "·" for n in fails), style=BAD if any(fails) else DIM)
    t.append(f"\n{'':8}-{seconds // 60} min", style=DIM)
    t.append(f"{'now':>{max(bins - len(str(seconds // 60)) - 5, 1)}}", style=DIM)
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
        t.append(f"{who}sample {e.idx} ")
        t.append(e.error, style=BAD if not e.retry else WARN)
        t.append(f" attempt {e.attempt}{' (retrying)' if e.retry else ' (gave up)'}: {e.message}")
    if not t:
        t.append("none", style=DIM)
    return t


def fleet(rows: list[Row], now: float, width: int = 116, report: Report | None = None) -> Text:
    """One line per shard/host plus totals (shown when there is more than one row)."""
    report = report or verdict(rows, now)
    name_w = max(min(28, width - 78), 12)
    t = Text()
    head = (
        f"{'shard':{name_w}}{'state':14}{'saved':>10}{'total':>10}{'%':>7}"
        f"{'samples/s':>10}{'ETA':>11}  conn"
    )
    t.append(head, style="bold")
    for (r, h), level in zip(report.health, report.levels, strict=True):
        v = r.view(now)
        t.append(f"\n{r.label[: name_w - 1]:{name_w}}")
        t.append(f"{h.state.replace('_', ' '):14}", style=LEVEL_STYLE[level])
        total = "?" if v.total < 0 else fmt.count(v.total)
        t.append(f"{fmt.count(v.saved):>10}{total:>10}{v.percent:6.1f}%")
        t.append(f"{v.rate_eta.samples_s:10.2f}")
        eta = fmt.duration(v.eta_s) + ("*" if v.eta_frozen else "")
        t.append(f"{eta:>11}  ")
        conn, style = connection_text(r, now)
        t.append(conn.split(":")[0][:24], style=style)
    v = totals(rows, now)
    total = "?" if v.total < 0 else fmt.count(v.total)
    t.append(f"\n{'total':{name_w}}", style="bold")
    t.append(f"{report.state.replace('_', ' '):14}", style=LEVEL_STYLE[report.exit_code])
    t.append(f"{fmt.count(v.saved):>10}{total:>10}{v.percent:6.1f}%{v.rate_eta.samples_s:10.2f}")
    eta = fmt.duration(v.eta_s) + ("*" if v.eta_frozen else "")
    t.append(f"{eta:>11}", style="bold")
    if any(x.eta_frozen for x in (r.view(now) for r in rows)):
        t.append("  * frozen (work stopped)", style=DIM)
    return t
