"""``eagle3d run``: the subcommand, its flags (:func:`eagle3d.config.add_job_arguments`) and
its exit codes (:mod:`eagle3d.exitcodes`)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import time

from eagle3d import config, exitcodes
from eagle3d.exitcodes import EXIT_CONFIG, EXIT_OK, Fatal
from eagle3d.remote import faults

log = logging.getLogger("eagle3d")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "run",
        help="run (or resume) an extraction job in the foreground",
        description="Extract EAGLE-3 hidden states for every sample of a shard. "
        "Rerun the same command to resume; a finished job is a no-op.",
        epilog=exitcodes.help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    config.add_job_arguments(p)
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from eagle3d.serve.logsetup import setup_logging

    setup_logging()
    try:
        cfg = config.from_args(args)
        faults.parse(os.environ.get("EAGLE3D_FAULT", ""))
    except (config.ConfigError, ValueError) as e:
        log.error("%s", e)
        return EXIT_CONFIG
    try:
        code = run_job(cfg, summary=True)
    except Fatal as e:
        log.error("%s", e)
        return e.code
    except KeyboardInterrupt:
        return EXIT_OK
    # The run is over and its exit status decided: a stop that arrives while the interpreter
    # winds down (the loop's handlers are gone) has nothing left to stop, and must not turn
    # a finished run into a death by signal (exit -15, or a KeyboardInterrupt traceback).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    # Everything is closed (journal, socket, lock): spare the interpreter's exit the cyclic
    # collections over torch's and transformers' objects, most of a second of CPU here
    # (docs/benchmarks.md, "Whole short job"). Objects are still freed as modules are cleared.
    gc.freeze()
    return code


def run_job(cfg: config.JobConfig, summary: bool = False) -> int:
    """Run a job in this process (``eagle3d run``, ``eagle3d demo``, the benchmarks);
    ``summary``: end with the session's summary line (what the journal says)."""
    from eagle3d.run.daemon import Daemon
    from eagle3d.serve import progress

    started = time.monotonic()
    _numpy_with_one_blas_thread()
    daemon = Daemon(cfg)
    code = asyncio.run(daemon.run())
    if summary and daemon.state.total >= 0:
        log.info("%s", progress.summary(daemon.state, time.monotonic() - started))
    return code


def _numpy_with_one_blas_thread() -> None:
    """Load numpy with one BLAS thread, unless the user set OpenBLAS's threads.

    The daemon's numpy does no linear algebra (views, copies, comparisons), yet OpenBLAS
    starts a thread per core at import, each spinning before it sleeps: 0.08 CPU-s of a
    start on 2 cores, a core-second or more on a GPU node's. The environment is restored:
    the processes the daemon starts keep the user's."""
    if "numpy" in sys.modules or "OPENBLAS_NUM_THREADS" in os.environ:
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import numpy  # noqa: F401
    finally:
        del os.environ["OPENBLAS_NUM_THREADS"]


__all__ = ["cmd_run", "register", "run_job"]
