"""``eagle3-top --once``: one snapshot as text, JSON or Prometheus, and an exit status.

The text's first line is a monitoring-plugins status line with perfdata (``EAGLE3D OK -
running: ... | saved=400;;;0;1000 ...``), so check_by_ssh or Icinga graph it as it is.

This path must stay light: it imports neither Textual nor torch (nor Rich, nor asyncio's
machinery beyond what the standard library loads), so a cron job or a health check pays
for a Python start, a socket round trip or a journal read, and nothing else.
"""

from __future__ import annotations

import os
from typing import TextIO

import msgspec
from eagle3proto import events as ev
from eagle3proto import wire
from eagle3proto.views import View

from . import fmt
from .model import LEVEL_WORDS, Row, totals
from .report import Report


class DiskDoc(msgspec.Struct, kw_only=True):
    host: str
    label: str
    path: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    projected_bytes: int | None = None  # still to write at the mean sample size
    fits: bool | None = None
    runs_out_in_s: float | None = None
    #: the job's space reserve (``--space-reserve``; 256 MiB where the journal lacks it), and
    #: whether the free space is below it: the only case the monitor calls the disk full
    reserve_bytes: int | None = None
    full: bool | None = None


class GpuDoc(msgspec.Struct, kw_only=True):
    host: str
    index: int
    name: str
    util_percent: float
    mem_used_bytes: int
    mem_total_bytes: int
    temperature_c: float
    power_w: float
    ecc_errors: int
    throttle: list[str]
    power_limit_w: float = 0.0
    ecc_corrected: int = 0
    ecc_uncorrected_total: int = 0
    xid_errors: int = 0
    last_xid: int = 0
    last_xid_ts: float = 0.0


class ErrorDoc(msgspec.Struct, kw_only=True):
    shard: str
    idx: int
    error: str
    message: str
    attempt: int
    retry: bool
    ts: float


class Counts(msgspec.Struct, kw_only=True):
    total: int | None
    sent: int
    dumped: int
    saved: int
    failed: int
    in_flight: int
    committing: int
    remaining: int
    percent: float
    bytes_saved: int
    tokens_saved: int
    truncated: int
    tokens_dropped: int
    rate_samples_s: float
    rate_tokens_s: float
    rate_bytes_s: float
    eta_s: float | None
    eta_frozen: str
    eta_rate_samples_s: float
    eta_window_s: float
    finish_ts: float | None
    up_s: float | None
    age_s: float | None
    requests: int  # these four: the whole job (every session)
    dumps: int
    retries: int
    orphans: int
    session_requests: int  # these four: the last session alone
    session_dumps: int
    session_retries: int
    session_orphans: int


class ShardDoc(Counts, kw_only=True):
    label: str
    host: str
    output: str
    source: str
    alive: bool | None
    state: str
    level: str
    reason: str
    run_state: str
    state_since_ts: float | None
    producer: str
    producer_message: str
    producer_since_ts: float | None
    producer_up: bool | None
    producer_latency_s: float | None
    producer_detail: dict[str, float | str]
    daemon_cpu_percent: float | None
    daemon_rss_bytes: int | None
    gpu_note: str
    error: str
    notes: list[str]
    start: wire.StartInfo | None = None  # a starting daemon's stage (its start beacon)


class OnceDoc(Counts, kw_only=True):
    state: str
    level: str
    reason: str
    exit_code: int
    now: float
    disk: list[DiskDoc]
    gpus: list[GpuDoc]
    errors: list[ErrorDoc]
    shards: list[ShardDoc]
    messages: list[str]


def _counts(v: View, now: float) -> dict[str, object]:
    eta = v.eta_s if v.total >= 0 else None  # no total yet (a start): no ETA
    # A frozen ETA has no finish time: nobody knows when the work resumes.
    finish = None if not eta or v.eta_frozen else round(now + eta, 1)
    return {
        "total": v.total if v.total >= 0 else None,
        "sent": v.sent,
        "dumped": v.dumped,
        "saved": v.saved,
        "failed": v.failed,
        "in_flight": v.in_flight,
        "committing": v.committing,
        "remaining": v.remaining,
        "percent": round(v.percent, 3),
        "bytes_saved": v.bytes_saved,
        "tokens_saved": v.tokens_saved,
        "truncated": v.truncated,
        "tokens_dropped": v.tokens_dropped,
        "rate_samples_s": round(v.rate_1m.samples_s, 4),
        "rate_tokens_s": round(v.rate_1m.tokens_s, 2),
        "rate_bytes_s": round(v.rate_1m.bytes_s, 1),
        "eta_s": None if eta is None else round(eta, 1),
        "eta_frozen": v.eta_frozen,
        "eta_rate_samples_s": round(v.rate_eta.samples_s, 4),
        "eta_window_s": v.eta_window_s,
        "finish_ts": finish,
        "up_s": None if v.up_s is None else round(v.up_s, 1),
        "age_s": None if v.age_s is None else round(v.age_s, 3),
        "requests": v.requests,
        "dumps": v.dumps,
        "retries": v.retries,
        "orphans": v.orphans,
        "session_requests": v.session_requests,
        "session_dumps": v.session_dumps,
        "session_retries": v.session_retries,
        "session_orphans": v.session_orphans,
    }


def _clock_note(r: Row) -> list[str]:
    if not r.by_wall_clock():
        return []
    return [
        "ages by this host's wall clock (the journal was written on another host or boot):"
        " a clock step on either side moves them"
    ]


def build(rows: list[Row], now: float) -> tuple[OnceDoc, Report]:
    """The ``--json`` document and the report for a set of rows at time ``now``.

    Long: one constructor call per section of the document (shards, errors, disks, GPUs,
    totals), each naming every field it fills, so the document's shape reads in one place."""
    report = Report.judge(rows, now)
    shards: list[ShardDoc] = []
    disks: list[DiskDoc] = []
    gpus: list[GpuDoc] = []
    errors: list[ErrorDoc] = []
    seen_hosts: set[str] = set()
    for (r, h), level in zip(report.health, report.levels, strict=True):
        v = r.view(now)
        s = r.state
        stats = s.stats if s is not None else None
        shards.append(
            ShardDoc(
                label=r.label,
                host=r.host,
                output=r.output,
                source=r.source,
                alive=r.alive,
                state=h.state,
                level=LEVEL_WORDS[level],
                reason=h.reason,
                run_state=s.state if s is not None else "",
                state_since_ts=s.state_since or None if s is not None else None,
                producer=s.producer if s is not None else "",
                producer_message=s.producer_message if s is not None else "",
                producer_since_ts=(s.producer_since or None) if s is not None else None,
                producer_up=stats.producer.up if stats else None,
                producer_latency_s=stats.producer.latency_s if stats else None,
                producer_detail=dict(stats.producer.detail) if stats else {},
                daemon_cpu_percent=stats.cpu_percent if stats else None,
                daemon_rss_bytes=stats.rss_bytes if stats else None,
                gpu_note=stats.gpu_note if stats else "",
                error=r.error,
                notes=[*r.notes, *_clock_note(r)],
                start=r.start,
                **_counts(v, now),  # type: ignore[arg-type]
            )
        )
        if r.state is not None:
            for e in r.state.errors[-10:]:
                errors.append(
                    ErrorDoc(
                        shard=r.label,
                        idx=e.idx,
                        error=e.error,
                        message=e.message,
                        attempt=e.attempt,
                        retry=e.retry,
                        ts=e.ts,
                    )
                )
        if stats is None or r.host in seen_hosts:
            continue  # disks and GPUs are per host: report them once
        seen_hosts.add(r.host)
        for d in stats.disk:
            reserve = r.state.space_reserve_bytes if r.state else -1
            proj = fmt.project_disk(v, d, reserve) if d.label == "output" else None
            disks.append(
                DiskDoc(
                    host=r.host,
                    label=d.label,
                    path=d.path,
                    total_bytes=d.total_bytes,
                    used_bytes=d.used_bytes,
                    free_bytes=d.free_bytes,
                    projected_bytes=proj.needed_bytes if proj else None,
                    fits=proj.fits if proj else None,
                    runs_out_in_s=proj.runs_out_in_s if proj else None,
                    reserve_bytes=proj.reserve_bytes if proj else None,
                    full=proj.full if proj else None,
                )
            )
        for g in stats.gpus:
            fields = msgspec.structs.asdict(g)
            del fields["last_xid_bt"]  # the daemon's boot clock: last_xid_ts is on the timeline
            gpus.append(GpuDoc(host=r.host, **fields))
    tot = totals(rows, now)
    errors.sort(key=lambda e: e.ts)
    doc = OnceDoc(
        state=report.state,
        level=report.level_word,
        reason=report.reason,
        exit_code=report.exit_code,
        now=now,
        disk=disks,
        gpus=gpus,
        errors=errors[-10:],
        shards=shards,
        messages=report.messages,
        **_counts(tot, now),  # type: ignore[arg-type]
    )
    return doc, report


def to_json(doc: OnceDoc) -> bytes:
    return msgspec.json.format(msgspec.json.encode(doc), indent=2)


# -- human text ----------------------------------------------------------------------------

#: ANSI colours by level, as the TUI colours its header.
_COLORS = {"OK": "32", "WARNING": "33", "CRITICAL": "31", "UNKNOWN": "35"}


def use_color(stream: TextIO) -> bool:
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    return stream.isatty()


def _perf(
    label: str, value: float | int, unit: str = "", lo: float = 0, hi: float | None = None
) -> str:
    """One monitoring-plugins perfdata item: ``label=value[UOM];warn;crit;min;max``."""
    v = f"{value:.4g}" if isinstance(value, float) else str(value)
    top = "" if hi is None else (f"{hi:g}" if isinstance(hi, float) else str(hi))
    return f"{label}={v}{unit};;;{lo:g};{top}".rstrip(";")


def perfdata(doc: OnceDoc) -> str:
    """The job's totals as perfdata (what check_by_ssh / Icinga graph)."""
    total = doc.total
    items = [
        _perf("saved", doc.saved, hi=total),
        _perf("failed", doc.failed, hi=total),
        _perf("remaining", doc.remaining, hi=total),
        _perf("in_flight", doc.in_flight),
        _perf("committing", doc.committing),
        _perf("percent", round(doc.percent, 2), "%", hi=100),
        _perf("rate", round(doc.rate_samples_s, 4)),
        _perf("tokens_rate", round(doc.rate_tokens_s, 1)),
        _perf("bytes_saved", doc.bytes_saved, "B"),
        _perf("truncated", doc.truncated, hi=total),
    ]
    if doc.eta_s is not None:
        items.append(_perf("eta", round(doc.eta_s, 1), "s"))
    if doc.age_s is not None:
        items.append(_perf("age", round(doc.age_s, 1), "s"))
    out = next((d for d in doc.disk if d.label == "output"), None)
    if out is not None:
        items.append(_perf("disk_free", out.free_bytes, "B", hi=out.total_bytes))
    return " ".join(items)


def status_line(doc: OnceDoc) -> str:
    """``EAGLE3D OK - running: saved 400 / 1,000 (40.0%), ETA 14 m | saved=400;;;0;1000 ...``"""
    total = "?" if doc.total is None else fmt.count(doc.total)
    summary = f"saved {fmt.count(doc.saved)} / {total} ({doc.percent:.1f}%)"
    if doc.eta_s is not None and doc.state != "finished":
        summary += f", ETA {fmt.duration(doc.eta_s)}"
        if doc.eta_frozen:
            summary += f" (frozen: {doc.eta_frozen})"
    state = doc.state.replace("_", " ")
    why = f": {doc.reason}" if doc.reason else ""
    return f"EAGLE3D {doc.level} - {state}{why}; {summary} | {perfdata(doc)}"


def render_text(doc: OnceDoc, report: Report, color: bool) -> str:
    def paint(text: str, level: str) -> str:
        return f"\x1b[{_COLORS.get(level, '0')}m{text}\x1b[0m" if color else text

    out: list[str] = [status_line(doc)]
    for s in doc.shards:
        word = paint(s.state.replace("_", " ").upper(), s.level)
        src = s.source or "-"
        out.append(
            f"{s.label}  {s.host}  {word}  via {src}" + (f"  ({s.reason})" if s.reason else "")
        )
        if s.error and s.error != s.reason:
            out.append(f"  {s.error}")
        if s.total is None and s.saved == 0 and s.error:
            continue
        out.extend(f"  {line}" for line in _counts_lines(s, doc.now))
        for n in s.notes:
            out.append(f"  note: {n}")
    if len(doc.shards) > 1:
        out.append(f"total  {paint(doc.state.replace('_', ' ').upper(), doc.level)}")
        out.extend(f"  {line}" for line in _counts_lines(doc, doc.now))
    for d in doc.disk:
        line = (
            f"disk {d.label} ({d.host}): {fmt.size(d.free_bytes)} free of {fmt.size(d.total_bytes)}"
        )
        if d.fits is not None:
            if d.fits:
                line += f" - fits ({fmt.size(d.projected_bytes)} more needed)"
            elif d.runs_out_in_s is not None:
                line += f" - runs out in {fmt.duration(d.runs_out_in_s)}"
            else:
                line += f" - does not fit ({fmt.size(d.projected_bytes)} needed)"
        out.append(line)
    for g in doc.gpus:
        out.append(f"gpu{g.index} ({g.host}) {g.name}: {gpu_health_text(g, doc.now)}")
    for e in doc.errors[-5:]:
        retry = "retrying" if e.retry else "gave up"
        out.append(f"error #{e.idx} {e.error}: {e.message} (attempt {e.attempt}, {retry})")
    out.append(paint(str(report), doc.level))
    return "\n".join(out) + "\n"


def gpu_health_text(g: GpuDoc | ev.GpuInfo, now: float) -> str:
    """``91% 63C 455/700 W mem 120.0 GB/141.0 GB ECC 0 XID 79 (3 m ago) throttle ...``"""
    power = f"{g.power_w:.0f}" + (f"/{g.power_limit_w:.0f}" if g.power_limit_w else "")
    text = (
        f"{g.util_percent:.0f}% {g.temperature_c:.0f}C {power} W"
        f" mem {fmt.size(g.mem_used_bytes)}/{fmt.size(g.mem_total_bytes)}"
    )
    text += f" ECC {g.ecc_errors} uncorrected, {g.ecc_corrected} corrected"
    if g.ecc_uncorrected_total:
        text += f" ({g.ecc_uncorrected_total} in the board's life)"
    if g.xid_errors:
        ago = fmt.duration(max(now - g.last_xid_ts, 0.0)) if g.last_xid_ts else "?"
        text += f" XID {g.last_xid} ({ago} ago, {g.xid_errors} in all)"
    if g.throttle:
        text += f" throttle {','.join(g.throttle)}"
    return text


def _counts_lines(c: Counts, now: float) -> list[str]:
    total = "?" if c.total is None else fmt.count(c.total)
    lines = [
        f"saved {fmt.count(c.saved)} / {total} ({c.percent:.1f}%), {fmt.count(c.failed)} failed"
        f"  in flight {fmt.count(c.in_flight)}  committing {fmt.count(c.committing)}",
        f"rate {fmt.rate(c.rate_samples_s, 'samples')}  {fmt.rate(c.rate_tokens_s, 'tokens')}"
        f"  {fmt.size(c.rate_bytes_s)}/s",
    ]
    if c.truncated:
        lines.append(fmt.truncation(c.truncated, c.tokens_dropped, c.saved))
    eta = f"ETA {fmt.duration(c.eta_s)}"
    if c.eta_frozen:
        eta += f" (frozen: {c.eta_frozen})"
    elif c.finish_ts is not None and c.eta_s:
        eta += f" (finish {fmt.clock_time(c.finish_ts, now)})"
    lines.append(f"{eta}  newest record {fmt.age(c.age_s)}")
    return lines


def render(doc: OnceDoc, report: Report, fmt_name: str, stream: TextIO) -> str:
    """``doc`` as ``text`` or ``json`` (the Prometheus format lives in
    :mod:`eagle3top.prometheus`, which builds on this module)."""
    if fmt_name == "json":
        return to_json(doc).decode() + "\n"
    return render_text(doc, report, use_color(stream))


__all__ = ["OnceDoc", "build", "ev", "render", "render_text", "status_line", "to_json"]
