"""The verdict: one report that ``eagle3-top --once`` prints and exits with, and that the TUI's
header shows (like black's report.py: counting, exit status and wording in one object).

Each shard's :func:`~eagle3top.model.health` gives a state, a level and a reason; the
report adds what a state alone does not say, per shard with a live daemon:

* the run's failure rule (its ``--max-failed-fraction``, from the journal; the daemon's exit
  code follows the same rule): "too many failures" once more than that share of the job
  failed for good, else "failures rising" while the producer works and more than that share
  of the samples finished in the last 5 minutes failed (WARNING);
* the output filesystem full: less free than the job's reserve (``--space-reserve``, from
  ``run_started``; 256 MiB where not recorded), CRITICAL; or the rest of the job projected
  not to fit (WARNING, with the free space, the reserve and what the job still needs);
* a GPU XID error within the last hour (CRITICAL), uncorrected ECC errors since the driver
  loaded, or a hardware slowdown / thermal / power-brake throttle (WARNING).
* the run's own verdict on its failures (the finished state's level, from ``run_finished``'s
  exit code 9: WARNING over ``--max-failed-fraction``, CRITICAL when every sample failed);
* a pause on a full or unwritable disk (CRITICAL, in the state's level).

Policy (monitoring-plugins convention, so ``--once`` doubles as a health check): the exit
status is the most severe level found, in the order 2 CRITICAL, 1 WARNING, 3 UNKNOWN, 0 OK.
"""

from __future__ import annotations

import msgspec
from eagle3proto import views
from eagle3proto.reducer import ShardState

from . import fmt
from .model import (
    CRITICAL,
    LEVEL_WORDS,
    LOAD_LIMIT_S,
    OK,
    PRODUCER_CRITICAL_S,
    SEVERITY,
    UNKNOWN,
    WARNING,
    Health,
    Row,
    health,
    mark_layouts,
    rank,
)

__all__ = ["CRITICAL", "OK", "UNKNOWN", "WARNING", "Report", "recent_failures"]

#: "Failures rising": more than this share of the samples finished in the window failed.
FAILURE_WINDOW_S = 300.0
#: A GPU XID error is critical for this long after the daemon saw it.
XID_CRITICAL_S = 3600.0
#: Throttle reasons that mean the hardware is in trouble (not a normal power cap).
HW_THROTTLE = ("hw_slowdown", "hw_thermal", "hw_power_brake")

EXIT_CODES_HELP = f"""\
exit codes (--once), the most severe shard wins (2, then 1, 3, 0):
  0  OK: running, finished, or starting / loading the model / waiting for the
     producer for less than {LOAD_LIMIT_S / 60:.0f} min (longer while the load makes progress)
  1  WARNING: paused, stalled (nothing saved for 120 s, or silent for 30 s, with the
     producer up), stopped cleanly with work left, producer down (for less than
     {PRODUCER_CRITICAL_S / 60:.0f} min), a load without progress past the limit, more failures
     than the run's --max-failed-fraction (over the job, or over the samples of the
     last 5 min), disk projected to run out, GPU ECC errors or
     hardware throttling
  2  CRITICAL: daemon down with work left, run failed (non-zero exit), output disk full,
     producer down for {PRODUCER_CRITICAL_S / 60:.0f} min or never up after
     {LOAD_LIMIT_S / 60:.0f} min, a GPU XID error in the last hour, paused on a full
     or unwritable disk, or finished with every sample failed
  3  UNKNOWN: no socket and no journal found (or a remote host unreachable)
"""


def recent_failures(s: ShardState, now: float) -> tuple[int, int]:
    """(permanent failures, samples finished) within the last FAILURE_WINDOW_S before now."""
    since = now - FAILURE_WINDOW_S
    failed = sum(1 for e in s.errors if not e.retry and since <= e.ts <= now)
    saved = sum(b.samples for b in s.history if since <= b.t <= now)
    return failed, failed + saved


def failure_findings(s: ShardState, state: str, now: float) -> list[tuple[int, str]]:
    """The run's own failure rule (``--max-failed-fraction``, from its journal), judged as
    the daemon judges its exit code (:func:`eagle3proto.views.too_many_failed`): over the
    whole job, and over the samples finished in the last 5 minutes while the producer works
    (not during a model load). Under it, nothing; each warning names the rule."""
    limit = views.failure_limit(s)
    rule = f"more than --max-failed-fraction {limit:g}"
    out: list[tuple[int, str]] = []
    if s.total > 0 and views.too_many_failed(s.failed, s.total, limit):
        out.append(
            (
                WARNING,
                f"too many failures: {s.failed} of {s.total} samples failed for good, {rule}"
                " allows (the run will exit 9)",
            )
        )
    elif state in ("running", "stalled"):
        failed, done = recent_failures(s, now)
        if views.too_many_failed(failed, done, limit):
            out.append(
                (
                    WARNING,
                    f"failures rising: {failed} of the last {done} samples failed"
                    f" ({FAILURE_WINDOW_S / 60:.0f} min), {rule}",
                )
            )
    return out


class Report(msgspec.Struct):
    """What was observed across all shards, the verdict and the exit status it implies."""

    critical: list[str] = []
    warnings: list[str] = []
    unknown: list[str] = []
    ok: list[str] = []
    #: Each shard's own health, in the order given.
    health: list[tuple[Row, Health]] = []
    #: Each shard's level once the checks are added (the health's, or worse).
    levels: list[int] = []
    #: Each shard's findings: (level, words without the shard's name or state, message).
    findings: list[list[tuple[int, str, str]]] = []

    @classmethod
    def judge(cls, rows: list[Row], now: float) -> Report:
        r = cls()
        if not rows:
            r.unknown.append("no socket and no journal found")
        mark_layouts(rows)  # a journal closed by a change of N is judged as the job counts it
        for row in rows:
            r.add(row, now, prefix=len(rows) > 1)
        return r

    def _say(self, level: int, text: str) -> None:
        {CRITICAL: self.critical, WARNING: self.warnings, UNKNOWN: self.unknown}.get(
            level, self.ok
        ).append(text)

    def add(self, row: Row, now: float, prefix: bool = True) -> None:
        h = health(row, now)
        self.health.append((row, h))
        who = f"{row.label}: " if prefix else ""
        level = h.level
        message = f"{who}{h.state.replace('_', ' ')}: {h.reason}"
        found = [(h.level, h.reason, message)]
        if h.level != OK or h.state == "unknown":
            self._say(h.level, message)
        for lvl, text in self._checks(row, h, now):
            self._say(lvl, f"{who}{text}")
            found.append((lvl, text, f"{who}{text}"))
            level = min(level, lvl, key=SEVERITY.index)
        if level == OK:
            self.ok.append(f"{who}{h.state}")
        self.levels.append(level)
        self.findings.append(found)

    def _checks(self, row: Row, h: Health, now: float) -> list[tuple[int, str]]:
        """What the state alone does not say, for a shard whose daemon is (or may be) up."""
        s = row.state
        if s is None or h.state in ("finished", "stopped", "down", "unknown"):
            return []
        out: list[tuple[int, str]] = []
        out.extend(failure_findings(s, h.state, now))
        disk = fmt.find_disk(s.stats, "output")
        proj = fmt.project_disk(row.view(now), disk, s.space_reserve_bytes)
        if proj is None or (proj.full and h.state == "paused"):
            pass  # paused on that full disk: the pause already says so
        elif proj.full:
            out.append(
                (
                    CRITICAL,
                    f"output disk full: {fmt.size(proj.free_bytes)} free, below the job's"
                    f" reserve {fmt.size(proj.reserve_bytes)} (--space-reserve)",
                )
            )
        elif proj.fits is False:
            out.append((WARNING, f"output disk: {proj.describe()} ({proj.numbers()})"))
        for g in s.stats.gpus if s.stats else []:
            if g.last_xid_ts and now - g.last_xid_ts <= XID_CRITICAL_S:
                ago = fmt.duration(max(now - g.last_xid_ts, 0.0))
                out.append(
                    (
                        CRITICAL,
                        f"gpu{g.index}: XID {g.last_xid} {ago} ago"
                        f" ({g.xid_errors} since the daemon started)",
                    )
                )
            if g.ecc_errors:
                out.append((WARNING, f"gpu{g.index}: {g.ecc_errors} uncorrected ECC errors"))
            hw = [t for t in g.throttle if t in HW_THROTTLE]
            if hw:
                out.append((WARNING, f"gpu{g.index}: throttled ({', '.join(hw)})"))
        return out

    # -- the verdict ---------------------------------------------------------------------------

    @property
    def exit_code(self) -> int:
        if self.critical:
            return CRITICAL
        if self.warnings:
            return WARNING
        if self.unknown:
            return UNKNOWN
        return OK

    @property
    def level_word(self) -> str:
        return LEVEL_WORDS[self.exit_code]

    def _top(self) -> int | None:
        """The shard the verdict is about: the most alarming level, then state."""
        if not self.health:
            return None
        return min(
            range(len(self.health)), key=lambda i: rank(self.levels[i], self.health[i][1].state)
        )

    @property
    def state(self) -> str:
        """One word for all shards: the state of the most alarming one."""
        k = self._top()
        return self.health[k][1].state if k is not None else "unknown"

    def _top_finding(self) -> tuple[int, str, str] | None:
        k = self._top()
        if k is None:
            return None
        level = self.levels[k]
        return next((f for f in self.findings[k] if f[0] == level and f[1]), None)

    @property
    def reason(self) -> str:
        """Why, in words that follow the state: the deciding shard's most severe finding
        (named when there are several shards)."""
        k = self._top()
        if k is None:
            return self.unknown[0] if self.unknown else ""
        top = self._top_finding()
        if top is None:
            return ""
        row = self.health[k][0]
        return f"{row.label}: {top[1]}" if len(self.health) > 1 else top[1]

    @property
    def others(self) -> list[tuple[int, str]]:
        """The messages besides the one :attr:`reason` tells, most severe first, with levels."""
        top = self._top_finding()
        skip = top[2] if top is not None else None
        return [
            (lvl, m)
            for lvl, msgs in (
                (CRITICAL, self.critical),
                (WARNING, self.warnings),
                (UNKNOWN, self.unknown),
            )
            for m in msgs
            if m != skip
        ]

    @property
    def messages(self) -> list[str]:
        return [*self.critical, *self.warnings, *self.unknown]

    def __str__(self) -> str:
        return "\n".join([self.level_word, *(f"  {m}" for m in self.messages)])
