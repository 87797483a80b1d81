"""``eagle3d plan``: how much a job will write, and whether it fits, before it runs.

Takes ``eagle3d run``'s job arguments (and ``--config``); loads no weights. It tokenizes the
dataset as the run's feeder does (the model's tokenizer and chat template, ``max_length``,
``on_overflow``): every row, or with more than ``--sample`` rows (default 20,000) a uniform
random sample of that many (seeded, so two plans agree), whose spread gives a 95 % bound on
the total (:mod:`eagle3d.store.sizing`). Each sample's file size is exact for its token count
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

from eagle3proto.paths import Shard

from eagle3d import config
from eagle3d.core.sample import FAILED, PENDING, SAVED
from eagle3d.exitcodes import EXIT_CONFIG, Fatal
from eagle3d.remote import storedtype
from eagle3d.run import job
from eagle3d.run.preflight import check_dataset, check_model
from eagle3d.store import catalog, pace, sizing
from eagle3d.tools.planreport import PlanReport, ShardPlan

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
) -> tuple[list[ShardPlan], int, bool, float]:
    """Tokenize the remaining rows of ``shards`` (of one shard count; all rows, or a
    uniform sample of ``sample`` of them) and scale up. Returns (per-shard plans, rows
    tokenized, whether it was a sample, file bytes per token)."""
    from transformers import AutoTokenizer

    from eagle3d.ingest.chat import ChatEncoder
    from eagle3d.ingest.dataformats import BadSample, iter_rows, parse_row

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
    from eagle3d.ingest import dataformats

    _, blank_ids = dataformats.count(cfg.dataset, facts.fmt)
    shards = [Shard(i, own.count) for i in range(own.count)]
    found = estimate(cfg, facts, shards, output, blank=set(blank_ids), sample=sample, seed=seed)
    return _report(cfg, facts, output, found, len(blank_ids), own if own.count > 1 else None, t0)


def check_run(
    cfg: config.JobConfig, facts: job.JobFacts, shard: Shard, output: str, status: bytearray
) -> PlanReport:
    """``eagle3d run``'s check at start: its own shard's remaining rows (``status``: the
    daemon's resume fold) against the output's free space."""
    t0 = time.monotonic()
    found = estimate(cfg, facts, [shard], output, blank=set(facts.blank), status=status)
    return _report(cfg, facts, output, found, len(facts.blank), shard, t0)


def _report(
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
    from eagle3d.tools.logsetup import setup_logging

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


__all__ = ["PlanReport", "ShardPlan", "check_run", "estimate", "make_plan", "register"]
