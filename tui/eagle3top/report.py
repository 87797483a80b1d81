"""The exit status of ``eagle3-top --once``, computed in one place (like black's report.py).

Policy (monitoring-plugins convention, so ``--once`` doubles as a health check):

* **0 OK** - every shard is running healthily or finished;
* **1 WARNING** - a shard is stalled (paused, or nothing saved / no record for a while),
  was stopped cleanly with work left, more than 1 % of the samples finished in the last
  5 minutes failed for good ("failures rising"), the rest of the job is projected not
  to fit on disk, or a run finished with more failures than its ``--max-failed-fraction``;
* **2 CRITICAL** - a daemon is down with work left (crashed: no lock holder, no socket),
  a run failed (stopped with a non-zero exit code), the output filesystem is full, the run
  is paused on a full or unwritable disk, or a run finished with every sample failed;
* **3 UNKNOWN** - nothing to judge: no socket and no journal found (or a host unreachable).

When several apply the most severe wins in the order 2, 1, 3, 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle3proto.reducer import ShardState

from . import fmt
from .model import Row, health

OK, WARNING, CRITICAL, UNKNOWN = 0, 1, 2, 3
#: "Failures rising": more than this share of the samples finished in the window failed.
FAILURE_WINDOW_S = 300.0
FAILURE_SHARE = 0.01
_DISK_WORDS = ("disk", "permission denied", "read-only", "i/o error")

EXIT_CODES_HELP = """\
exit codes (--once):
  0  OK: running healthily, or finished
  1  WARNING: stalled (paused, nothing saved for 120 s, or silent for 30 s), stopped
     cleanly with work left, >1% of the samples of the last 5 min failed, disk
     projected to run out, or finished with more failed than --max-failed-fraction
  2  CRITICAL: daemon down with work left (no lock holder and no socket), run failed
     (stopped with a non-zero exit code), output filesystem full, paused on a full or
     unwritable disk, or finished with every sample failed
  3  UNKNOWN: no socket and no journal found (or a remote host unreachable)
"""


def recent_failures(s: ShardState, now: float) -> tuple[int, int]:
    """(permanent failures, samples finished) within the last FAILURE_WINDOW_S before now."""
    since = now - FAILURE_WINDOW_S
    failed = sum(1 for e in s.errors if not e.retry and since <= e.ts <= now)
    saved = sum(b.samples for b in s.history if since <= b.t <= now)
    return failed, failed + saved


@dataclass
class Report:
    """What ``--once`` observed across all shards, and the exit status it implies."""

    critical: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    ok: list[str] = field(default_factory=list)

    @classmethod
    def judge(cls, rows: list[Row], now: float) -> Report:
        r = cls()
        if not rows:
            r.unknown.append("no socket and no journal found")
        for row in rows:
            r.add(row, now)
        return r

    def add(self, row: Row, now: float) -> None:
        h = health(row, now)
        who = row.label
        if h.state == "unknown":
            self.unknown.append(f"{who}: {h.reason}")
            return
        s = row.state
        assert s is not None
        v = row.view(now)
        if h.state == "down":
            self.critical.append(f"{who}: down: {h.reason}")
        elif h.state == "stopped":
            (self.critical if s.stop_code else self.warnings).append(f"{who}: {h.reason}")
        elif h.state == "stalled":
            # Paused on a full or unwritable disk (the daemon's reason names it): critical.
            bucket = (
                self.critical if any(w in h.reason.lower() for w in _DISK_WORDS) else self.warnings
            )
            bucket.append(f"{who}: stalled: {h.reason}")
        if h.state in ("running", "stalled"):
            failed, done = recent_failures(s, now)
            if failed and failed > FAILURE_SHARE * done:
                self.warnings.append(
                    f"{who}: failures rising: {failed} of the last {done} samples failed"
                    f" ({FAILURE_WINDOW_S / 60:.0f} min)"
                )
            proj = fmt.project_disk(v, fmt.find_disk(s.stats, "output"))
            if proj is not None and proj.full:
                self.critical.append(f"{who}: output disk full ({fmt.size(proj.free_bytes)} free)")
            elif proj is not None and proj.fits is False:
                self.warnings.append(f"{who}: disk {proj.describe()}")
        if h.state == "finished" and s.finish_code:
            # The daemon's own verdict (eagle3d run exit 9): finished is not success.
            what = f"finished with {v.failed} of {v.total} samples failed ({v.saved} saved)"
            (self.critical if v.saved == 0 else self.warnings).append(f"{who}: {what}")
        elif h.state in ("running", "finished"):
            self.ok.append(f"{who}: {h.state}")

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
    def messages(self) -> list[str]:
        return [*self.critical, *self.warnings, *self.unknown]

    def __str__(self) -> str:
        word = {OK: "OK", WARNING: "WARNING", CRITICAL: "CRITICAL", UNKNOWN: "UNKNOWN"}
        head = word[self.exit_code]
        return "\n".join([head, *(f"  {m}" for m in self.messages)])
