"""``eagle3-top --once``: one snapshot as text or JSON, and an exit status.

This path must stay light: it imports neither Textual nor torch (nor Rich, nor asyncio's
machinery beyond what the standard library loads), so a cron job or a health check pays
for a Python start, a socket round trip or a journal read, and nothing else.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

import msgspec
from eagle3proto import events as ev
from eagle3proto.reducer import View

from . import fmt
from .model import Row, health, totals, worst
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
    rate_samples_s: float
    rate_tokens_s: float
    rate_bytes_s: float
    eta_s: float | None
    finish_ts: float | None
    age_s: float | None


class ShardDoc(Counts, kw_only=True):
    label: str
    host: str
    output: str
    source: str
    alive: bool | None
    state: str
    reason: str
    producer_up: bool | None
    producer_latency_s: float | None
    producer_detail: dict[str, float | str]
    daemon_cpu_percent: float | None
    daemon_rss_bytes: int | None
    gpu_note: str
    error: str
    notes: list[str]


class OnceDoc(Counts, kw_only=True):
    state: str
    reason: str
    exit_code: int
    now: float
    disk: list[DiskDoc]
    gpus: list[GpuDoc]
    errors: list[ErrorDoc]
    shards: list[ShardDoc]
    messages: list[str]


def _counts(v: View, now: float) -> dict[str, object]:
    eta = v.eta_s
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
        "rate_samples_s": round(v.rate_1m.samples_s, 4),
        "rate_tokens_s": round(v.rate_1m.tokens_s, 2),
        "rate_bytes_s": round(v.rate_1m.bytes_s, 1),
        "eta_s": None if eta is None else round(eta, 1),
        "finish_ts": None if eta is None else round(now + eta, 1),
        "age_s": None if v.age_s is None else round(v.age_s, 3),
    }


def build(rows: list[Row], now: float) -> tuple[OnceDoc, Report]:
    """The ``--json`` document and the report for a set of rows at time ``now``."""
    report = Report.judge(rows, now)
    shards: list[ShardDoc] = []
    disks: list[DiskDoc] = []
    gpus: list[GpuDoc] = []
    errors: list[ErrorDoc] = []
    seen_hosts: set[str] = set()
    for r in rows:
        v = r.view(now)
        h = health(r, now)
        stats = r.state.stats if r.state is not None else None
        shards.append(
            ShardDoc(
                label=r.label,
                host=r.host,
                output=r.output,
                source=r.source,
                alive=r.alive,
                state=h.state,
                reason=h.reason,
                producer_up=stats.producer.up if stats else None,
                producer_latency_s=stats.producer.latency_s if stats else None,
                producer_detail=dict(stats.producer.detail) if stats else {},
                daemon_cpu_percent=stats.cpu_percent if stats else None,
                daemon_rss_bytes=stats.rss_bytes if stats else None,
                gpu_note=stats.gpu_note if stats else "",
                error=r.error,
                notes=r.notes,
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
            proj = fmt.project_disk(v, d) if d.label == "output" else None
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
                )
            )
        for g in stats.gpus:
            gpus.append(GpuDoc(host=r.host, **msgspec.structs.asdict(g)))
    tot = totals(rows, now)
    states = [s.state for s in shards]
    state = worst(states) if states else "unknown"
    reasons = [s.reason for s in shards if s.state == state and s.reason]
    if state == "unknown" and not rows:
        reasons = ["no socket and no journal found"]
    errors.sort(key=lambda e: e.ts)
    doc = OnceDoc(
        state=state,
        reason="; ".join(reasons[:3]),
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

_COLORS = {
    "running": "32",
    "finished": "36",
    "stalled": "33",
    "stopped": "33",
    "down": "31",
    "unknown": "35",
}


def use_color(stream: TextIO) -> bool:
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    return stream.isatty()


def render_text(doc: OnceDoc, report: Report, color: bool) -> str:
    def paint(text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if color else text

    out: list[str] = []
    for s in doc.shards:
        word = paint(s.state.upper(), _COLORS.get(s.state, "0"))
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
        out.append(f"total  {paint(doc.state.upper(), _COLORS.get(doc.state, '0'))}")
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
        out.append(
            f"gpu{g.index} ({g.host}) {g.name}: {g.util_percent:.0f}% "
            f"{g.temperature_c:.0f}C {g.power_w:.0f} W mem {fmt.size(g.mem_used_bytes)}"
            f"/{fmt.size(g.mem_total_bytes)}"
            + (f" throttle {','.join(g.throttle)}" if g.throttle else "")
        )
    for e in doc.errors[-5:]:
        retry = "retrying" if e.retry else "gave up"
        out.append(f"error #{e.idx} {e.error}: {e.message} (attempt {e.attempt}, {retry})")
    out.append(str(report))
    return "\n".join(out) + "\n"


def _counts_lines(c: Counts, now: float) -> list[str]:
    total = "?" if c.total is None else fmt.count(c.total)
    lines = [
        f"saved {fmt.count(c.saved)} / {total} ({c.percent:.1f}%), {fmt.count(c.failed)} failed"
        f"  in flight {fmt.count(c.in_flight)}  committing {fmt.count(c.committing)}",
        f"rate {fmt.rate(c.rate_samples_s, 'samples')}  {fmt.rate(c.rate_tokens_s, 'tokens')}"
        f"  {fmt.size(c.rate_bytes_s)}/s",
    ]
    eta = f"ETA {fmt.duration(c.eta_s)}"
    if c.finish_ts is not None and c.eta_s:
        eta += f" (finish {fmt.clock_time(c.finish_ts, now)})"
    lines.append(f"{eta}  newest record {fmt.age(c.age_s)}")
    return lines


def run(rows: list[Row], now: float, as_json: bool, stream: TextIO = sys.stdout) -> int:
    doc, report = build(rows, now)
    if as_json:
        stream.write(to_json(doc).decode() + "\n")
    else:
        stream.write(render_text(doc, report, use_color(stream)))
    stream.flush()
    return report.exit_code


__all__ = ["OnceDoc", "build", "ev", "render_text", "run", "to_json"]
