"""``eagle3d verify``: check every committed sample against the journal.

For each ``sample saved`` record that counts (the latest of its sample, no ``sample_invalid``
after it) of every shard journal under ``OUTPUT/.eagle3d``: the file exists, and its size and
checksum (CRC-32 over its bytes, nothing unpickled: the commit validated those bytes before
it wrote them) match the record. ``--deep`` also loads it: the right keys, dtypes and shapes
(fp8 files: their scales too, positive and finite), its states in the storage dtype of the
session that saved it (``job.store_dtype`` of its ``run_started``; journals from before that
field are not checked for it), and lists the row folders for files the journal does not
know. Without ``--deep`` the output tree is never listed: the journal says what should exist.

Streaming, so that a million samples cost what ten thousand do per sample: the journals are
read twice (which record counts, in a few bytes a sample; then the checks, in journal order),
at most ``--jobs`` x 4 batches of files are in flight, and a progress line says where to
resume from (``--since``). ``--sample N%`` checks the same N % of the samples every time.

``--repair`` journals each damaged or missing committed sample as ``sample_invalid`` in its
shard's journal (its file, if any, moved aside under ``OUTPUT/.eagle3d/damaged/``, never
deleted), so that the next ``eagle3d run`` with the same command extracts exactly those
again. It takes the shard's lock: a daemon running that shard must be stopped first.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from eagle3proto import events as ev
from eagle3proto import layouts, paths
from eagle3proto.journal import JournalWriter
from eagle3proto.journalread import replay
from eagle3proto.paths import Shard

from eagle3d.exitcodes import Fatal
from eagle3d.remote import storedtype
from eagle3d.run.preflight import ShardLock
from eagle3d.store import fp8
from eagle3d.store.crc import fd_checksum, file_checksum


@dataclass(slots=True)
class ShardReport:
    shard: str
    total: int = -1
    saved: int = 0
    failed: int = 0
    finished: bool = False
    journal_problems: list[str] = field(default_factory=list)
    journal_fatal: bool = False
    store_dtype: str = ""  # of the shard's samples; "a, b" after a forced resume changed it
    started_ts: float = 0.0  # its last run_started
    #: the shard count that took over the rest of its rows (0: its layout is the current one)
    closed_by: int = 0

    @property
    def pending(self) -> int | None:
        if self.closed_by:
            return 0
        return max(self.total - self.saved - self.failed, 0) if self.total >= 0 else None


@dataclass(slots=True)
class VerifyReport:
    """What verify found; :attr:`exit_code` is the documented exit status."""

    output: str
    shards: list[ShardReport] = field(default_factory=list)
    checked: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)
    #: sample id -> its problem, for the committed samples found damaged or missing
    damaged: dict[int, str] = field(default_factory=dict)
    #: sample id -> its record, for the damaged or missing ones (what --repair journals)
    saved_records: dict[int, ev.SampleSaved] = field(default_factory=dict)
    saved_by: dict[int, Shard] = field(default_factory=dict)  # the journal that saved each of those
    repaired: list[str] = field(default_factory=list)  # what --repair did
    repair_error: str = ""

    @property
    def all_failed(self) -> bool:
        """Every sample the journals hold failed: nothing was saved."""
        saved, failed = sum(s.saved for s in self.shards), sum(s.failed for s in self.shards)
        return saved == 0 and failed > 0

    @property
    def ok(self) -> bool:
        if not self.shards or self.repaired or self.repair_error or self.all_failed:
            return False
        return not self.problems and not any(s.journal_fatal for s in self.shards)

    @property
    def exit_code(self) -> int:
        """0: consistent; 1: a problem was found (repaired or not); 2: no journal under
        the output; 3: consistent, but every sample failed (nothing saved)."""
        if not self.shards:
            return 2
        if self.ok:
            return 0
        inconsistent = self.problems or any(s.journal_fatal for s in self.shards)
        if self.all_failed and not inconsistent and not self.repaired and not self.repair_error:
            return 3
        return 1

    def to_dict(self) -> dict[str, object]:
        return {
            "output": self.output,
            "ok": self.ok,
            "repaired": self.repaired,
            "repair_error": self.repair_error,
            "exit_code": self.exit_code,
            "checked": self.checked,
            "bytes_checked": self.bytes_checked,
            "saved": sum(s.saved for s in self.shards),
            "failed": sum(s.failed for s in self.shards),
            "problems": self.problems,
            "shards": [
                {
                    "shard": s.shard,
                    "total": s.total,
                    "saved": s.saved,
                    "failed": s.failed,
                    "pending": s.pending,
                    "finished": s.finished,
                    "closed_by": s.closed_by or None,
                    "store_dtype": s.store_dtype,
                    "journal_problems": s.journal_problems,
                }
                for s in self.shards
            ],
        }

    def __str__(self) -> str:
        lines = [f"eagle3d verify {self.output}"]
        if not self.shards:
            lines.append(f"  no eagle3d journal under {self.output}/{paths.STATE_DIR}")
            lines.append("NOTHING TO VERIFY")
            return "\n".join(lines)
        for s in self.shards:
            if s.closed_by:
                state = f"closed: the rest of its rows went to the {s.closed_by}-shard layout"
            else:
                state = "finished" if s.finished else f"{s.pending or 0} pending"
            stored = f", states {s.store_dtype}" if s.store_dtype else ""
            lines.append(
                f"  {s.shard}: {s.saved} saved, {s.failed} failed of {s.total} ({state}{stored})"
            )
            lines.extend(f"    journal: {p}" for p in s.journal_problems)
        gib = self.bytes_checked / (1 << 30)
        lines.append(f"  checked {self.checked} file(s), {gib:.2f} GiB")
        if self.problems:
            lines.append(f"  {len(self.problems)} problem(s):")
            lines.extend(f"    {p}" for p in self.problems[:50])
            if len(self.problems) > 50:
                lines.append(f"    ... and {len(self.problems) - 50} more (see --json)")
        if self.repair_error:
            lines.append(f"  not repaired: {self.repair_error}")
        if self.repaired:
            lines.append(f"  repaired {len(self.repaired)} sample(s):")
            lines.extend(f"    {r}" for r in self.repaired[:50])
            lines.append("  rerun the same `eagle3d run` command to extract them again")
            lines.append("REPAIRED")
        elif self.exit_code == 3:
            failed = sum(s.failed for s in self.shards)
            lines.append(
                f"  every sample failed ({failed}): nothing was saved"
                f" (eagle3d report -o {self.output} lists why)"
            )
            lines.append("NOTHING SAVED")
        else:
            lines.append("OK" if self.ok else "INCONSISTENT")
        return "\n".join(lines)


def check_sample(
    output: str, rec: ev.SampleSaved, quick: bool = False, store_dtype: str = ""
) -> str | None:
    """Check one committed sample (its states in ``store_dtype``, unless ''); returns a
    problem description or None."""
    path = os.path.join(output, rec.path)
    if rec.path != paths.sample_relpath(rec.idx):
        return f"sample {rec.idx}: journal path {rec.path} is not {paths.sample_relpath(rec.idx)}"
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return f"sample {rec.idx}: {rec.path} is missing"
    if size != rec.bytes:
        return f"sample {rec.idx}: {rec.path} has {size} bytes, journal says {rec.bytes}"
    if quick:
        return None
    _, checksum = file_checksum(path)
    if checksum != rec.checksum:
        return f"sample {rec.idx}: {rec.path} checksum {checksum}, journal says {rec.checksum}"
    return _check_tensors(path, rec, store_dtype)


def _check_tensors(path: str, rec: ev.SampleSaved, store_dtype: str) -> str | None:
    import torch

    try:
        d = torch.load(path, mmap=True, weights_only=True)
    except Exception as e:
        return f"sample {rec.idx}: {rec.path} does not load ({type(e).__name__}: {e})"
    try:
        fmt = storedtype.get(store_dtype) if store_dtype else None
    except ValueError as e:
        return f"sample {rec.idx}: {e} (in the journal's run_started record)"
    want = set(fmt.keys if fmt is not None else storedtype.BASE_KEYS)
    if not isinstance(d, dict) or set(d) != want:
        return f"sample {rec.idx}: keys {sorted(d) if isinstance(d, dict) else type(d)}"
    t = rec.tokens
    ids, mask, hid, aux = d["input_ids"], d["loss_mask"], d["hidden_state"], d["aux_hidden_state"]
    if tuple(ids.shape) != (t,) or ids.dtype != torch.int64:
        return f"sample {rec.idx}: input_ids {tuple(ids.shape)} {ids.dtype}, want ({t},) int64"
    if tuple(mask.shape) != (t,):
        return f"sample {rec.idx}: loss_mask {tuple(mask.shape)}, want ({t},)"
    if hid.dim() != 3 or hid.shape[:2] != (1, t):
        return f"sample {rec.idx}: hidden_state {tuple(hid.shape)}, want (1, {t}, H)"
    h = hid.shape[2]
    if aux.dim() != 3 or aux.shape[:2] != (1, t) or aux.shape[2] % h or aux.shape[2] == h:
        return (
            f"sample {rec.idx}: aux_hidden_state {tuple(aux.shape)}, want (1, {t}, kH) with H={h}"
        )
    if fmt is None:
        return None
    for name, x in (("hidden_state", hid), ("aux_hidden_state", aux)):
        got = str(x.dtype).removeprefix("torch.")
        if got != fmt.torch_dtype:
            return f"sample {rec.idx}: {name} is {got}, the job stores {store_dtype}"
    if fmt.scaled:  # fp8: a positive, finite scale per token and tensor
        for name in ("hidden_state", "aux_hidden_state"):
            key = name + storedtype.SCALE_SUFFIX
            scale = d[key]
            if tuple(scale.shape) != (1, t, 1):
                return f"sample {rec.idx}: {key} {tuple(scale.shape)}, want (1, {t}, 1)"
            bad = fp8.check(scale)
            if bad:
                return f"sample {rec.idx}: {key} {bad}"
    return None


class _ShardFold:
    """Pass 1 over one shard's journal: which ``sample_saved`` record of each sample counts
    (the latest, unless a ``sample_invalid`` followed it), in arrays of a few bytes a sample
    (no record is kept), and the shard's counts."""

    def __init__(self, sr: ShardReport, problems: list[str], ordinal: int, index: _Index) -> None:
        self.sr = sr
        self.problems = problems
        self.ordinal = ordinal
        self.index = index
        self.failed = bytearray()  # 1: the latest record says failed for good
        self.stores: set[str] = set()  # storage dtypes of the sessions that saved samples
        self.store = ""

    def sink(self, batch: list[ev.AnyEvent]) -> None:
        index = self.index
        for e in batch:
            if isinstance(e, ev.SampleSaved):
                if index.owned_by(e.idx, self.ordinal):
                    self.problems.append(f"sample {e.idx}: saved twice in {self.sr.shard}")
                    self.sr.saved -= 1
                elif index.owner(e.idx):
                    self.problems.append(f"sample {e.idx}: saved by more than one shard")
                index.set(e.idx, self.ordinal, e.seq)
                self.sr.saved += 1
                self.stores.add(self.store)
                self._failed(e.idx, False)
            elif isinstance(e, ev.SampleInvalid):  # repaired: no longer saved, redone
                if index.owned_by(e.idx, self.ordinal):
                    index.set(e.idx, 0, -1)
                    self.sr.saved -= 1
            elif isinstance(e, ev.SampleFailed):  # the latest record of a sample wins
                self._failed(e.idx, not e.retry)
            elif isinstance(e, ev.RunStarted):
                self.sr.total = e.total
                self.sr.finished = False
                self.sr.started_ts = e.ts
                self.store = e.job.store_dtype
            elif isinstance(e, ev.RunFinished):
                self.sr.finished = True

    def _failed(self, idx: int, yes: bool) -> None:
        f = self.failed
        if idx >= len(f):
            if not yes:
                return
            f.extend(bytes(idx + 1 - len(f) + (len(f) >> 1)))
        f[idx] = yes

    def count_failed(self) -> int:
        """Failed for good and not saved since."""
        index = self.index
        return sum(1 for i, v in enumerate(self.failed) if v and not index.owner(i))


class _Index:
    """Sample id -> (shard ordinal, seq of the ``sample_saved`` record that counts): 10
    bytes a sample, grown as ids appear."""

    def __init__(self) -> None:
        self._owner = array("H")
        self._seq = array("q")

    def _grow(self, idx: int) -> None:
        n = idx + 1 - len(self._owner)
        if n > 0:
            n = max(n, len(self._owner) >> 1)
            self._owner.frombytes(bytes(2 * n))
            self._seq.frombytes(bytes(8 * n))

    def set(self, idx: int, ordinal: int, seq: int) -> None:
        self._grow(idx)
        self._owner[idx] = ordinal
        self._seq[idx] = seq

    def owner(self, idx: int) -> int:
        return self._owner[idx] if idx < len(self._owner) else 0

    def owned_by(self, idx: int, ordinal: int) -> bool:
        return self.owner(idx) == ordinal

    def counts(self, idx: int, ordinal: int, seq: int) -> bool:
        """Is this record the one that counts for sample ``idx``?"""
        return self.owner(idx) == ordinal and self._seq[idx] == seq


def sampled(idx: int, percent: float) -> bool:
    """The deterministic ``--sample`` choice: the same ids every time for one percentage."""
    return percent >= 100 or (idx * 2654435761) % 10_000 < percent * 100


@dataclass(slots=True)
class Options:
    """How ``verify`` checks: ``quick`` (sizes only), ``deep`` (tensors loaded as well, and
    the row folders listed for files the journal does not know), ``since`` (only samples
    saved at or after this Unix time), ``sample`` (this percentage of the samples)."""

    quick: bool = False
    deep: bool = False
    jobs: int = 4
    since: float = 0.0
    sample: float = 100.0
    progress: Callable[[Progress], None] | None = None


@dataclass(slots=True)
class Progress:
    files: int
    total: int  # files to check (an upper bound with --sample)
    bytes: int
    seconds: float
    last_ts: float  # saved-at time of the newest sample checked: where --since resumes


def verify(
    output: str, *, quick: bool = False, jobs: int = 4, options: Options | None = None
) -> VerifyReport:
    """Verify an output directory (all shards), streaming: the journals are read twice (what
    counts, then what to check, in journal order), at most ``jobs * 4`` batches of files are
    in flight, and nothing is kept per sample beyond a few bytes (:class:`_Index`)."""
    opts = options or Options(quick=quick, jobs=jobs)
    report = VerifyReport(os.path.abspath(output))
    index = _Index()
    shards = paths.shard_dirs(output)
    folds: list[tuple[Shard, str, _ShardFold]] = []
    for ordinal, (shard, jdir) in enumerate(shards, start=1):
        sr = ShardReport(shard.name)
        fold = _ShardFold(sr, report.problems, ordinal, index)
        rep = replay(jdir, fold.sink)
        sr.journal_problems = [p.describe() for p in rep.problems]
        sr.journal_fatal = rep.stopped_early
        if rep.stopped_early:
            report.problems.extend(f"{shard.name} journal: {p}" for p in sr.journal_problems)
        sr.store_dtype = ", ".join(sorted(fold.stores - {""}))
        folds.append((shard, jdir, fold))
        report.shards.append(sr)
    for _shard, _jdir, fold in folds:
        fold.sr.failed = fold.count_failed()
    current = layouts.current_count((s.count, f.sr.started_ts) for s, _, f in folds)
    for s, _, f in folds:
        if s.count != current and current:
            f.sr.closed_by = current
    total = sum(f.sr.saved for _, _, f in folds)
    checker = _Checker(output, opts, report, total)
    with checker:
        for ordinal, (shard, jdir, _fold) in enumerate(folds, start=1):
            replay(jdir, functools.partial(checker.feed, shard, ordinal, index))
    if opts.deep:
        report.problems.extend(_unknown_files(output, index))
    return report


#: A task of the check pool: this many files, or this many bytes, whichever comes first.
#: One future per file cost more than a small file's own read (a lock, a condition and a
#: thread's wake-up each: 100 us of CPU a file at 1M files of 12 KiB, against cat's 30).
BATCH_FILES = 64
BATCH_BYTES = 64 << 20


class _Checker:
    """Pass 2: the records that count go to a pool of ``jobs`` threads in batches (up to
    :data:`BATCH_FILES` files or :data:`BATCH_BYTES` bytes) through a bounded window;
    results are taken in order (the report's problems are in journal order)."""

    def __init__(self, output: str, opts: Options, report: VerifyReport, total: int) -> None:
        self.output = output
        self.opts = opts
        self.report = report
        self.total = total
        self.store = ""
        self.batch: list[tuple[ev.SampleSaved, Shard, str]] = []  # (record, shard, store)
        self.batch_bytes = 0
        self.window: deque[
            tuple[list[tuple[ev.SampleSaved, Shard, str]], Future[list[str | None]]]
        ] = deque()
        self.limit = max(1, opts.jobs) * 4
        self.pool = ThreadPoolExecutor(max(1, opts.jobs), thread_name_prefix="verify")
        self.t0 = time.monotonic()
        self.shown = self.t0
        self.last_ts = 0.0

    def __enter__(self) -> _Checker:
        return self

    def __exit__(self, *exc: object) -> None:
        self._submit()
        while self.window:
            self._take()
        self.pool.shutdown()
        self._show(force=True)

    def feed(self, shard: Shard, ordinal: int, index: _Index, batch: list[ev.AnyEvent]) -> None:
        opts = self.opts
        for e in batch:
            if isinstance(e, ev.RunStarted):
                self.store = e.job.store_dtype
            if not isinstance(e, ev.SampleSaved) or not index.counts(e.idx, ordinal, e.seq):
                continue
            if not shard.owns(e.idx):
                self.report.problems.append(
                    f"sample {e.idx}: saved by {shard.name}, which does not own it"
                )
            if e.ts < opts.since or not sampled(e.idx, opts.sample):
                continue
            self.batch.append((e, shard, self.store))
            self.batch_bytes += e.bytes
            if len(self.batch) >= BATCH_FILES or self.batch_bytes >= BATCH_BYTES:
                self._submit()

    def _submit(self) -> None:
        if not self.batch:
            return
        if len(self.window) >= self.limit:
            self._take()
        work, self.batch, self.batch_bytes = self.batch, [], 0
        self.window.append((work, self.pool.submit(self._check_all, work)))

    def _check_all(self, work: list[tuple[ev.SampleSaved, Shard, str]]) -> list[str | None]:
        return [self._check(rec, store) for rec, _, store in work]

    def _check(self, rec: ev.SampleSaved, store: str) -> str | None:
        if self.opts.deep:
            return check_sample(self.output, rec, False, store)
        return check_bytes(self.output, rec, self.opts.quick)

    def _take(self) -> None:
        work, fut = self.window.popleft()
        report = self.report
        for (rec, shard, _), problem in zip(work, fut.result(), strict=True):
            report.checked += 1
            report.bytes_checked += rec.bytes
            self.last_ts = max(self.last_ts, rec.ts)
            if problem:
                report.problems.append(problem)
                report.damaged[rec.idx] = problem
                report.saved_records[rec.idx] = rec
                report.saved_by[rec.idx] = shard
        self._show()

    def _show(self, force: bool = False) -> None:
        if self.opts.progress is None:
            return
        now = time.monotonic()
        if not force and now - self.shown < 1.0:
            return
        self.shown = now
        r = self.report
        self.opts.progress(
            Progress(r.checked, self.total, r.bytes_checked, now - self.t0, self.last_ts)
        )


def check_bytes(output: str, rec: ev.SampleSaved, quick: bool = False) -> str | None:
    """A committed sample's path, size and (unless ``quick``) checksum against its record:
    the bytes only, nothing unpickled (what ``verify`` does unless ``--deep``)."""
    path = os.path.join(output, rec.path)
    if rec.path != paths.sample_relpath(rec.idx):
        return f"sample {rec.idx}: journal path {rec.path} is not {paths.sample_relpath(rec.idx)}"
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return f"sample {rec.idx}: {rec.path} is missing"
    try:
        size = os.fstat(fd).st_size
        if size != rec.bytes:
            return f"sample {rec.idx}: {rec.path} has {size} bytes, journal says {rec.bytes}"
        if quick:
            return None
        checksum = fd_checksum(fd)
    finally:
        os.close(fd)
    if checksum != rec.checksum:
        return f"sample {rec.idx}: {rec.path} checksum {checksum}, journal says {rec.checksum}"
    return None


def _unknown_files(output: str, index: _Index) -> list[str]:
    """``--deep``: list the row folders (the only listing of the tree anywhere) for files
    the journal does not know: samples it does not count as saved, temp files an older
    version left beside them."""
    out: list[str] = []
    try:
        names = sorted(os.listdir(output))
    except FileNotFoundError:
        return out
    for d in names:
        if not d.startswith("rows_"):
            continue
        for name in sorted(os.listdir(os.path.join(output, d))):
            rel = f"{d}/{name}"
            if name.startswith(".") and paths.TMP_MARK in name:
                out.append(f"{rel}: a temp file left by a crash (safe to remove)")
                continue
            idx = _sample_id(name)
            if idx is None or paths.sample_relpath(idx) != rel:
                out.append(f"{rel}: not a sample file of eagle3d")
            elif not index.owner(idx):
                out.append(f"{rel}: sample {idx} is not saved in any journal")
    return out


def _sample_id(name: str) -> int | None:
    stem = name.removeprefix("data_").removesuffix(paths.SAMPLE_SUFFIX)
    if stem == name or not stem.isdigit():
        return None
    return int(stem)


def repair(report: VerifyReport) -> None:
    """Journal each damaged or missing sample of ``report`` as invalid in its shard's
    journal, its file (if any) moved aside. Fills ``report.repaired``; a shard whose daemon
    is running is left alone (``report.repair_error``)."""
    output = report.output
    by_shard: dict[Shard, list[int]] = {}
    for idx in sorted(report.damaged):  # in the journal that saved it (one, whatever N was)
        by_shard.setdefault(report.saved_by[idx], []).append(idx)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for shard, ids in by_shard.items():
        lock = ShardLock(paths.lock_path(output, shard))
        try:
            lock.acquire()
        except Fatal as e:
            report.repair_error = f"{shard.name}: {e}; stop it, then repair"
            continue
        try:
            writer = JournalWriter(
                paths.journal_dir(output, shard),
                shard_index=shard.index,
                shard_count=shard.count,
                background=False,
            )
            writer.open()
            try:
                for idx in ids:
                    rec = report.saved_records[idx]
                    kept = _move_aside(output, rec.path, stamp)
                    writer.append(
                        ev.SampleInvalid(
                            idx=idx, path=rec.path, reason=report.damaged[idx], kept=kept
                        )
                    )
                    where = f"moved to {kept}" if kept else "no file"
                    report.repaired.append(f"sample {idx}: {report.damaged[idx]} ({where})")
            finally:
                writer.close()
        finally:
            lock.release()


def _move_aside(output: str, relpath: str, stamp: str) -> str:
    """Move a damaged sample file to OUTPUT/.eagle3d/damaged/<relpath>.<stamp>; '' when
    there is no file. Never deletes: the bytes stay for whoever wants to look."""
    src = os.path.join(output, relpath)
    if not os.path.lexists(src):
        return ""
    dst = os.path.join(paths.state_dir(output), "damaged", f"{relpath}.{stamp}")
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    os.rename(src, dst)
    return os.path.relpath(dst, output)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "verify",
        help="check every committed sample against the journal",
        description="Check each sample the journal says is saved: present, size and checksum "
        "match (--deep: tensors load with the right shapes too). Exit 0 only if all is "
        "consistent (1: a problem was found, or repaired; 2: no journal under --output; 3: "
        "every sample failed, nothing was saved). "
        "--repair journals damaged or missing samples as invalid (files moved aside to "
        "OUTPUT/.eagle3d/damaged/, never deleted); the next `eagle3d run` redoes them.",
    )
    p.add_argument("--output", "-o", required=True, help="output directory of a job")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.add_argument("--quick", action="store_true", help="sizes only: skip checksums")
    p.add_argument(
        "--deep",
        action="store_true",
        help="also load every sample's tensors (keys, shapes, dtypes, fp8 scales), and list "
        "the row folders for files the journal does not know (the only listing of the tree)",
    )
    p.add_argument(
        "--since",
        type=_since,
        default=0.0,
        metavar="TIME",
        help="only samples saved at or after TIME (Unix seconds or ISO 8601, e.g. the "
        "'resume with --since' time an interrupted verify printed)",
    )
    p.add_argument(
        "--sample",
        type=_percent,
        default=100.0,
        metavar="N%",
        help="check N%% of the samples (the same ones each time): a quick spot check",
    )
    p.add_argument("--jobs", type=int, default=8, help="files checked in parallel")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a progress line on stderr (default: when stderr is a terminal)",
    )
    p.add_argument(
        "--repair",
        action="store_true",
        help="journal damaged or missing samples as invalid so that the next run redoes them",
    )
    p.add_argument(
        "--reference",
        type=int,
        default=0,
        metavar="N",
        help="also recompute N samples spread over the output with a plain Hugging Face"
        " forward and compare every tensor within the stored dtype's tolerance (exit 1 on a"
        " mismatch, which names the tensor, layer and tolerance)",
    )
    p.add_argument("--model", default="", help="the model for --reference (default: the job's)")
    p.set_defaults(func=cmd_verify)


def _since(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        from datetime import datetime

        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--since {text!r}: not Unix seconds nor an ISO 8601 time"
        ) from None


def _percent(text: str) -> float:
    try:
        v = float(text.removesuffix("%"))
    except ValueError:
        v = -1.0
    if not 0 < v <= 100:
        raise argparse.ArgumentTypeError(f"--sample {text!r}: a percentage in (0, 100]")
    return v


def progress_line(stream: Any) -> Callable[[Progress], None]:
    """Writes ``verify``'s progress to ``stream``: files, GB, MB/s, ETA, and the time to
    resume from with ``--since`` if it is stopped."""
    tty = stream.isatty()

    def show(p: Progress) -> None:
        rate = p.bytes / p.seconds if p.seconds > 0 else 0.0
        files_s = p.files / p.seconds if p.seconds > 0 else 0.0
        left = (p.total - p.files) / files_s if files_s > 0 and p.total > p.files else 0.0
        since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(p.last_ts)) if p.last_ts else "-"
        line = (
            f"verify: {p.files:,}/{p.total:,} files  {p.bytes / 1e9:.2f} GB  "
            f"{rate / 1e6:.0f} MB/s  {files_s:.0f} files/s  ETA {left:.0f} s  "
            f"(resume with --since {since})"
        )
        stream.write(("\r" + line + "\x1b[K") if tty else line + "\n")
        stream.flush()

    return show


def cmd_verify(args: argparse.Namespace) -> int:
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    opts = Options(
        quick=args.quick,
        deep=args.deep,
        jobs=args.jobs,
        since=args.since,
        sample=args.sample,
        progress=progress_line(sys.stderr) if show else None,
    )
    report = verify(args.output, options=opts)
    if show and sys.stderr.isatty():
        sys.stderr.write("\n")
    if args.repair and report.damaged:
        repair(report)
    ref = None
    if args.reference > 0 and report.shards:
        from eagle3d.tools import reference

        ref = reference.check_reference(args.output, args.reference, args.model)
    if args.json:
        doc = report.to_dict()
        if ref is not None:
            doc["reference"] = ref.to_dict()
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        print(report)
        if ref is not None:
            print(ref)
    if not report.shards:
        print(f"no eagle3d journal under {args.output}/{paths.STATE_DIR}", file=sys.stderr)
    if ref is not None and not ref.ok:
        return max(report.exit_code, 1)
    return report.exit_code


__all__ = ["VerifyReport", "check_sample", "register", "repair", "verify"]
