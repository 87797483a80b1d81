"""``eagle3d plan``: how much a job will write, and whether it fits, before it runs.

Takes ``eagle3d run``'s job arguments (and ``--config``); loads no weights. It tokenizes the
dataset as the run's feeder does (the model's tokenizer and chat template, ``max_length``,
``on_overflow``): every row, or with more than ``--sample`` rows (default 20,000) a uniform
random sample of that many (seeded, so two plans agree), whose spread gives a 95 % bound on
the total (:mod:`eagle3d.sizing`). Each sample's file size is exact for its token count
(hidden size and aux layer count from the model's ``config.json``, the storage format,
the archive's own overhead); the journal and directory entries are added.

An output that already holds the job (a resumed job) counts only what remains: the rows
its shard journals do not record as saved or failed for good; what they saved is shown
beside it, from the journal. So ``plan`` after a crash says what the rest needs.

Per shard and in total: samples, tokens, bytes; the output filesystem's free space; the
reserve left free (``--space-reserve``, default 256 MiB: where the monitor calls a disk
full); and the verdict. With ``--shard I/N`` the verdict is that shard's (what that
``run`` writes), otherwise the whole job's: N shards writing into one output share its
filesystem, so plan them together before they start.

``eagle3d run`` makes the same check at start for its own shard (on the rows it still has
to do) and refuses a job that does not fit (exit 10) unless ``--no-space-check``.

Exit status (:attr:`PlanReport.exit_code`): 0 fits; 10 does not fit; 2 bad usage or config;
3 model or dataset missing or unreadable.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from eagle3proto.paths import Shard

from . import catalog, config, job, sizing, storedtype
from .preflight import EXIT_CONFIG, EXIT_OK, EXIT_SPACE, Fatal, check_dataset, check_model

log = logging.getLogger("eagle3d")


@dataclass(slots=True)
class ShardPlan:
    shard: Shard
    estimate: sizing.Estimate  # of what remains
    saved: int = 0  # samples the journal records as saved
    saved_bytes: int = 0
    failed: int = 0  # failed for good (not redone)
    note: str = ""  # the journal holds another job, ...


@dataclass(slots=True)
class PlanReport:
    """What a plan found. :attr:`exit_code` is the documented exit status."""

    model: str
    dataset: str
    output: str
    store_dtype: str
    hidden: int
    layers: int
    max_length: int
    rows: int  # dataset rows (sample ids)
    blank: int
    tokenized: int  # rows tokenized
    sampled: bool  # a sample of the rows, not all of them
    seconds: float
    shards: list[ShardPlan]
    scope: Shard | None  # the shard the verdict is for (None: every shard)
    disk: sizing.Disk | None
    reserve: int
    bytes_per_token: float  # of the files, at this job's token counts
    problems: list[str] = field(default_factory=list)

    @property
    def in_scope(self) -> list[ShardPlan]:
        return [s for s in self.shards if self.scope is None or s.shard == self.scope]

    @property
    def bytes(self) -> int:
        """What the job (or the shard in scope) still writes under the output."""
        n = sum(s.estimate.total for s in self.in_scope)
        fresh = all(s.saved == 0 for s in self.in_scope)
        return n + (sizing.JOURNAL_FIXED * len(self.in_scope) if fresh else 0)

    @property
    def bound(self) -> int:
        return int(sum(s.estimate.bound**2 for s in self.in_scope) ** 0.5)

    @property
    def fits(self) -> bool | None:
        """Whether :attr:`bytes` and the reserve fit in the free space (None: unknown)."""
        if self.disk is None:
            return None
        return self.bytes + self.reserve <= self.disk.free

    @property
    def exit_code(self) -> int:
        """0: fits (or the free space is unknown); 10: does not fit."""
        return EXIT_SPACE if self.fits is False else EXIT_OK

    def to_dict(self) -> dict[str, Any]:
        def shard(s: ShardPlan) -> dict[str, Any]:
            e = s.estimate
            return {
                "shard": s.shard.name,
                "rows": e.rows,
                "samples": e.samples,
                "tokens": e.tokens,
                "files_bytes": e.bytes,
                "bytes": e.total,
                "bound_bytes": e.bound,
                "saved_samples": s.saved,
                "saved_bytes": s.saved_bytes,
                "failed": s.failed,
                "note": s.note,
            }

        return {
            "model": self.model,
            "dataset": self.dataset,
            "output": self.output,
            "store_dtype": self.store_dtype,
            "hidden_size": self.hidden,
            "aux_layers": self.layers,
            "max_length": self.max_length,
            "rows": self.rows,
            "blank": self.blank,
            "tokenized_rows": self.tokenized,
            "sampled": self.sampled,
            "seconds": round(self.seconds, 3),
            "scope": self.scope.name if self.scope else "all",
            "bytes": self.bytes,
            "bound_bytes": self.bound,
            "samples": sum(s.estimate.samples for s in self.in_scope),
            "tokens": sum(s.estimate.tokens for s in self.in_scope),
            "bytes_per_token": round(self.bytes_per_token, 2),
            "free_bytes": self.disk.free if self.disk else None,
            "filesystem": self.disk.path if self.disk else None,
            "reserve_bytes": self.reserve,
            "fits": self.fits,
            "exit_code": self.exit_code,
            "shards": [shard(s) for s in self.shards],
            "problems": self.problems,
        }

    def __str__(self) -> str:
        z = sizing.size
        how = (
            f"a uniform sample of {self.tokenized:,} rows (95 % bounds shown)"
            if self.sampled
            else f"all {self.tokenized:,} remaining rows"
        )
        lines = [
            f"eagle3d plan {self.output}",
            f"  model {self.model}: hidden {self.hidden}, {self.layers} aux layers; states "
            f"{self.store_dtype}; max_length {self.max_length}",
            f"  dataset {self.dataset}: {self.rows:,} rows ({self.blank} blank); tokenized "
            f"{how} in {self.seconds:.1f} s",
            f"  {self.bytes_per_token:,.0f} bytes per token in the files",
        ]
        for s in self.shards:
            e = s.estimate
            pm = f" ± {z(e.bound)}" if e.bound else ""
            mark = "" if self.scope is None or s.shard == self.scope else "  (not this run's)"
            lines.append(
                f"  {s.shard.name}: {e.samples:,} samples, {e.tokens:,} tokens, "
                f"{z(e.total)}{pm} to write{mark}"
            )
            if s.saved or s.failed:
                lines.append(
                    f"    already saved {s.saved:,} ({z(s.saved_bytes)}), failed {s.failed:,}"
                    " (from the journal)"
                )
            if s.note:
                lines.append(f"    {s.note}")
        if self.scope is not None and len(self.shards) > 1:
            every = sum(s.estimate.total for s in self.shards)
            lines.append(
                f"  all {len(self.shards)} shards write {z(every)}: into one output they"
                " share its filesystem"
            )
        what = self.scope.name if self.scope is not None else "the job"
        pm = f" ± {z(self.bound)}" if self.bound else ""
        lines.append(f"  {what} writes {z(self.bytes)}{pm}; reserve {z(self.reserve)}")
        lines.extend(f"  {p}" for p in self.problems)
        if self.disk is None:
            lines.append("  free space: unknown")
            lines.append("FITS? UNKNOWN")
        else:
            lines.append(f"  {self.disk.path}: {z(self.disk.free)} free of {z(self.disk.total)}")
            short = self.bytes + self.reserve - self.disk.free
            lines.append("FITS" if self.fits else f"DOES NOT FIT (short by {z(short)})")
        return "\n".join(lines)


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
        sp.saved = sum(1 for i in rows if status[i] == job.SAVED)
        sp.failed = sum(1 for i in rows if status[i] == job.FAILED)
        return [i for i in rows if status[i] == job.PENDING], sp
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
) -> tuple[list[ShardPlan], int, bool, float]:
    """Tokenize the remaining rows of ``shards`` (of one shard count; all rows, or a
    uniform sample of ``sample`` of them) and scale up. Returns (per-shard plans, rows
    tokenized, whether it was a sample, file bytes per token)."""
    from transformers import AutoTokenizer

    from .chat import ChatEncoder
    from .dataformats import BadSample, iter_rows, parse_row

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
        tok = AutoTokenizer.from_pretrained(cfg.model)
        enc = ChatEncoder(tok, max_length=cfg.max_length, on_overflow=cfg.on_overflow)
    for idx, raw in rows_iter:
        if idx not in chosen:
            continue
        try:
            t = len(enc.encode(parse_row(idx, raw)).input_ids)
        except BadSample:
            t = 0  # never saved: a 0-byte sample
        b = sizing.file_bytes(t, facts.hidden_size, n_layers, fmt) if t else 0
        tallies[Shard(idx % count, count)].add(t, b)
    for sp in plans:
        sp.estimate = sizing.scale(tallies[sp.shard], len(pending[sp.shard]))
    tokens = sum(t.tokens for t in tallies.values())
    per_token = sum(t.bytes for t in tallies.values()) / tokens if tokens else 0.0
    return plans, len(chosen), sampled, per_token


def make_plan(
    cfg: config.JobConfig, *, sample: int = sizing.DEFAULT_SAMPLE, seed: int = 0
) -> PlanReport:
    """The plan of a job: every shard of its shard count, the verdict for its own shard
    when it has more than one (``--shard I/N``, or Slurm's or torchrun's variables)."""
    t0 = time.monotonic()
    check_model(cfg.model)
    check_dataset(cfg.dataset)
    own = cfg.shard_spec()
    output = os.path.abspath(cfg.output)
    facts = job.describe(cfg, own, output)
    from . import dataformats

    _, blank_ids = dataformats.count(cfg.dataset, facts.fmt)
    shards = [Shard(i, own.count) for i in range(own.count)]
    plans, tokenized, sampled, per_token = estimate(
        cfg, facts, shards, output, blank=set(blank_ids), sample=sample, seed=seed
    )
    problems = []
    try:
        disk: sizing.Disk | None = sizing.free_space(output)
    except OSError as e:
        disk, problems = None, [f"free space of {output}: {e.strerror or e}"]
    reserve = sizing.parse_size(cfg.space_reserve, disk.total if disk else 0)
    return PlanReport(
        model=os.path.abspath(cfg.model),
        dataset=os.path.abspath(cfg.dataset),
        output=output,
        store_dtype=facts.job.store_dtype,
        hidden=facts.hidden_size,
        layers=len(facts.layers),
        max_length=cfg.max_length,
        rows=facts.lines,
        blank=len(blank_ids),
        tokenized=tokenized,
        sampled=sampled,
        seconds=time.monotonic() - t0,
        shards=plans,
        scope=own if own.count > 1 else None,
        disk=disk,
        reserve=reserve,
        bytes_per_token=per_token,
        problems=problems,
    )


def check_run(
    cfg: config.JobConfig, facts: job.JobFacts, shard: Shard, output: str, status: bytearray
) -> PlanReport:
    """``eagle3d run``'s check at start: its own shard's remaining rows (``status``: the
    daemon's resume fold) against the output's free space."""
    t0 = time.monotonic()
    plans, tokenized, sampled, per_token = estimate(
        cfg, facts, [shard], output, blank=set(facts.blank), status=status
    )
    try:
        disk: sizing.Disk | None = sizing.free_space(output)
    except OSError:
        disk = None
    return PlanReport(
        model=os.path.abspath(cfg.model),
        dataset=os.path.abspath(cfg.dataset),
        output=output,
        store_dtype=facts.job.store_dtype,
        hidden=facts.hidden_size,
        layers=len(facts.layers),
        max_length=cfg.max_length,
        rows=facts.lines,
        blank=len(facts.blank),
        tokenized=tokenized,
        sampled=sampled,
        seconds=time.monotonic() - t0,
        shards=plans,
        scope=shard,
        disk=disk,
        reserve=sizing.parse_size(cfg.space_reserve, disk.total if disk else 0),
        bytes_per_token=per_token,
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan",
        help="how much a job will write, and whether it fits (no weights loaded)",
        description="Tokenize the dataset (or a sample of it) as `eagle3d run` would and "
        "print the bytes and tokens each shard writes, the output filesystem's free space "
        "and whether the job fits with the reserve. A resumed job counts what remains. "
        "Exit 0: fits; 10: does not fit; 2: bad usage or config; 3: model or dataset "
        "missing.",
    )
    config.add_job_arguments(p)
    p.add_argument(
        "--sample",
        type=int,
        default=sizing.DEFAULT_SAMPLE,
        metavar="N",
        help=f"tokenize at most N rows, a uniform random sample (default {sizing.DEFAULT_SAMPLE:,};"
        " 0: every row)",
    )
    p.add_argument("--seed", type=int, default=0, help="of the sample (default 0)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from .logsetup import setup_logging

    setup_logging()
    try:
        cfg = config.from_args(args)
        report = make_plan(cfg, sample=args.sample, seed=args.seed)
    except (config.ConfigError, ValueError) as e:
        log.error("%s", e)
        return EXIT_CONFIG
    except Fatal as e:
        log.error("%s", e)
        return e.code
    if args.json:
        sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n")
    else:
        print(report)
    return report.exit_code


__all__ = ["PlanReport", "check_run", "estimate", "make_plan", "register"]
