"""``eagle3d run``'s space check at start: a job whose remaining samples do not fit on the
output's filesystem with the reserve (``--space-reserve``) is refused with exit 10, before
anything is sent. The estimate is ``eagle3d plan``'s (:func:`eagle3d.run.estimate.check_run`),
on this shard's pending rows as the resumed journal says; ``--no-space-check`` skips it.

First, the ceiling: with a ``max_length``, no sample holds more tokens, so the pending rows at
that length bound what the run writes. When even that fits, nothing is tokenized (the check
then costs a ``statvfs``, not a pass of the tokenizer over up to 20,000 rows before the first
request: the start of a short job). Otherwise the estimate decides: every remaining row
tokenized, or past ``plan``'s ``--sample`` default (20,000) a seeded uniform random sample of
them, each read at its offset (no other row is read), so that its cost is the sample's, not
the job's. The log line and the refusal say which, and a sample's 95 % margin."""

from __future__ import annotations

import logging

from eagle3proto.paths import Shard

from eagle3d import config
from eagle3d.core.sample import PENDING
from eagle3d.exitcodes import EXIT_SPACE, Fatal
from eagle3d.run import job
from eagle3d.run.keptrows import Keep
from eagle3d.run.planreport import PlanReport
from eagle3d.run.stages import StartStages, StartStopped

log = logging.getLogger("eagle3d")


def check_space(
    cfg: config.JobConfig,
    facts: job.JobFacts,
    shard: Shard,
    output: str,
    status: bytearray,
    stages: StartStages | None = None,
) -> Keep | None:
    """Raise :class:`Fatal` (exit 10) when the rest of the job does not fit; log the
    estimate otherwise. Runs off the event loop (it tokenizes rows; its progress told to
    ``stages``, where a signal ends it with :class:`StartStopped`). Returns the rows it
    read, for the daemon to keep beside the journal once the start is accepted (None:
    nothing read, or they were taken as an earlier start kept them)."""
    from eagle3d.run import estimate
    from eagle3d.store import sizing

    if fits_at_most(cfg, facts, shard, output, status):
        return None
    on_rows = None
    if stages is not None:

        def on_rows(tokenized: int, of: int) -> None:
            if not of:
                stages.progress(what="loading the tokenizer")
                return
            stages.progress(tokenized, 0, 0, "rows tokenized", of)

    try:
        checked = estimate.check_run(cfg, facts, shard, output, status, on_rows)
    except StartStopped:
        raise
    except Exception as e:  # the check must never be why a job cannot start
        log.warning("space check skipped: %s: %s", type(e).__name__, e)
        return None
    report = checked.report
    need = (
        f"{sizing.size(report.bytes)}{margin(report)} still to write ({how(report, checked.kept)})"
    )
    if report.disk is None:
        log.warning("space check skipped: free space of %s unknown", output)
    elif report.fits is False:
        raise Fatal(
            EXIT_SPACE,
            f"the job does not fit: {need}, {sizing.size(report.disk.free)}"
            f" free on {report.disk.path}, reserve {sizing.size(report.reserve)}"
            " (eagle3d plan with the same arguments says more; --no-space-check"
            " starts anyway, and the run pauses when the disk is full)",
        )
    else:
        log.info("space: %s, %s free on %s", need, sizing.size(report.disk.free), report.disk.path)
    return checked.keep


def margin(report: PlanReport) -> str:
    """`` ± 1.20 GB (95 %)`` for a sampled estimate ('' when every row was tokenized)."""
    from eagle3d.store import sizing

    return f" ± {sizing.size(report.bound)} (95 %)" if report.sampled else ""


def how(report: PlanReport, kept: bool = False) -> str:
    """How the estimate was made, in words: every remaining row tokenized, or a sample;
    ``kept``: tokenized by an earlier start (:mod:`eagle3d.run.keptrows`)."""
    left = sum(s.estimate.rows for s in report.in_scope)
    when = " at an earlier start (kept beside the journal)" if kept else ""
    if report.sampled:
        return (
            f"estimated from a uniform random sample of {report.tokenized:,} of the {left:,}"
            f" rows still to do, tokenized{when}"
        )
    return f"from every row: all {left:,} still to do, tokenized{when}"


def fits_at_most(
    cfg: config.JobConfig, facts: job.JobFacts, shard: Shard, output: str, status: bytearray
) -> bool:
    """Whether the shard's pending rows fit even at ``max_length`` tokens each (logged so);
    False when there is no such limit, or the free space is unknown, or they may not."""
    from eagle3d.remote import storedtype
    from eagle3d.store import sizing

    if cfg.max_length <= 0:
        return False
    try:
        disk = sizing.free_space(output)
    except OSError:
        return False
    pending = status[shard.index :: shard.count].count(PENDING)
    fmt = storedtype.get(facts.job.store_dtype)
    try:
        each = sizing.file_bytes_at_most(cfg.max_length, facts.hidden_size, len(facts.layers), fmt)
    except Exception:  # a length past what one archive holds: the estimate decides
        return False
    most = pending * each + sizing.overhead_bytes(pending) + sizing.JOURNAL_FIXED
    if most + sizing.parse_size(cfg.space_reserve, disk.total) > disk.free:
        return False
    log.info(
        "space: at most %s still to write (%d rows of at most %d tokens), %s free on %s",
        sizing.size(most),
        pending,
        cfg.max_length,
        sizing.size(disk.free),
        disk.path,
    )
    return True


def reserve_bytes(cfg: config.JobConfig) -> int:
    """The job's ``--space-reserve`` in bytes on its output's filesystem (a share like ``2%``
    of that filesystem's size); -1 when the filesystem cannot be read. Recorded in
    ``run_started`` so that the monitor calls the disk full by the job's own reserve."""
    from eagle3d.store import sizing

    try:
        return sizing.parse_size(cfg.space_reserve, sizing.free_space(cfg.output).total)
    except (OSError, ValueError):
        return -1


__all__ = ["check_space", "fits_at_most", "how", "margin", "reserve_bytes"]
