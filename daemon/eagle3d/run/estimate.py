"""The size estimate of a job's remaining rows, for ``eagle3d plan`` (:mod:`eagle3d.tools.plan`)
and ``eagle3d run``'s space check (:mod:`eagle3d.run.spacecheck`): the rows still to do, as
the journal (or the daemon's own resume fold) says, tokenized as the feeder does (every row,
or a uniform sample), each sample's file size exact for its token count
(:mod:`eagle3d.store.sizing`), and the output filesystem's free space."""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable

from eagle3proto.paths import Shard

from eagle3d import config
from eagle3d.core.sample import FAILED, PENDING, SAVED
from eagle3d.remote import storedtype
from eagle3d.run import job
from eagle3d.run.planreport import PlanReport, ShardPlan
from eagle3d.store import catalog, pace, sizing

log = logging.getLogger("eagle3d")


def _pending(
    shard: Shard,
    lines: int,
    output: str,
    facts: job.JobFacts,
    blank: set[int],
    status: bytearray | None,
) -> tuple[list[int], ShardPlan]:
    """The rows of ``shard`` still to do, and what its journal says is done. ``status``:
    the daemon's own per-row status (its resume fold, blank rows already skipped); else the
    shard's journal is read here."""
    rows = range(shard.index, lines, shard.count)
    sp = ShardPlan(shard, sizing.Estimate(0, 0, 0, 0, 0))
    if status is not None:
        sp.saved = sum(1 for i in rows if status[i] == SAVED)
        sp.failed = sum(1 for i in rows if status[i] == FAILED)
        return [i for i in rows if status[i] == PENDING], sp
    view = catalog.read_shard(output, shard)
    done: set[int] = set()
    if view is not None:
        done = set(view.saved) | view.failed
        sp.saved, sp.failed = len(view.saved), len(view.failed)
        sp.saved_bytes = sum(e.bytes for e in view.saved.values())
        if view.job is not None:
            diffs = [k for k in job.COMPARED if getattr(view.job, k) != getattr(facts.job, k)]
            if diffs:
                sp.note = (
                    f"its journal holds another job ({', '.join(diffs)} differ): `run` refuses"
                    " to resume it (exit 6) unless --force-resume"
                )
    return [i for i in rows if i not in done and i not in blank], sp


def estimate(
    cfg: config.JobConfig,
    facts: job.JobFacts,
    shards: list[Shard],
    output: str,
    *,
    blank: set[int],
    sample: int = sizing.DEFAULT_SAMPLE,
    seed: int = 0,
    status: bytearray | None = None,
    progress: bool = False,
    on_rows: Callable[[int, int], object] | None = None,
) -> tuple[list[ShardPlan], int, bool, float]:
    """Tokenize the remaining rows of ``shards`` (of one shard count; all rows, or a
    uniform sample of ``sample`` of them) and scale up (``on_rows(rows read, rows
    tokenized)`` every few hundred rows). Returns (per-shard plans, rows tokenized, whether
    it was a sample, file bytes per token)."""
    from transformers import AutoTokenizer

    from eagle3d.ingest.chat import ChatEncoder
    from eagle3d.ingest.dataformats import BadSample, iter_rows, parse_row, unit

    fmt = storedtype.get(facts.job.store_dtype)
    plans, pending = [], {}
    for s in shards:
        rows, sp = _pending(s, facts.lines, output, facts, blank, status)
        pending[s] = rows
        plans.append(sp)
    every = sorted(i for rows in pending.values() for i in rows)
    sampled = 0 < sample < len(every)
    chosen = set(random.Random(seed).sample(every, sample)) if sampled else set(every)
    tallies = {s: sizing.Tally() for s in shards}
    count, n_layers = shards[0].count, len(facts.layers)
    rows_iter = iter_rows(cfg.dataset, facts.fmt) if chosen else iter(())
    if chosen:
        if on_rows is not None:  # the tokenizer's load takes seconds: said, and a stop seen
            on_rows(0, 0)
        tok = AutoTokenizer.from_pretrained(cfg.model)
        enc = ChatEncoder(tok, max_length=cfg.max_length, on_overflow=cfg.on_overflow)
    by_shard = {sp.shard: sp for sp in plans}
    shown = _Progress(len(chosen) if progress else 0)
    for idx, raw in rows_iter:
        if on_rows is not None and idx & 1023 == 0:
            on_rows(idx, shown.n)
        if idx not in chosen:
            continue
        sp = by_shard[Shard(idx % count, count)]
        try:
            tok_ = enc.encode(parse_row(idx, raw))
            t = len(tok_.input_ids)
            if tok_.truncated:
                sp.over += 1
                sp.dropped += tok_.full_length - t
        except BadSample as bad:
            t = 0  # never saved: a 0-byte sample
            _count_bad(sp, bad, unit(facts.fmt))
        b = sizing.file_bytes(t, facts.hidden_size, n_layers, fmt) if t else 0
        tallies[sp.shard].add(t, b)
        shown.step()
    shown.done()
    for sp in plans:
        sp.estimate = sizing.scale(tallies[sp.shard], len(pending[sp.shard]))
        _scale_rows(sp, tallies[sp.shard].rows, len(pending[sp.shard]))
    tokens = sum(t.tokens for t in tallies.values())
    per_token = sum(t.bytes for t in tallies.values()) / tokens if tokens else 0.0
    return plans, len(chosen), sampled, per_token


#: The first invalid rows a plan names.
FIRST_INVALID = 5


def _count_bad(sp: ShardPlan, bad: Exception, word: str) -> None:
    from eagle3d.ingest.dataformats import BadSample

    assert isinstance(bad, BadSample)
    if bad.error == "too_long":
        sp.over += 1
        sp.skipped += 1
        return
    sp.invalid += 1
    if len(sp.first_invalid) < FIRST_INVALID:
        bad.unit = word
        sp.first_invalid.append(f"{bad} [{bad.error}]")


def _scale_rows(sp: ShardPlan, tallied: int, rows: int) -> None:
    """A sample's row counts scaled up to every remaining row."""
    if not tallied or tallied == rows:
        return
    f = rows / tallied
    sp.invalid, sp.over = round(sp.invalid * f), round(sp.over * f)
    sp.skipped, sp.dropped = round(sp.skipped * f), round(sp.dropped * f)


class _Progress:
    """``plan: read 12,000 / 40,000 rows`` on stderr every few seconds while it reads."""

    EVERY_S = 5.0

    def __init__(self, total: int) -> None:
        self.total, self.n = total, 0
        self.t0 = self.last = time.monotonic()

    def step(self) -> None:
        self.n += 1
        if self.total and self.n & 255 == 0:
            now = time.monotonic()
            if now - self.last >= self.EVERY_S:
                self.last = now
                log.info("plan: read %s / %s rows", f"{self.n:,}", f"{self.total:,}")

    def done(self) -> None:
        if self.total:
            secs = time.monotonic() - self.t0
            log.info("plan: read %s rows as the run will, in %.1f s", f"{self.n:,}", secs)


def check_run(
    cfg: config.JobConfig,
    facts: job.JobFacts,
    shard: Shard,
    output: str,
    status: bytearray,
    on_rows: Callable[[int, int], object] | None = None,
) -> PlanReport:
    """``eagle3d run``'s check at start: its own shard's remaining rows (``status``: the
    daemon's resume fold) against the output's free space."""
    t0 = time.monotonic()
    blank = set(facts.blank)
    found = estimate(cfg, facts, [shard], output, blank=blank, status=status, on_rows=on_rows)
    return plan_report(cfg, facts, output, found, len(facts.blank), shard, t0)


def plan_report(
    cfg: config.JobConfig,
    facts: job.JobFacts,
    output: str,
    found: tuple[list[ShardPlan], int, bool, float],
    blank: int,
    scope: Shard | None,
    t0: float,
) -> PlanReport:
    """The report of an :func:`estimate`, with the output filesystem's free space read now
    (a failure to read it is a problem the report names, not an error: fits is then unknown)."""
    plans, tokenized, sampled, per_token = found
    problems = []
    try:
        disk: sizing.Disk | None = sizing.free_space(output)
    except OSError as e:
        disk, problems = None, [f"free space of {output}: {e.strerror or e}"]
    return PlanReport(
        model=os.path.abspath(cfg.model),
        dataset=os.path.abspath(cfg.dataset),
        output=output,
        store_dtype=facts.job.store_dtype,
        hidden=facts.hidden_size,
        layers=len(facts.layers),
        max_length=cfg.max_length,
        rows=facts.lines,
        blank=blank,
        tokenized=tokenized,
        sampled=sampled,
        seconds=time.monotonic() - t0,
        shards=plans,
        scope=scope,
        disk=disk,
        reserve=sizing.parse_size(cfg.space_reserve, disk.total if disk else 0),
        bytes_per_token=per_token,
        problems=problems,
        max_failed_fraction=cfg.max_failed_fraction,
        commit=pace.estimate(
            _cpus(),
            cfg.commit_thread_count(_cpus()),
            per_token,
            fp8=storedtype.get(facts.job.store_dtype).scaled,
            quantized_by_commit=cfg.backend == "sglang" and facts.job.store_dtype == "fp8",
        ),
    )


def _cpus() -> int:
    """The CPUs this process may run on (a cgroup's or Slurm's cut, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


__all__ = ["PlanReport", "ShardPlan", "check_run", "estimate", "plan_report"]
