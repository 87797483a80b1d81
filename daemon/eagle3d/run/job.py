"""What a job is: :func:`describe` reads the model config and the dataset once at start (the
job's fingerprint); :func:`check_fingerprint` refuses to resume a job whose dataset or
settings changed. What its journal says is done: :mod:`eagle3d.core.resume`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from eagle3proto import events as ev
from eagle3proto import paths
from eagle3proto.paths import Shard

from eagle3d import __version__, config
from eagle3d.exitcodes import EXIT_CONFIG, EXIT_FINGERPRINT, Fatal
from eagle3d.remote import recipes, storedtype
from eagle3d.run import capture

if TYPE_CHECKING:
    from collections.abc import Callable

    from eagle3d.ingest.dataformats import Format
    from eagle3d.ingest.lineindex import Lines
    from eagle3d.ingest.pin import Pin
    from eagle3d.run.stages import StartStages

#: JobInfo fields shown when a fingerprint differs (the fingerprint also covers the model).
COMPARED = (
    "dataset",
    "dataset_bytes",
    "dataset_sha",
    "model",
    "aux_layers",
    "recipe",
    "max_length",
    "on_overflow",
    "store_dtype",
)

log = logging.getLogger("eagle3d")


@dataclass(slots=True)
class JobFacts:
    job: ev.JobInfo
    total: int  # samples in this shard (blank lines are none)
    lines: int  # rows in the dataset (= sample ids)
    hidden_size: int
    layers: list[int]
    blank: list[int]  # ids of this shard's blank lines: skipped
    fmt: Format  # the dataset's format
    pin: Pin | None = None  # the dataset as found at the start
    capture: dict[str, Any] | None = None  # the capture contract (eagle3d.run.capture)
    inherited: int = 0  # rows of this shard another layout's journal settled: not in total
    starts: Any = None  # each row's byte offset (an uncompressed JSONL file), for sampling
    all_blank: list[int] = field(default_factory=list)  # every shard's blank ids
    pin_kept: bool = False  # the pin and rows came from the cache beside the journal


def describe(
    cfg: config.JobConfig, shard: Shard, output: str, stages: StartStages | None = None
) -> JobFacts:
    """Read the model config and hash the dataset (its progress told to ``stages``, where
    a signal ends it). Raises Fatal for impossible aux layers."""
    from eagle3d.ingest import dataformats

    mcfg = config.model_config(cfg.model)
    n_layers = int(mcfg["num_hidden_layers"])
    try:
        recipe, layers, source = recipes.resolve_job(
            cfg.recipe, cfg.target_layers(), cfg.draft_config, n_layers
        )
    except recipes.LayerError as e:
        raise Fatal(EXIT_CONFIG, f"{cfg.model}: {e}") from e
    fmt = dataformats.detect(cfg.dataset)
    pinned, found, was_kept = _dataset(cfg, fmt, paths.journal_dir(output, shard), stages)
    lines = found.rows
    blank = [i for i in found.blank if shard.owns(i)]
    with open(os.path.join(cfg.model, "config.json"), "rb") as f:
        raw = f.read().decode(errors="replace")
    model_sha = config.fingerprint({"config": raw})
    try:
        store = storedtype.resolve(cfg.store_dtype, json.loads(raw))
    except ValueError as e:
        raise Fatal(EXIT_CONFIG, str(e)) from e
    job = ev.JobInfo(
        model=os.path.abspath(cfg.model),
        dataset=os.path.abspath(cfg.dataset),
        dataset_bytes=pinned.size,
        dataset_sha=pinned.sha,
        aux_layers=layers,
        recipe="" if recipe == recipes.DEFAULT else recipe,
        output=output,
        shard_index=shard.index,
        shard_count=shard.count,
        backend=cfg.backend,
        max_length=cfg.max_length,
        on_overflow=cfg.on_overflow,
        store_dtype=store.name,
        version=__version__,
    )
    parts = {
        "model_config": model_sha,
        "dataset_sha": job.dataset_sha,
        "aux_layers": job.aux_layers,
        "max_length": job.max_length,
        "on_overflow": job.on_overflow,
        "store_dtype": job.store_dtype,
        "shard": [job.shard_index, job.shard_count],
    }
    if job.recipe:  # not in an EAGLE-3 job's parts: older outputs resume as before
        parts["recipe"] = job.recipe
    job.fingerprint = config.fingerprint(parts)
    total = len(range(shard.index, lines, shard.count)) - len(blank)
    contract = capture.contract(cfg, recipe, layers, source, store.name)
    hidden = int(mcfg["hidden_size"])
    facts = JobFacts(job, total, lines, hidden, layers, blank, fmt, pinned, contract)
    facts.starts, facts.all_blank = found.starts, found.blank
    facts.pin_kept = was_kept
    return facts


def _dataset(
    cfg: config.JobConfig, fmt: Format, jdir: str, stages: StartStages | None
) -> tuple[Pin, Lines, bool]:
    """The dataset's pin and rows: kept beside the journal in ``jdir`` while the file is
    provably unchanged (:mod:`eagle3d.ingest.pincache`), else read; whether they were kept."""
    from eagle3d.ingest import pincache

    kept = pincache.load(jdir, cfg.dataset, fmt.name, cfg.max_line_bytes)
    if isinstance(kept, tuple):
        log.info("dataset: its hash and rows from %s (unchanged since)", pincache.path_in(jdir))
        return kept[0], kept[1], True
    if kept:
        log.info("%s; the dataset is read whole", kept)
    return (*_read_dataset(cfg, fmt, stages), False)


def _read_dataset(
    cfg: config.JobConfig, fmt: Format, stages: StartStages | None
) -> tuple[Pin, Lines]:
    """The dataset pinned (a hash of every byte) and its rows counted through the pin."""
    from eagle3d.ingest import dataformats, pin

    try:  # pinned first: the rows are counted, and later read, from what was hashed
        pinned = pin.take(cfg.dataset, _pinning(stages), _wall_ns())
        counting = _counting(stages, pinned.size if fmt.name == "jsonl" else 0)
        found = dataformats.index(cfg.dataset, fmt, pinned, cfg.max_line_bytes, counting)
    except pin.DatasetChanged as e:
        raise Fatal(EXIT_FINGERPRINT, f"{e}; the run did not start") from e
    return pinned, found


def _wall_ns() -> Callable[[], int]:
    """The daemon's wall clock in nanoseconds (a test's ``wall_offset`` fault moves it)."""
    from eagle3d.remote import faults

    clock = faults.wall_clock()
    return lambda: int(clock() * 1e9)


def keep_pin(facts: JobFacts, jdir: str, max_line: int) -> None:
    """Keep the dataset's pin and rows beside the journal for the next start (once the start
    is accepted: a refused one writes nothing); a failure to write only costs that start the
    read."""
    from eagle3d.ingest import pincache
    from eagle3d.ingest.lineindex import Lines

    if facts.pin is None or facts.pin_kept:
        return
    if pincache.racy(facts.pin.ctime_ns, facts.pin.taken_ns):
        return  # changed just before the read: the next start could not trust it anyway
    lines = Lines(facts.lines, facts.all_blank, facts.starts)
    try:
        pincache.save(jdir, facts.pin, facts.fmt.name, max_line, lines)
    except OSError as e:
        log.warning("the dataset's pin was not kept in %s (%s)", jdir, e.strerror)


def _pinning(stages: StartStages | None) -> Callable[[int, int], object] | None:
    if stages is None:
        return None
    return lambda done, total: stages.progress(done=done, total=total, what="pinning")


def _counting(stages: StartStages | None, total: int) -> Callable[[int, int], object] | None:
    """The rows counted; bytes of ``total`` (0 for a compressed file: its lines' bytes are
    not the file's)."""
    if stages is None:
        return None
    from eagle3d.remote import faults

    slow = faults.armed("count_slow")

    def counting(rows: int, done: int) -> None:
        stages.progress(rows, done, total, "counting rows")
        if slow is not None:
            time.sleep(slow.n / 1000)

    return counting


def check_fingerprint(last: ev.RunStarted | None, job: ev.JobInfo, force: bool, output: str) -> str:
    """'' when resuming is safe; the differences when forced; raises Fatal otherwise."""
    if last is None or last.job.fingerprint == job.fingerprint:
        return ""
    diffs = [
        f"{k}: {getattr(last.job, k)!r} -> {getattr(job, k)!r}"
        for k in COMPARED
        if getattr(last.job, k) != getattr(job, k)
    ]
    what = "; ".join(diffs) or "model config changed"
    if force:
        return what
    raise Fatal(
        EXIT_FINGERPRINT,
        f"{output} holds a job with a different fingerprint ({what}); "
        "refusing to resume (use --force-resume to override)",
    )
