"""The pure fold from events to the snapshot every monitor shows.

:class:`ShardState` is the whole state of one shard's journal after some prefix of it; it
is a msgspec struct, so the daemon can send it to a subscriber as the snapshot, and the
subscriber keeps folding live records onto it. :func:`eagle3proto.views.view` turns a state
into the numbers a screen shows, given ``now``: time is an argument, never read here.

Counters (distinct samples, never requests):

* ``saved``: committed (less any a repair found damaged: ``sample_invalid``); ``failed``:
  recorded as failed for good (until a later retry of the same sample reopens it);
* ``in_flight``: sent, no dump yet; ``committing``: dump arrived, not yet saved;
* ``dumped = saved + committing`` and ``sent = dumped + in_flight``, so the two gaps
  between the columns are exactly what is in flight and what is committing.

``requests`` counts every attempt sent (retries included): that is what a server's own
request counter sees, and why it runs ahead of ``saved``; ``dumps`` counts every dump that
arrived for one of them. Both only grow, which is what a Prometheus counter needs. They, with
``retries`` and ``orphans``, count the whole job (every session of the journal); their
``session_`` twins count the last session alone (reset by its ``run_started``), the span of
what a producer reports about itself.

A session is ``starting`` from its ``run_started`` (and ``loading`` while the producer loads
its model) until the producer is up (``run_state running``, or for journals written before
that record existed, the first ``sample_sent``): ``up_ts``. Rates, the ETA and the stall rules
count from ``up_ts``, so a long model load neither dilutes the rate nor looks like a stall.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from . import events as ev

HISTORY_SECONDS = 900
MAX_ERRORS = 50
SENT, DUMPED = 1, 2
#: The producer's memory must grow by this much between two stats records to count as a
#: model load making progress.
LOAD_STEP_BYTES = 16 << 20
#: The ETA's rate window: everything since the producer came up, at most a minute, for its
#: first ten minutes (so the ETA settles fast); five minutes after that (so it holds still).
ETA_WINDOW_EARLY_S, ETA_WINDOW_LATE_S, ETA_EARLY_FOR_S = 60.0, 300.0, 600.0


class Bucket(msgspec.Struct, array_like=True):
    """Work saved during one wall-clock second."""

    t: int
    samples: int = 0
    tokens: int = 0
    bytes: int = 0


class ErrorInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    idx: int
    error: str
    message: str = ""
    attempt: int = 1
    retry: bool = False
    ts: float = 0.0


class ShardState(msgspec.Struct, kw_only=True):
    """Everything folded from one shard's journal so far."""

    run: str = ""
    seq: int = -1
    job: ev.JobInfo | None = None
    total: int = -1
    session: int = 0
    pid: int = 0  # the last session's daemon: pid, start time (clock ticks), boot id
    pid_start: int = 0
    boot_id: str = ""
    # empty | starting | loading | running | paused | draining | finished | stopped
    state: str = "empty"
    state_reason: str = ""
    state_since: float = 0.0  # ts of the record that set ``state``
    up_ts: float = 0.0  # when this session's producer came up (0: not yet)
    saved: int = 0
    failed: int = 0
    in_flight: int = 0
    committing: int = 0
    requests: int = 0
    retries: int = 0
    orphans: int = 0
    session_requests: int = 0  # the four above, over the last session alone
    session_retries: int = 0
    session_dumps: int = 0
    session_orphans: int = 0
    bytes_saved: int = 0
    tokens_saved: int = 0
    truncated: int = 0  # saved samples cut to max_length
    tokens_dropped: int = 0  # tokens those samples lost (0 for journals that did not record it)
    stage: dict[int, int] = {}
    failed_idx: dict[int, str] = {}
    last_ts: dict[str, float] = {}
    changed: dict[str, float] = {}
    history: list[Bucket] = []
    errors: list[ErrorInfo] = []
    stats: ev.Stats | None = None
    producer: str = ""  # the last producer event's state: up | down | restarting | waiting
    producer_message: str = ""
    producer_since: float = 0.0  # ts the producer entered ``producer``
    dumps: int = 0
    load_rss: int = 0  # the producer's memory at the last sign of load progress
    load_progress_ts: float = 0.0  # ts of that sign (0: none this session)
    recovered: list[str] = []
    unknown_kinds: int = 0
    first_ts: float = 0.0
    session_start_ts: float = 0.0
    stop_code: int = 0  # exit code of the last run_stopped (0: clean, resumable)
    finish_code: int = 0  # exit code of the last run_finished (non-zero: too many failed)
    skipped: int = 0  # blank lines of the shard (no samples)
    max_failed_fraction: float = -1.0  # the run's failure rule (-1: not recorded)
    space_reserve_bytes: int = -1  # the job's space reserve (-1: not recorded)
    # Working time: seconds in ``running`` (the producer up, not paused, loading or
    # draining), every session of the journal; the rates count over it (eagle3proto.views).
    work_s: float = 0.0  # closed working spans
    work_from: float = 0.0  # start of the open working span (0: not working)
    spans: list[tuple[float, float]] = []  # the closed working spans of the last HISTORY_SECONDS
    newest_ts: float = 0.0  # ts of the newest record folded
    # The session's timeline (docs/monitor.md): its run_started's wall time and boot-clock
    # reading. A record stamped with ``bt`` is folded at ``anchor_ts + (bt - anchor_bt)``,
    # so a wall clock stepped during the session moves no age, rate or ETA (0: not
    # recorded, records are folded at their ``ts``).
    anchor_ts: float = 0.0
    anchor_bt: float = 0.0


def new_state() -> ShardState:
    return ShardState()


def apply(s: ShardState, e: ev.Event | ev.Unknown) -> None:
    """Fold one event into the state (in place)."""
    apply_all(s, (e,))


def apply_all(s: ShardState, events: Iterable[ev.Event | ev.Unknown]) -> ShardState:
    """Fold events in order (in place); returns the state."""
    dispatch = _DISPATCH
    last_ts = s.last_ts
    e = None
    for e in events:
        if type(e) is ev.RunStarted:
            s.anchor_ts, s.anchor_bt = e.ts, e.bt
        t = e.ts
        # On the session's timeline (a record before the anchor is not of this session).
        if e.bt and s.anchor_bt and e.bt >= s.anchor_bt:
            t = s.anchor_ts + (e.bt - s.anchor_bt)
        if not s.first_ts:
            s.first_ts = t
        entry = dispatch.get(type(e))
        if entry is None:  # an Unknown record from a newer eagle3d
            last_ts[e.kind] = t
            s.unknown_kinds += 1
            continue
        last_ts[entry[0]] = t
        entry[1](s, e, t)
        s.newest_ts = t
    if e is not None:
        s.seq = e.seq
        s.run = e.run
    return s


def _set_stage(s: ShardState, idx: int, new: int, ts: float) -> None:
    old = s.stage.get(idx, 0)
    if old == new:
        return
    if old == SENT:
        s.in_flight -= 1
    elif old == DUMPED:
        s.committing -= 1
    if new == SENT:
        s.in_flight += 1
        s.stage[idx] = new
    elif new == DUMPED:
        s.committing += 1
        s.stage[idx] = new
    else:
        s.stage.pop(idx, None)
    s.changed["sent"] = ts


def _set_state(s: ShardState, state: str, reason: str, ts: float) -> None:
    if state != s.state:
        s.state_since = ts
    s.state = state
    s.state_reason = reason
    _work(s, ts)


def _work(s: ShardState, ts: float) -> None:
    """Open or close the working span as the state enters or leaves ``running``."""
    if s.state == "running":
        if not s.work_from:
            s.work_from = ts
    elif s.work_from:
        close_span(s, ts)


def close_span(s: ShardState, end: float) -> None:
    """Close the open working span at ``end``."""
    start, s.work_from = s.work_from, 0.0
    if end <= start:
        return
    s.work_s += end - start
    s.spans.append((start, end))
    cut = end - HISTORY_SECONDS
    while s.spans and s.spans[0][1] < cut:
        del s.spans[0]


def _run_started(s: ShardState, e: ev.RunStarted, t: float) -> None:
    # A new session: whatever the last one had in flight is pending again, and the last
    # session's producer is gone with it.
    s.stage.clear()
    s.in_flight = s.committing = 0
    if s.work_from:  # the last session died working: it worked until its last record
        close_span(s, max(s.newest_ts, s.work_from))
    s.job = e.job
    s.total = e.total
    s.session = e.session
    s.pid, s.pid_start, s.boot_id = e.pid, e.pid_start, e.boot_id
    _set_state(s, "starting", "", t)
    s.state_since = t
    s.up_ts = 0.0
    s.producer, s.producer_message, s.producer_since = "", "", t
    s.load_rss, s.load_progress_ts = 0, 0.0
    s.stop_code = 0
    s.finish_code = 0
    s.skipped = e.skipped
    s.max_failed_fraction = e.max_failed_fraction
    s.space_reserve_bytes = e.space_reserve_bytes
    s.session_start_ts = t
    s.session_requests = s.session_retries = s.session_dumps = s.session_orphans = 0
    s.changed["sent"] = t


def _came_up(s: ShardState, ts: float) -> None:
    s.up_ts = ts
    if s.state in ("empty", "starting", "loading"):
        _set_state(s, "running", "", ts)


def _sent(s: ShardState, e: ev.SampleSent, t: float) -> None:
    if not s.up_ts:  # a journal from before the run_state running record: the first send
        _came_up(s, t)
    s.requests += 1
    s.session_requests += 1
    if e.attempt > 1:
        s.retries += 1
        s.session_retries += 1
    _set_stage(s, e.idx, SENT, t)


def _dumped(s: ShardState, e: ev.SampleDumped, t: float) -> None:
    if e.idx in s.stage:
        s.dumps += 1
        s.session_dumps += 1
        _set_stage(s, e.idx, DUMPED, t)
        s.changed["dumped"] = t


def _saved(s: ShardState, e: ev.SampleSaved, t: float) -> None:
    if not s.up_ts:  # (as in _sent: a save proves the producer was up)
        _came_up(s, t)
    _set_stage(s, e.idx, 0, t)
    if s.failed_idx.pop(e.idx, None) is not None:
        s.failed -= 1
    s.saved += 1
    s.bytes_saved += e.bytes
    s.tokens_saved += e.tokens
    if e.truncated:
        s.truncated += 1
        s.tokens_dropped += max(e.original_tokens - e.tokens, 0)
    s.changed["saved"] = t
    s.changed["dumped"] = t
    sec = int(t)
    h = s.history
    if h and h[-1].t == sec:
        b = h[-1]
    else:
        b = Bucket(sec)
        h.append(b)
        cut = sec - HISTORY_SECONDS
        if h[0].t <= cut:
            # Drop expired buckets from the front in place: rebuilding the whole window on
            # every new second made replaying a long journal quadratic-ish.
            k = 1
            while k < len(h) and h[k].t <= cut:
                k += 1
            del h[:k]
    b.samples += 1
    b.tokens += e.tokens
    b.bytes += e.bytes


def _invalid(s: ShardState, e: ev.SampleInvalid, t: float) -> None:
    # verify --repair found a committed sample damaged: it is pending again. The byte and
    # token totals keep what was written; the history keeps when it was.
    s.saved = max(s.saved - 1, 0)
    s.changed["saved"] = t
    if s.state == "finished":
        s.state = "stopped"
        s.state_reason = "repaired: damaged samples to redo"
        s.finish_code = 0


def _failed(s: ShardState, e: ev.SampleFailed, t: float) -> None:
    s.errors.append(
        ErrorInfo(
            idx=e.idx, error=e.error, message=e.message, attempt=e.attempt, retry=e.retry, ts=t
        )
    )
    if len(s.errors) > MAX_ERRORS:
        del s.errors[0]
    if e.retry:
        # The latest record of a sample wins: a retry after a failure "for good" reopens it
        # (a daemon retrying what an older version wrongly recorded as the sample's fault).
        if s.failed_idx.pop(e.idx, None) is not None:
            s.failed -= 1
        return
    _set_stage(s, e.idx, 0, t)
    if e.idx not in s.failed_idx:
        s.failed_idx[e.idx] = e.error
        s.failed += 1
    s.changed["failed"] = t


def _stats(s: ShardState, e: ev.Stats, t: float) -> None:
    s.stats = _on_timeline(e, t)
    # The record's count is its daemon's, this session's; the job's holds at least as many.
    s.session_orphans = max(s.session_orphans, e.orphans)
    s.orphans = max(s.orphans, s.session_orphans)
    if s.state in ("starting", "loading") and e.producer_rss_bytes > s.load_rss + LOAD_STEP_BYTES:
        s.load_rss = e.producer_rss_bytes
        s.load_progress_ts = t


def _on_timeline(e: ev.Stats, t: float) -> ev.Stats:
    """``e`` with a GPU's last XID placed on the session's timeline: ``t`` (where the record
    was folded) less the boot-clock time between the XID and the record, so that a wall
    clock stepped between the two moves neither."""
    if not e.bt or t == e.ts or not any(g.last_xid_bt for g in e.gpus):
        return e
    gpus = [
        msgspec.structs.replace(g, last_xid_ts=t - (e.bt - g.last_xid_bt)) if g.last_xid_bt else g
        for g in e.gpus
    ]
    return msgspec.structs.replace(e, gpus=gpus)


def _run_state(s: ShardState, e: ev.RunState, t: float) -> None:
    if e.state == "running" and not s.up_ts:
        s.up_ts = t
    _set_state(s, e.state, e.reason, t)


def _producer(s: ShardState, e: ev.ProducerEvent, t: float) -> None:
    if e.state != s.producer:
        s.producer_since = t
    s.producer = e.state
    s.producer_message = e.message


def _orphan(s: ShardState, e: ev.DumpOrphan, t: float) -> None:
    s.orphans += 1
    s.session_orphans += 1


def _stopped(s: ShardState, e: ev.RunStopped, t: float) -> None:
    s.stage.clear()
    s.in_flight = s.committing = 0
    _set_state(s, "stopped", e.reason, t)
    s.stop_code = e.exit_code


def _finished(s: ShardState, e: ev.RunFinished, t: float) -> None:
    s.stage.clear()
    s.in_flight = s.committing = 0
    _set_state(s, "finished", "", t)
    s.finish_code = e.exit_code


def _recovered(s: ShardState, e: ev.Recovered, t: float) -> None:
    s.recovered.append(f"{e.segment}@{e.offset}: {e.reason}, {e.dropped_bytes} bytes set aside")


_HANDLERS: dict[str, Callable[[ShardState, Any, float], None]] = {
    "run_started": _run_started,
    "sample_sent": _sent,
    "sample_dumped": _dumped,
    "sample_saved": _saved,
    "sample_failed": _failed,
    "sample_invalid": _invalid,
    "stats": _stats,
    "run_state": _run_state,
    "producer": _producer,
    "dump_orphan": _orphan,
    "run_stopped": _stopped,
    "run_finished": _finished,
    "recovered": _recovered,
}

#: event type -> (kind, handler): a type lookup is far cheaper than reading the tag per record.
_DISPATCH: dict[type, tuple[str, Callable[[ShardState, Any, float], None]]] = {
    t: (k, _HANDLERS[k]) for k, t in ev.KINDS.items()
}


_state_encoder = msgspec.msgpack.Encoder()
_state_decoder = msgspec.msgpack.Decoder(ShardState)


def encode_state(s: ShardState) -> bytes:
    return _state_encoder.encode(s)


def decode_state(data: bytes | memoryview) -> ShardState:
    return _state_decoder.decode(data)
