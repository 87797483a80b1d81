"""``eagle3d report``: the whole story of a job from its journals, during or after it.

Per shard and in total: saved, failed, truncated and left; tokens and bytes; wall time
(first record to last) and working time (producer up and not paused:
:func:`eagle3proto.views.working_seconds`), the rate over the working span; every failure
(row, reason, attempts, message), grouped by reason; the pauses and their causes; the
sessions (restarts) and how each ended. ``--json`` prints the same as one document (its
``failures`` key lists all of them); ``--html FILE`` writes one self-contained page with
plots (:mod:`eagle3d.tools.reporthtml`, plotly with its JavaScript inlined).

Reads the journals read-only (:func:`eagle3proto.journalread.replay`, folded by
:class:`eagle3d.tools.story.ShardStory`), so a running daemon is never disturbed. The story
(every session, pause, failure message, the timeline) is no part of the state checkpoint,
so the full report reads the whole journal, saying how far it is every few seconds;
``--summary`` prints only what the reducer's state holds (counts, times, failures by reason)
from the checkpoint beside the journal and the tail after it, as ``eagle3-top --once`` does
(a damaged checkpoint is named on stderr and the whole journal read). Exit status: 0; 3 when
the output holds no journal; 2 for ``--summary`` with ``--html``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from eagle3proto import checkpoint, layouts, paths, reducer
from eagle3proto import events as ev
from eagle3proto.journalread import replay
from eagle3proto.units import duration, rate, size

from eagle3d.exitcodes import EXIT_CONFIG, EXIT_INPUT, EXIT_OK
from eagle3d.tools.story import Pause, ShardStory, by_reason

log = logging.getLogger("eagle3d")


def read(output: str, *, summary: bool = False) -> list[ShardStory]:
    """Every shard's story under ``output`` (empty: no journal). With ``summary`` only the
    reducer's state is folded: from the shard's checkpoint and the journal's tail after it
    (the whole journal when there is none, or it is refused: said on stderr); the story's
    sessions, pauses, failure messages and points are then left empty."""
    stories = []
    for shard, jdir in paths.shard_dirs(output):
        st = ShardStory(shard.name)
        if summary:
            _fold_tail(st, jdir)
        else:
            rep = replay(jdir, _Progress(st.name, st.feed).feed)
            st.problems += [p.describe() for p in rep.problems]
        stories.append(st)
    # A journal closed by a change of the shard count counts what it settled; the rest of
    # its rows went to the current layout (eagle3proto.layouts, docs/slurm.md).
    current = layouts.current_count(
        (st.state.job.shard_count, st.state.session_start_ts)
        for st in stories
        if st.state.job is not None
    )
    for st in stories:
        st.closed_by = layouts.closed_by(st.state, current)
        if st.closed_by:
            st.state = layouts.closed_view(st.state, current)
    return stories


def _fold_tail(st: ShardStory, jdir: str) -> None:
    """``st.state`` from the shard's checkpoint and the journal after it (as ``--once``)."""
    loaded = checkpoint.load(jdir)
    ck = loaded.checkpoint
    if ck is not None:
        st.state = ck.state
    elif not loaded.missing:
        log.warning("%s", loaded.note)
    state = st.state

    def fold(batch: list[ev.AnyEvent]) -> None:
        reducer.apply_all(state, batch)

    rep = replay(jdir, fold, None if ck is None else ck.position)
    st.problems += [p.describe() for p in rep.problems]
    st.problems += state.recovered


class _Progress:
    """A replay's sink that says on stderr, every few seconds, how far it has read (the whole
    journal is read: at a million samples that takes a while)."""

    EVERY_S = 5.0

    def __init__(self, name: str, sink: Callable[[list[ev.AnyEvent]], None]) -> None:
        self.name, self.sink, self.records = name, sink, 0
        self.t0 = self.last = time.monotonic()

    def feed(self, batch: list[ev.AnyEvent]) -> None:
        self.sink(batch)
        self.records += len(batch)
        now = time.monotonic()
        if now - self.last >= self.EVERY_S:
            self.last = now
            log.info(
                "report: %s: %s records of the journal read, %.0f s (the story needs them"
                " all; --summary reads the checkpoint and the tail)",
                self.name,
                f"{self.records:,}",
                now - self.t0,
            )


def _times(st: ShardStory) -> dict[str, Any]:
    r = st.rate
    return {
        "first_ts": st.first_ts or None,
        "last_ts": st.last_ts or None,
        "wall_s": round(st.wall_s, 3),
        "working_s": round(st.working_s, 3),
        "paused_s": round(st.paused_s, 3),
        "rate_samples_s": round(r.samples_s, 4),
        "rate_tokens_s": round(r.tokens_s, 2),
        "rate_bytes_s": round(r.bytes_s, 1),
    }


def shard_doc(st: ShardStory) -> dict[str, Any]:
    s = st.state
    return {
        "shard": st.name,
        "state": s.state,
        "closed_by": st.closed_by or None,
        "total": s.total if s.total >= 0 else None,
        "saved": s.saved,
        "failed": s.failed,
        "truncated": s.truncated,
        "tokens_dropped": s.tokens_dropped,
        "left": st.left,
        "tokens": s.tokens_saved,
        "bytes": s.bytes_saved,
        **_times(st),
        "failures_by_reason": {k: len(v) for k, v in by_reason(list(st.failures.values())).items()},
        "pauses": [
            {"start_ts": p.start, "end_ts": p.end, "seconds": _pause_s(st, p), "cause": p.cause}
            for p in st.pauses
        ],
        "sessions": [
            {
                "session": x.session,
                "start_ts": x.start,
                "end_ts": x.end,
                "ended": x.how,
                "reason": x.reason,
                "exit_code": x.exit_code,
                "host": x.host,
                "pid": x.pid,
                "done_before": x.already_saved,
            }
            for x in st.sessions
        ],
        "restarts": max(len(st.sessions) - 1, 0),
        "problems": st.problems,
    }


#: shard_doc's keys that only the whole journal gives (not in a ``--summary``).
STORY_KEYS = ("paused_s", "pauses", "sessions", "restarts")


def summary_doc(st: ShardStory) -> dict[str, Any]:
    """:func:`shard_doc`'s figures that the reducer's state holds (``--summary``): the
    failures by reason from its failed rows, no sessions, pauses or paused time."""
    d = {k: v for k, v in shard_doc(st).items() if k not in STORY_KEYS}
    d["failures_by_reason"] = _reasons(st.state.failed_idx.values())
    return d


def _reasons(reasons: Iterable[str]) -> dict[str, int]:
    """Counts by reason, the largest first (as :func:`eagle3d.tools.story.by_reason`)."""
    by: dict[str, int] = {}
    for r in reasons:
        by[r] = by.get(r, 0) + 1
    return dict(sorted(by.items(), key=lambda kv: (-kv[1], kv[0])))


def _pause_s(st: ShardStory, p: Pause) -> float:
    return round((p.end if p.end is not None else st.last_ts) - p.start, 3)


def document(output: str, stories: list[ShardStory], summary: bool = False) -> dict[str, Any]:
    """The ``--json`` document (``summary``: the figures of :func:`summary_doc`, no list of
    failures)."""
    shards = [summary_doc(st) if summary else shard_doc(st) for st in stories]
    keys = ("saved", "failed", "truncated", "tokens_dropped", "left", "tokens", "bytes")
    total: dict[str, Any] = {k: sum(d[k] for d in shards) for k in keys}
    totals = [d["total"] for d in shards]
    total["total"] = None if None in totals else sum(totals)
    firsts = [st.first_ts for st in stories if st.first_ts]
    lasts = [st.last_ts for st in stories if st.last_ts]
    total["wall_s"] = round(max(lasts) - min(firsts), 3) if firsts else 0.0
    # Shards work side by side: the job's working time is the longest shard's, and its rate
    # the sum of theirs.
    total["working_s"] = max((d["working_s"] for d in shards), default=0.0)
    for k in ("rate_samples_s", "rate_tokens_s", "rate_bytes_s"):
        total[k] = round(sum(d[k] for d in shards), 4)
    if summary:
        reasons = [r for st in stories for r in st.state.failed_idx.values()]
        total["failures_by_reason"] = _reasons(reasons)
        return {"output": output, "summary": True, "total": total, "shards": shards}
    total["restarts"] = sum(d["restarts"] for d in shards)
    failures: list[dict[str, Any]] = [
        {
            "shard": st.name,
            "idx": f.idx,
            "reason": f.reason,
            "attempts": f.attempts,
            "message": f.message,
            "ts": f.ts,
        }
        for st in stories
        for f in sorted(st.failures.values(), key=lambda f: f.idx)
    ]
    total["failures_by_reason"] = _reasons(f["reason"] for f in failures)
    return {
        "output": output,
        "total": total,
        "shards": shards,
        "failures": failures,
    }


def _secs(x: float) -> str:
    """``0.22 s`` under 10 s (a short job's times say something), else ``5 m 03 s``."""
    return f"{x:.2f} s" if x < 10 else duration(x)


def _clock(ts: float | None) -> str:
    if not ts:
        return "—"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def text(doc: dict[str, Any], stories: list[ShardStory]) -> str:
    """The report for a person: counts, times, every failure, pauses and sessions."""
    out = [f"eagle3d report {doc['output']}"]
    rows = (
        [*doc["shards"], {"shard": "total", **doc["total"]}] if len(stories) > 1 else doc["shards"]
    )
    for d in rows:
        total = "?" if d["total"] is None else f"{d['total']:,}"
        state = f" ({d['state']})" if "state" in d else ""
        out.append(
            f"{d['shard']}{state}: saved {d['saved']:,} / {total}, failed {d['failed']:,},"
            f" truncated {d['truncated']:,}, left {d['left']:,}"
        )
        dropped = f" ({d['tokens_dropped']:,} dropped by truncation)" if d["tokens_dropped"] else ""
        out.append(f"  {d['tokens']:,} tokens{dropped}, {size(d['bytes'])}")
        out.append(
            f"  wall {_secs(d['wall_s'])}, working {_secs(d['working_s'])};"
            f" {rate(d['rate_samples_s'], 'samples')}, {rate(d['rate_tokens_s'], 'tokens')}"
            " over the working span"
        )
    for st in stories:
        for x in st.sessions:
            how = x.how if not x.reason else f"{x.how}: {x.reason}"
            code = "" if x.exit_code is None else f", exit {x.exit_code}"
            out.append(
                f"{st.name} session {x.session}: {_clock(x.start)} → {_clock(x.end)} ({how}{code})"
                f" on {x.host or '?'} pid {x.pid}"
            )
        for p in st.pauses:
            end = _clock(p.end) if p.end is not None else "still paused"
            out.append(
                f"{st.name} paused {_clock(p.start)} → {end}"
                f" ({duration(_pause_s(st, p))}): {p.cause}"
            )
        out.extend(f"{st.name} journal: {p}" for p in st.problems)
    if doc.get("summary"):
        counts = ", ".join(f"{k} {n:,}" for k, n in doc["total"]["failures_by_reason"].items())
        out.append(f"failures by reason: {counts or 'none'}")
        out.append(
            "(a summary, from the checkpoint and the journal's tail: the sessions, pauses and"
            " every failure's message need the whole journal, read by eagle3d report without"
            " --summary)"
        )
        return "\n".join(out) + "\n"
    failures = doc["failures"]
    if failures:
        counts = ", ".join(f"{k} {n:,}" for k, n in doc["total"]["failures_by_reason"].items())
        out.append(f"failures ({len(failures):,}: {counts}):")
        groups: dict[str, list[dict[str, Any]]] = {}
        for f in failures:
            groups.setdefault(f["reason"], []).append(f)
        for reason in doc["total"]["failures_by_reason"]:
            out.append(f"  {reason} ({len(groups[reason]):,}):")
            for f in groups[reason]:
                where = f"{f['shard']} " if len(stories) > 1 else ""
                out.append(
                    f"    {where}sample {f['idx']} (attempts {f['attempts']}): {f['message']}"
                )
    else:
        out.append("failures: none")
    return "\n".join(out) + "\n"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "report",
        help="the whole story of a job from its journals: counts, times, every failure, pauses",
        description="Read the journals under OUTPUT (read-only, during or after a run) and print"
        " per shard and in total: saved, failed, truncated and left; tokens and bytes; wall"
        " and working time and the rate over the working span; every failure grouped by"
        " reason; pauses and their causes; sessions and restarts. Exit 0; 3: no journal.",
    )
    p.add_argument("-o", "--output", required=True, help="the job's output directory")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.add_argument(
        "--summary",
        action="store_true",
        help="the counts, times and failures by reason only, from the state checkpoint and"
        " the journal's tail (fast at any size); without it the whole journal is read (the"
        " sessions, pauses, every failure's message and the timeline need it all)",
    )
    p.add_argument(
        "--html",
        metavar="FILE",
        help="also write one self-contained HTML page with plots to FILE (needs plotly:"
        " pip install 'eagle3d[report]')",
    )
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from eagle3d.serve.logsetup import setup_logging

    setup_logging()
    output = os.path.abspath(args.output)
    if args.summary and args.html:
        log.error("--html plots the whole journal's timeline: not with --summary")
        return EXIT_CONFIG
    stories = read(output, summary=args.summary)
    if not stories:
        log.error("%s: no journal (no job has run into this output)", output)
        return EXIT_INPUT
    doc = document(output, stories, args.summary)
    if args.html:
        from eagle3d.tools import reporthtml

        try:
            reporthtml.write(args.html, doc, stories)
        except ModuleNotFoundError as e:
            log.error("--html needs %s: pip install 'eagle3d[report]'", e.name)
            return EXIT_CONFIG
        log.info("wrote %s", args.html)
    if args.json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        sys.stdout.write(text(doc, stories))
    return EXIT_OK


__all__ = ["cmd_report", "document", "read", "register", "text"]
