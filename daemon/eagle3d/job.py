"""What a job is (its fingerprint) and what its journal says is already done.

:func:`describe` reads the model config and the dataset once at start; :class:`ResumeFold`
folds replayed journal records into the per-sample status the daemon resumes from;
:func:`check_fingerprint` refuses to resume a job whose dataset or settings changed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from eagle3proto import events as ev
from eagle3proto import reducer
from eagle3proto.paths import Shard

from . import __version__, config, storedtype
from .envfault import recorded_failure_is_environment
from .preflight import EXIT_CONFIG, EXIT_FAILED, EXIT_FINGERPRINT, EXIT_OK, Fatal

PENDING, SAVED, FAILED, SKIPPED = 0, 1, 2, 3

#: JobInfo fields shown when a fingerprint differs (the fingerprint also covers the model).
COMPARED = (
    "dataset",
    "dataset_bytes",
    "dataset_sha",
    "model",
    "aux_layers",
    "max_length",
    "on_overflow",
    "store_dtype",
)


@dataclass(slots=True)
class JobFacts:
    job: ev.JobInfo
    total: int  # samples in this shard (blank lines are none)
    lines: int  # rows in the dataset (= sample ids)
    hidden_size: int
    layers: list[int]
    blank: list[int]  # ids of this shard's blank lines: skipped
    fmt: Any = None  # the dataset's dataformats.Format


def describe(cfg: config.JobConfig, shard: Shard, output: str) -> JobFacts:
    """Read the model config and hash the dataset. Raises Fatal for impossible aux layers."""
    from . import dataformats

    mcfg = config.model_config(cfg.model)
    n_layers = int(mcfg["num_hidden_layers"])
    layers = cfg.aux_layers or config.default_aux_layers(n_layers)
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise Fatal(EXIT_CONFIG, f"aux_layers {bad} outside 0..{n_layers - 1} of {cfg.model}")
    fmt = dataformats.detect(cfg.dataset)
    lines, blank_ids = dataformats.count(cfg.dataset, fmt)
    blank = [i for i in blank_ids if shard.owns(i)]
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
        dataset_bytes=os.path.getsize(cfg.dataset),
        dataset_sha=config.file_sha(cfg.dataset),
        aux_layers=layers,
        output=output,
        shard_index=shard.index,
        shard_count=shard.count,
        backend=cfg.backend,
        max_length=cfg.max_length,
        on_overflow=cfg.on_overflow,
        store_dtype=store.name,
        version=__version__,
    )
    job.fingerprint = config.fingerprint(
        {
            "model_config": model_sha,
            "dataset_sha": job.dataset_sha,
            "aux_layers": job.aux_layers,
            "max_length": job.max_length,
            "on_overflow": job.on_overflow,
            "store_dtype": job.store_dtype,
            "shard": [job.shard_index, job.shard_count],
        }
    )
    total = len(range(shard.index, lines, shard.count)) - len(blank)
    return JobFacts(job, total, lines, int(mcfg["hidden_size"]), layers, blank, fmt)


def finish_code(saved: int, failed: int, total: int, max_failed_fraction: float) -> int:
    """The exit status of a finished shard: EXIT_FAILED when it had samples and every one
    failed, or more than ``max_failed_fraction`` of them did; else EXIT_OK."""
    if total <= 0 or failed == 0:
        return EXIT_OK
    if saved == 0 or failed > max_failed_fraction * total:
        return EXIT_FAILED
    return EXIT_OK


def describe_counts(saved: int, failed: int, total: int) -> str:
    """``saved 0 / 218 (0 %), 218 failed``: percentages are saved of total, never failed."""
    pct = 100.0 * saved / total if total > 0 else 100.0
    shown = f"{pct:.0f}" if pct in (0.0, 100.0) or pct >= 10 else f"{pct:.1f}"
    return f"saved {saved} / {total} ({shown} %), {failed} failed"


@dataclass(slots=True)
class ResumeFold:
    """Folds replayed records: per-sample status, the live reducer state, the last session.

    The latest record of a sample wins: saved, failed for good, pending again (a retry
    after a failure, ``sample_invalid`` after a save). A failure for good that an older
    eagle3d recorded for the environment's fault (:func:`recorded_failure_is_environment`)
    is pending again, and listed in :attr:`reopen` for the daemon to journal.
    """

    status: bytearray
    state: reducer.ShardState
    last_started: ev.RunStarted | None = None
    finished_last: bool = False  # the journal's last session ended with run_finished
    reopen: dict[int, ev.SampleFailed] = field(default_factory=dict)

    def sink(self, batch: list[ev.AnyEvent]) -> None:
        status = self.status
        for e in batch:
            reducer.apply(self.state, e)
            if isinstance(e, ev.SampleSaved):
                if e.idx < len(status):
                    status[e.idx] = SAVED
                self.reopen.pop(e.idx, None)
            elif isinstance(e, ev.SampleFailed):
                if e.idx >= len(status) or status[e.idx] == SAVED:
                    continue
                if e.retry:
                    status[e.idx] = PENDING
                    self.reopen.pop(e.idx, None)
                elif recorded_failure_is_environment(e.error, e.message):
                    status[e.idx] = PENDING
                    self.reopen[e.idx] = e
                else:
                    status[e.idx] = FAILED
            elif isinstance(e, ev.SampleInvalid):
                if e.idx < len(status) and status[e.idx] == SAVED:
                    status[e.idx] = PENDING
                self.finished_last = False
            elif isinstance(e, ev.RunStarted):
                self.last_started = e
            if isinstance(e, ev.RunFinished):
                self.finished_last = True
            elif isinstance(e, ev.RunStarted):
                self.finished_last = False


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
