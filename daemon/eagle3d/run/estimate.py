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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from eagle3proto import paths
from eagle3proto.paths import Shard

from eagle3d import config
from eagle3d.core.sample import FAILED, PENDING, SAVED, SKIPPED
from eagle3d.remote import storedtype
from eagle3d.run import job, keptrows
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


@dataclass(frozen=True, slots=True)
class Estimated:
    """What :func:`estimate` found: per-shard plans, the rows it stands on (read, or taken
    as kept), whether they are a sample, the file bytes per token; ``read``: the rows it
    read itself (None: none, they were taken as kept)."""

    plans: list[ShardPlan]
    tokenized: int
    sampled: bool
    per_token: float
    read: keptrows.Read | None = None


#: Rows kept from an earlier start for the rows still to do (:func:`eagle3d.run.keptrows.take`).
Reuse = Callable[[Any], keptrows.Taken | None]


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
    reuse: Reuse | None = None,
) -> Estimated:
    """Tokenize the remaining rows of ``shards`` (of one shard count; all rows, or a
    uniform sample of ``sample`` of them, each read at its offset where the dataset allows)
    and scale up (``on_rows(rows tokenized, of how many)`` every few hundred rows, and
    ``(0, 0)`` before the tokenizer loads). Its cost
    grows with the sample, not with the dataset: the rows not chosen are not read.
    ``reuse``: rows an earlier start read, taken instead when it gives them."""
    import numpy as np

    plans, left = [], {}
    found = []
    for s in shards:
        ids, sp = _pending(s, facts.lines, output, facts, blank, status)
        left[s] = len(ids)
        found.append(ids)
        plans.append(sp)
    every = np.sort(np.concatenate(found)) if found else np.zeros(0, np.int64)
    taken = reuse(every) if reuse is not None else None
    read = None
    if taken is None:
        chosen, sampled = choose(every, sample, seed)
        kept = [paths.journal_dir(output, s) for s in shards]  # where a tokenizer may be kept
        rows, results = _read(cfg, facts, chosen, progress, on_rows, kept)
        read = keptrows.Read(rows, results, every, not sampled)
    else:
        rows, results, sampled = taken
    tallies = {s: sizing.Tally() for s in shards}
    by_shard = {sp.shard: sp for sp in plans}
    count = plans[0].shard.count if plans else 1
    for idx, f in zip(rows, results, strict=True):
        shard = Shard(idx % count, count)
        _count(by_shard[shard], tallies[shard], f, facts)
    for sp in plans:
        sp.estimate = sizing.scale(tallies[sp.shard], left[sp.shard])
        _scale_rows(sp, tallies[sp.shard].rows, left[sp.shard])
    tokens = sum(t.tokens for t in tallies.values())
    per_token = sum(t.bytes for t in tallies.values()) / tokens if tokens else 0.0
    return Estimated(plans, len(rows), sampled, per_token, read)


def _read(
    cfg: config.JobConfig,
    facts: job.JobFacts,
    chosen: list[int],
    show: bool,
    on_rows: Callable[[int, int], object] | None,
    kept: list[str],
) -> tuple[list[int], list[keptrows.Found]]:
    """Read the rows ``chosen`` and tokenize them as the feeder does (its encoder: loaded
    once a process); ``show``: a progress line on stderr. The rows read, and what each is."""
    from eagle3d.ingest.chat import encoder
    from eagle3d.ingest.dataformats import rows_at, unit

    rows = rows_at(cfg.dataset, facts.fmt, chosen, facts.starts, cfg.max_line_bytes)
    first = next(rows, None)
    if first is None:
        return [], []
    if on_rows is not None:  # the tokenizer's load takes seconds: said, and a stop seen
        on_rows(0, 0)
    enc = encoder(cfg.model, cfg.max_length, cfg.on_overflow, kept=kept)
    word = unit(facts.fmt)
    shown = _Progress(len(chosen) if show else 0)
    ids: list[int] = []
    results: list[keptrows.Found] = []
    for idx, raw in itertools.chain([first], rows):
        if on_rows is not None and shown.n & 255 == 0:
            on_rows(shown.n, len(chosen))
        ids.append(idx)
        results.append(_found(enc, idx, raw, word))
        shown.step()
    shown.done()
    return ids, results


def _format(facts: job.JobFacts) -> storedtype.StoreFormat:
    return storedtype.get(facts.job.store_dtype)


def _found(enc: Any, idx: int, raw: Any, word: str) -> keptrows.Found:
    """What row ``idx`` is, read as the run will: its sample's tokens, a cut, a refusal."""
    from eagle3d.ingest.dataformats import BadSample, parse_row

    try:
        tok = enc.encode(parse_row(idx, raw))
    except BadSample as bad:
        if bad.error == "too_long":
            return keptrows.Found(0, keptrows.TOO_LONG)
        bad.unit = word
        return keptrows.Found(0, keptrows.INVALID, 0, f"{bad} [{bad.error}]")
    if tok.truncated:
        cut = tok.full_length - len(tok.input_ids)
        return keptrows.Found(len(tok.input_ids), keptrows.CUT, cut)
    return keptrows.Found(len(tok.input_ids), keptrows.OK)


#: The first invalid rows a plan names.
FIRST_INVALID = 5


def _count(sp: ShardPlan, tally: sizing.Tally, f: keptrows.Found, facts: job.JobFacts) -> None:
    """One row's finding on its shard's plan and tally."""
    t = f.tokens
    tally.add(
        t, sizing.file_bytes(t, facts.hidden_size, len(facts.layers), _format(facts)) if t else 0
    )
    if f.kind in (keptrows.CUT, keptrows.TOO_LONG):
        sp.over += 1
        sp.dropped += f.dropped
        sp.skipped += f.kind == keptrows.TOO_LONG
    elif f.kind == keptrows.INVALID:
        sp.invalid += 1
        if f.message and len(sp.first_invalid) < FIRST_INVALID:
            sp.first_invalid.append(f.message)


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


@dataclass(frozen=True, slots=True)
class Checked:
    """``eagle3d run``'s check: the report; ``keep``: the rows it read, to keep beside the
    journal once the start is accepted (None: nothing read); ``kept``: it stood on rows
    an earlier start read."""

    report: PlanReport
    keep: keptrows.Keep | None
    kept: bool


def check_run(
    cfg: config.JobConfig,
    facts: job.JobFacts,
    shard: Shard,
    output: str,
    status: bytearray,
    on_rows: Callable[[int, int], object] | None = None,
) -> Checked:
    """``eagle3d run``'s check at start: its own shard's remaining rows (``status``: the
    daemon's resume fold) against the output's free space; the rows an earlier start of the
    shard kept are taken when they may stand for a read (:func:`eagle3d.run.keptrows.take`)."""
    from eagle3d.ingest import tokcache

    t0 = time.monotonic()
    blank = set(facts.blank)
    jdir = paths.journal_dir(output, shard)
    key = keptrows.key(
        dataset_sha=facts.job.dataset_sha,
        tokenizer=tokcache.key(cfg.model),
        max_length=cfg.max_length,
        on_overflow=cfg.on_overflow,
        fmt=facts.fmt.name,
        max_line=cfg.max_line_bytes,
        shard=shard,
    )

    def reuse(every: Any) -> keptrows.Taken | None:
        return keptrows.take(jdir, key, every, facts.lines)

    found = estimate(
        cfg, facts, [shard], output, blank=blank, status=status, on_rows=on_rows, reuse=reuse
    )
    report = plan_report(cfg, facts, output, found, len(facts.blank), shard, t0)
    if found.read is None:  # taken as kept
        return Checked(report, None, True)
    return Checked(report, keptrows.Keep(found.read, key, facts.lines), False)


def plan_report(
    cfg: config.JobConfig,
    facts: job.JobFacts,
    output: str,
    found: Estimated,
    blank: int,
    scope: Shard | None,
    t0: float,
) -> PlanReport:
    """The report of an :func:`estimate`, with the output filesystem's free space read now
    (a failure to read it is a problem the report names, not an error: fits is then unknown)."""
    plans = found.plans
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
        tokenized=found.tokenized,
        sampled=found.sampled,
        seconds=time.monotonic() - t0,
        shards=plans,
        scope=scope,
        disk=disk,
        reserve=sizing.parse_size(cfg.space_reserve, disk.total if disk else 0),
        bytes_per_token=found.per_token,
        problems=problems,
        max_failed_fraction=cfg.max_failed_fraction,
        commit=pace.estimate(
            _cpus(), cfg.commit_thread_count(_cpus()), found.per_token, _bytes_per_sample(plans)
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


__all__ = [
    "Checked",
    "Estimated",
    "PlanReport",
    "ShardPlan",
    "check_run",
    "choose",
    "estimate",
    "plan_report",
]
