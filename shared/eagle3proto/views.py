"""What a screen shows of a shard: pure functions of (state, now).

:func:`view` turns a :class:`~eagle3proto.reducer.ShardState` into the numbers a monitor
shows (counters, rates, the ETA, the stall and freshness rules) given ``now``: time is an
argument, never read here. :func:`combine` sums several shards' views.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from .reducer import ETA_EARLY_FOR_S, ETA_WINDOW_EARLY_S, ETA_WINDOW_LATE_S, Bucket, ShardState

# -- the stall rules, one definition for the daemon and the monitor -------------------------
#: Work is left, the producer is up, and nothing was saved (or failed for good) for this
#: long: the run is *stalled* (the monitor warns).
STALL_AFTER_S = 120.0
#: No record at all from a live source for this long (stats come every second): *stalled*.
SILENT_AFTER_S = 30.0
#: Stalled this long, with work outstanding: *hung*. The daemon's watchdog stops pinging and
#: systemd restarts it (``$EAGLE3D_STALL_SEC`` overrides); a restart resumes exactly.
HUNG_AFTER_S = 300.0


# -- the failure rule, one definition for the daemon's exit code and the monitor's verdict --
#: ``eagle3d run --max-failed-fraction``'s default (what a journal that did not record the
#: run's own value is judged by).
MAX_FAILED_FRACTION = 0.05


def too_many_failed(failed: int, total: int, max_failed_fraction: float) -> bool:
    """THE failure rule: more samples failed for good than ``max_failed_fraction`` of the
    job's ``total`` (a finished run then exits 9; the monitor warns as soon as it holds)."""
    if failed <= 0 or total <= 0:
        return False
    return failed > max_failed_fraction * total


def failure_limit(s: ShardState) -> float:
    """The share of failures the run allows (its own, else the default)."""
    return s.max_failed_fraction if s.max_failed_fraction >= 0 else MAX_FAILED_FRACTION


# -- whose clock: ages on the session's timeline, not wall-clock differences -----------------


def timeline_now(s: ShardState, wall: float, boot_id: str, boottime: float) -> float:
    """``now`` on the timeline ``s`` was folded on (:mod:`eagle3proto.reducer`).

    On the boot that wrote the session (``boot_id`` is the reader's, ``boottime`` its
    ``CLOCK_BOOTTIME`` reading): the session's ``run_started`` wall time plus the boot clock
    since, so that ``now - t`` for a record folded at ``t`` is a boot-clock difference,
    whatever the wall clocks of the daemon and the reader did. Otherwise (another host or
    boot, a journal without boot-clock stamps): ``wall``. Time is an argument.
    """
    if on_boot_clock(s, boot_id):  # (a reading before the anchor: ages < 0, judged unknown)
        return s.anchor_ts + (boottime - s.anchor_bt)
    return wall


def on_boot_clock(s: ShardState, boot_id: str) -> bool:
    """Whether a reader on boot ``boot_id`` takes the ages of ``s`` from the boot clock."""
    return bool(s.anchor_bt and boot_id and s.boot_id == boot_id)


class Rates(msgspec.Struct, kw_only=True):
    samples_s: float = 0.0
    tokens_s: float = 0.0
    bytes_s: float = 0.0


def rates(history: list[Bucket], now: float, window: float, since: float = 0.0) -> Rates:
    """Average rates over the last ``window`` seconds before ``now``.

    The span is shortened to the time since ``since`` (the session start) so a fresh run
    is not diluted by seconds before it existed; under one second of data gives zeros.
    """
    start = max(now - window, since) if since else now - window
    span = now - start
    if span < 1.0:
        return Rates()
    n = tok = byt = 0
    for b in reversed(history):
        if b.t + 1 <= start:
            break
        if b.t > now:
            continue
        n += b.samples
        tok += b.tokens
        byt += b.bytes
    return Rates(samples_s=n / span, tokens_s=tok / span, bytes_s=byt / span)


def working_spans(s: ShardState, at: float) -> list[tuple[float, float]]:
    """The working spans of ``s`` up to ``at`` (the open one closed at ``at``), oldest first."""
    out = [(a, min(b, at)) for a, b in s.spans if a < at]
    if s.work_from and s.work_from < at:
        out.append((s.work_from, at))
    return out


def working_rates(s: ShardState, at: float, window: float = 60.0) -> Rates:
    """THE live rate: what was saved over the last ``window`` seconds of working time before
    ``at`` (time paused, loading, draining or between sessions left out), per working second.
    Under one working second gives zeros. Every surface (the progress line, ``--once``, the
    panels, Prometheus, ``eagle3d report``) prints this figure."""
    need, picked = window, []
    for a, b in reversed(working_spans(s, at)):
        if need <= 0:
            break
        start = max(a, b - need)
        picked.append((start, b))
        need -= b - start
    span = window - need
    if span < 1.0:
        return Rates()
    n = tok = byt = 0
    lo = min(a for a, _ in picked)
    for bk in reversed(s.history):
        if bk.t + 1 <= lo:
            break
        # A one-second bucket counts when its second overlaps a picked span.
        if any(bk.t + 1 > a and bk.t <= b for a, b in picked):
            n += bk.samples
            tok += bk.tokens
            byt += bk.bytes
    return Rates(samples_s=n / span, tokens_s=tok / span, bytes_s=byt / span)


def span_rates(s: ShardState, at: float) -> Rates:
    """The rate over the whole working span of the job (every session): a finished or stopped
    job's rate, which does not change as time passes."""
    work = working_seconds(s, at)
    if work <= 0.0:
        return Rates()
    return Rates(
        samples_s=s.saved / work, tokens_s=s.tokens_saved / work, bytes_s=s.bytes_saved / work
    )


def working_seconds(s: ShardState, at: float) -> float:
    """Seconds of working time in the journal up to ``at``."""
    return s.work_s + (max(at - s.work_from, 0.0) if s.work_from else 0.0)


def eta_seconds(remaining: int, rate: float) -> float | None:
    """Seconds to finish ``remaining`` samples at ``rate``; None when it cannot be known."""
    if remaining <= 0:
        return 0.0
    if rate <= 0:
        return None
    return remaining / rate


def eta_window(up_for: float) -> float:
    """The ETA's rate window after the producer has been up ``up_for`` seconds."""
    return ETA_WINDOW_EARLY_S if up_for < ETA_EARLY_FOR_S else ETA_WINDOW_LATE_S


def sparkline(history: list[Bucket], now: float, seconds: int, field: str = "samples") -> list[int]:
    """Per-second values for the last ``seconds`` seconds (oldest first), zeros where idle."""
    end = int(now)
    vals = [0] * seconds
    for b in reversed(history):
        i = seconds - 1 - (end - b.t)
        if i < 0:
            break
        if i < seconds:
            vals[i] = getattr(b, field)
    return vals


class View(msgspec.Struct, kw_only=True):
    """What a monitor shows for one shard (or the sum of several).

    ``percent`` is saved over total: a failed sample is done but is not progress.
    ``eta_s`` comes from ``rate_eta`` (since the producer came up, over ``eta_window_s``);
    ``eta_frozen`` says why the ETA is frozen (``paused``, ``stopped``, ``stopping``,
    ``producer down``, ``daemon down``): it is then the ETA when work stopped, and does not
    count down.
    """

    label: str = ""
    state: str = "empty"
    state_reason: str = ""
    total: int = -1
    sent: int = 0
    dumped: int = 0
    saved: int = 0
    failed: int = 0
    in_flight: int = 0
    committing: int = 0
    remaining: int = 0
    requests: int = 0
    retries: int = 0
    dumps: int = 0
    orphans: int = 0
    # The four above count the whole job; these, its last session (ShardState's twins).
    session_requests: int = 0
    session_retries: int = 0
    session_dumps: int = 0
    session_orphans: int = 0
    bytes_saved: int = 0
    tokens_saved: int = 0
    truncated: int = 0
    tokens_dropped: int = 0
    percent: float = 0.0
    rate: Rates = msgspec.field(default_factory=Rates)
    rate_1m: Rates = msgspec.field(default_factory=Rates)
    rate_eta: Rates = msgspec.field(default_factory=Rates)
    work_s: float = 0.0  # working time (every session), seconds
    eta_window_s: float = 0.0
    eta_s: float | None = None
    eta_frozen: str = ""
    up_s: float | None = None  # how long ago this session's producer came up (the journal's)
    age_s: float | None = None  # age of the newest record
    ages: dict[str, float] = {}  # age of the newest record of each kind
    changed_ago: dict[str, float] = {}  # age of the last change of sent/dumped/saved/failed


def frozen_at(s: ShardState) -> tuple[float, str] | None:
    """When and why the work of ``s`` stopped (so its ETA no longer counts down), or None."""
    if s.state == "paused":
        return s.state_since, "paused"
    if s.state == "stopped":
        return s.state_since, "stopped"
    if s.state == "draining":
        return s.state_since, "stopping"
    if s.state == "running" and s.producer in ("down", "waiting"):
        return s.producer_since, f"producer {s.producer}"
    return None


def view(
    s: ShardState,
    now: float,
    label: str = "",
    window: float = 60.0,
    frozen: tuple[float, str] | None = None,
) -> View:
    """The numbers to show for one shard at time ``now``.

    ``frozen`` (when, why) freezes the ETA for a reason the journal cannot know (the daemon
    is gone); the journal's own reasons (:func:`frozen_at`) come first.
    """
    dumped = s.saved + s.committing
    sent = dumped + s.in_flight
    total = s.total
    remaining = max(total - s.saved - s.failed, 0) if total >= 0 else 0
    finished = s.state == "finished"
    since = 0.0 if finished else (s.up_ts or s.session_start_ts)
    stop = None if finished else (frozen_at(s) or frozen)
    at = now if stop is None else min(max(stop[0], since), now)
    up_for = at - s.up_ts if s.up_ts else 0.0
    ew = eta_window(up_for)
    # Rates count over working time only (a model load, a pause, the gap between sessions
    # are not time the run was slow); a finished or stopped job has one rate, over its whole
    # working span, that time passing does not change.
    if finished or s.state == "stopped":
        r = r10 = re_ = span_rates(s, s.state_since)
    else:
        r = working_rates(s, at, window)
        # The 10-second figure is "now": nothing is saved while the work is stopped.
        r10 = working_rates(s, at, 10.0) if stop is None else Rates()
        re_ = r if ew == window else working_rates(s, at, ew)
    newest = max(s.last_ts.values()) if s.last_ts else None
    # Saved of total: a failed sample is not done work ("saved 0 / 218 (0 %), 218 failed").
    pct = 100.0 * s.saved / total if total > 0 else (100.0 if total == 0 else 0.0)
    return View(
        label=label,
        state=s.state,
        state_reason=s.state_reason,
        total=total,
        sent=sent,
        dumped=dumped,
        saved=s.saved,
        failed=s.failed,
        in_flight=s.in_flight,
        committing=s.committing,
        remaining=remaining,
        requests=s.requests,
        retries=s.retries,
        dumps=s.dumps,
        orphans=s.orphans,
        session_requests=s.session_requests,
        session_retries=s.session_retries,
        session_dumps=s.session_dumps,
        session_orphans=s.session_orphans,
        bytes_saved=s.bytes_saved,
        tokens_saved=s.tokens_saved,
        truncated=s.truncated,
        tokens_dropped=s.tokens_dropped,
        percent=pct,
        rate=r10,
        rate_1m=r,
        rate_eta=re_,
        work_s=working_seconds(s, at if not finished else s.state_since),
        eta_window_s=ew,
        eta_s=0.0 if finished else eta_seconds(remaining, re_.samples_s),
        eta_frozen="" if stop is None or remaining == 0 else stop[1],
        up_s=max(now - s.up_ts, 0.0) if s.up_ts and not finished else None,
        age_s=None if newest is None else max(now - newest, 0.0),
        ages={k: max(now - t, 0.0) for k, t in s.last_ts.items()},
        changed_ago={k: max(now - t, 0.0) for k, t in s.changed.items()},
    )


def combine(views: list[View], now_label: str = "total") -> View:
    """Sum several shards' views into one row.

    Rates add. Shards run side by side, so the job's ETA is the latest shard's (unknown if
    any shard with work left has none), frozen when any shard with work left is frozen.
    """
    if not views:
        return View(label=now_label)
    total = -1 if any(v.total < 0 for v in views) else sum(v.total for v in views)
    out = View(label=now_label, total=total)
    for f in (
        "sent",
        "dumped",
        "saved",
        "failed",
        "in_flight",
        "committing",
        "remaining",
        "requests",
        "retries",
        "dumps",
        "orphans",
        "session_requests",
        "session_retries",
        "session_dumps",
        "session_orphans",
        "bytes_saved",
        "tokens_saved",
        "truncated",
        "tokens_dropped",
    ):
        setattr(out, f, sum(getattr(v, f) for v in views))
    out.rate = _sum_rates(v.rate for v in views)
    out.rate_1m = _sum_rates(v.rate_1m for v in views)
    out.rate_eta = _sum_rates(v.rate_eta for v in views)
    out.percent = 100.0 * out.saved / total if total > 0 else 0.0
    states = {v.state for v in views}
    out.state = next(
        (
            st
            for st in (
                "paused",
                "loading",
                "starting",
                "running",
                "draining",
                "stopped",
                "finished",
                "empty",
            )
            if st in states
        ),
        "empty",
    )
    busy = [v for v in views if v.remaining > 0]
    etas = [v.eta_s for v in busy]
    out.eta_s = 0.0 if not busy else (None if None in etas else max(e or 0.0 for e in etas))
    out.eta_frozen = next((v.eta_frozen for v in busy if v.eta_frozen), "")
    out.eta_window_s = max((v.eta_window_s for v in views), default=0.0)
    ups = [v.up_s for v in views if v.up_s is not None]
    out.up_s = max(ups) if ups else None
    ages = [v.age_s for v in views if v.age_s is not None]
    out.age_s = min(ages) if ages else None
    return out


def _sum_rates(rs: Iterable[Rates]) -> Rates:
    out = Rates()
    for r in rs:
        out.samples_s += r.samples_s
        out.tokens_s += r.tokens_s
        out.bytes_s += r.bytes_s
    return out
