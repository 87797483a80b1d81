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
import sys
import time

from eagle3proto.paths import Shard

from eagle3d import config
from eagle3d.exitcodes import EXIT_CONFIG, Fatal
from eagle3d.run import job
from eagle3d.run.estimate import PlanReport, ShardPlan, check_run, estimate, plan_report
from eagle3d.run.preflight import check_dataset, check_model
from eagle3d.store import sizing

log = logging.getLogger("eagle3d")


def make_plan(
    cfg: config.JobConfig, *, sample: int = sizing.DEFAULT_SAMPLE, seed: int = 0
) -> PlanReport:
    """The plan of a job: every shard of its shard count, the verdict for its own shard
    when it has more than one (``--shard I/N``, or Slurm's or torchrun's variables)."""
    t0 = time.monotonic()
    check_model(cfg.model, weights=False)  # plan loads no weights
    check_dataset(cfg.dataset)
    own = cfg.shard_spec()
    output = os.path.abspath(cfg.output)
    facts = job.describe(cfg, own, output)
    blank_ids = facts.all_blank
    shards = [Shard(i, own.count) for i in range(own.count)]
    found = estimate(
        cfg, facts, shards, output, blank=set(blank_ids), sample=sample, seed=seed, progress=True
    )
    return plan_report(
        cfg, facts, output, found, len(blank_ids), own if own.count > 1 else None, t0
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
    config.add_job_arguments(p, run=False)
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
    from eagle3d.serve.logsetup import setup_logging

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
