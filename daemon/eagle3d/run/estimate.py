"""The size estimate of a job's remaining rows, for ``eagle3d plan`` (:mod:`eagle3d.tools.plan`)
and ``eagle3d run``'s space check (:mod:`eagle3d.run.spacecheck`): the rows still to do, as
the journal (or the daemon's own resume fold) says, tokenized as the feeder does (every row,
or a uniform sample), each sample's file size exact for its token count
(:mod:`eagle3d.store.sizing`), and the output filesystem's free space.

Its cost is bounded by the sample, not the dataset: the remaining rows are found at memory
speed (numpy over the rows' statuses), and only the chosen ones are read, each at its byte
offset (:func:`eagle3d.ingest.dataformats.rows_at`; a compressed file is read in order up to
the last chosen row)."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from eagle3proto import paths
from eagle3proto.paths import Shard

from eagle3d import config
from eagle3d.core.sample import FAILED, PENDING, SAVED, SKIPPED
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
) -> tuple[Any, ShardPlan]:
    """The rows of ``shard`` still to do (an ascending array), and what its journal says is
    done. ``status``: the daemon's own per-row status (its resume fold, blank rows already
    skipped); else the shard's journal is read here."""
    sp = ShardPlan(shard, sizing.Estimate(0, 0, 0, 0, 0))
    if status is not None:
        own = status[shard.index : lines : shard.count]
        sp.saved, sp.failed = own.count(SAVED), own.count(FAILED)
        return _ids_of(own, shard), sp
    view = catalog.read_shard(output, shard)
    own = bytearray(len(range(shard.index, lines, shard.count)))
    for i in blank:
        if shard.owns(i):
            own[i // shard.count] = SKIPPED
    if view is not None:
        for i in (*view.saved, *view.failed):
            if i < lines:
                own[i // shard.count] = SAVED
        sp.saved, sp.failed = len(view.saved), len(view.failed)
        sp.saved_bytes = sum(e.bytes for e in view.saved.values())
        if view.job is not None:
            diffs = [k for k in job.COMPARED if getattr(view.job, k) != getattr(facts.job, k)]
            if diffs:
                sp.note = (
                    f"its journal holds another job ({', '.join(diffs)} differ): `run` refuses"
                    " to resume it (exit 6) unless --force-resume"
                )
    return _ids_of(own, shard), sp


def _ids_of(own: bytearray, shard: Shard) -> Any:
    """The row ids of a shard's pending rows, from its rows' statuses (in shard order)."""
    import numpy as np

    at = np.flatnonzero(np.frombuffer(bytes(own), dtype=np.uint8) == PENDING)
    return at * shard.count + shard.index


def choose(every: Any, sample: int, seed: int) -> tuple[list[int], bool]:
    """The rows to tokenize (ascending): all of ``every`` (the remaining rows, ascending), or
    a uniform random sample of ``sample`` of them (seeded: two estimates of the same rows
    agree), and whether it is a sample."""
    import random

    sampled = 0 < sample < len(every)
    if not sampled:
        return [int(i) for i in every], False
    at = random.Random(seed).sample(range(len(every)), sample)
    return sorted(int(every[j]) for j in at), True


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
    uniform sample of ``sample`` of them, each read at its offset where the dataset allows)
    and scale up (``on_rows(rows tokenized, of how many)`` every few hundred rows, and
    ``(0, 0)`` before the tokenizer loads). Its cost
    grows with the sample, not with the dataset: the rows not chosen are not read. Returns
    (per-shard plans, rows tokenized, whether it was a sample, file bytes per token)."""
    import numpy as np

    from eagle3d.ingest.dataformats import rows_at

    plans, left = [], {}
    found = []
    for s in shards:
        ids, sp = _pending(s, facts.lines, output, facts, blank, status)
        left[s] = len(ids)
        found.append(ids)
        plans.append(sp)
    every = np.sort(np.concatenate(found)) if found else np.zeros(0, np.int64)
    chosen, sampled = choose(every, sample, seed)
    tallies = {s: sizing.Tally() for s in shards}
    rows = rows_at(cfg.dataset, facts.fmt, chosen, facts.starts, cfg.max_line_bytes)
    kept = [paths.journal_dir(output, s) for s in shards]  # where a tokenizer may be kept
    _tokenize(cfg, facts, rows, plans, tallies, len(chosen), progress, on_rows, kept)
    for sp in plans:
        sp.estimate = sizing.scale(tallies[sp.shard], left[sp.shard])
        _scale_rows(sp, tallies[sp.shard].rows, left[sp.shard])
    tokens = sum(t.tokens for t in tallies.values())
    per_token = sum(t.bytes for t in tallies.values()) / tokens if tokens else 0.0
    return plans, len(chosen), sampled, per_token


def _tokenize(
    cfg: config.JobConfig,
    facts: job.JobFacts,
    rows: Iterator[tuple[int, Any]],
    plans: list[ShardPlan],
    tallies: dict[Shard, sizing.Tally],
    total: int,
    show: bool,
    on_rows: Callable[[int, int], object] | None,
    kept: list[str],
) -> None:
    """Tokenize ``rows`` (``total`` of them) as the feeder does (its encoder: loaded once a
    process), each into its shard's tally; ``show``: a progress line on stderr."""
    from eagle3d.ingest.chat import encoder

    first = next(rows, None)
    if first is None:
        return
    if on_rows is not None:  # the tokenizer's load takes seconds: said, and a stop seen
        on_rows(0, 0)
    enc = encoder(cfg.model, cfg.max_length, cfg.on_overflow, kept=kept)
    by_shard = {sp.shard: sp for sp in plans}
    count = plans[0].shard.count
    shown = _Progress(total if show else 0)
    for idx, raw in itertools.chain([first], rows):
        if on_rows is not None and shown.n & 255 == 0:
            on_rows(shown.n, total)
        sp = by_shard[Shard(idx % count, count)]
        t = _tokens(enc, idx, raw, sp, facts)
        b = sizing.file_bytes(t, facts.hidden_size, len(facts.layers), _format(facts)) if t else 0
        tallies[sp.shard].add(t, b)
        shown.step()
    shown.done()


def _format(facts: job.JobFacts) -> storedtype.StoreFormat:
    return storedtype.get(facts.job.store_dtype)


def _tokens(enc: Any, idx: int, raw: Any, sp: ShardPlan, facts: job.JobFacts) -> int:
    """The tokens row ``idx`` makes a sample of (0: none, the row refused, counted on
    ``sp``; a row cut at ``max_length`` counted there too)."""
    from eagle3d.ingest.dataformats import BadSample, parse_row, unit

    try:
        tok = enc.encode(parse_row(idx, raw))
    except BadSample as bad:
        _count_bad(sp, bad, unit(facts.fmt))
        return 0
    if tok.truncated:
        sp.over += 1
        sp.dropped += tok.full_length - len(tok.input_ids)
    return len(tok.input_ids)


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
            _cpus(), cfg.commit_thread_count(_cpus()), per_token, _bytes_per_sample(plans)
        ),
    )


def _bytes_per_sample(plans: list[ShardPlan]) -> float:
    """The mean sample file's bytes of what remains (0 when nothing does)."""
    samples = sum(p.estimate.samples for p in plans)
    return sum(p.estimate.bytes for p in plans) / samples if samples else 0.0


def _cpus() -> int:
    """The CPUs this process may run on (a cgroup's or Slurm's cut, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


__all__ = ["PlanReport", "ShardPlan", "check_run", "choose", "estimate", "plan_report"]
