"""``eagle3d verify``: check every committed sample against the journal.

For each ``sample saved`` record of every shard journal under ``OUTPUT/.eagle3d``: the file
exists, its size and checksum match the record, and it loads with the right keys, dtypes and
shapes (fp8 files: their scales too, positive and finite), its states in the storage dtype
of the session that saved it (``job.store_dtype``
of its ``run_started``; journals from before that field are not checked for it). The output
tree is never listed: the journal says what should exist.

``--repair`` journals each damaged or missing committed sample as ``sample_invalid`` in its
shard's journal (its file, if any, moved aside under ``OUTPUT/.eagle3d/damaged/``, never
deleted), so that the next ``eagle3d run`` with the same command extracts exactly those
again. It takes the shard's lock: a daemon running that shard must be stopped first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from eagle3proto import events as ev
from eagle3proto import layouts, paths
from eagle3proto.journal import JournalWriter
from eagle3proto.journalread import replay
from eagle3proto.paths import Shard

from eagle3d.exitcodes import Fatal
from eagle3d.remote import storedtype
from eagle3d.run.preflight import ShardLock
from eagle3d.store import fp8
from eagle3d.store.crc import file_checksum


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
    saved_records: dict[int, ev.SampleSaved] = field(default_factory=dict)
    saved_by: dict[int, Shard] = field(default_factory=dict)  # the journal that saved each
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
    """Folds one shard's journal into what verify needs."""

    def __init__(self, sr: ShardReport, problems: list[str]) -> None:
        self.sr = sr
        self.problems = problems
        self.saved: dict[int, ev.SampleSaved] = {}
        self.failed: set[int] = set()
        self.store = ""  # the storage dtype of the session being read
        self.stores: dict[int, str] = {}  # idx -> the storage dtype it was saved in

    def sink(self, batch: list[ev.AnyEvent]) -> None:
        for e in batch:
            if isinstance(e, ev.SampleSaved):
                if e.idx in self.saved:
                    self.problems.append(f"sample {e.idx}: saved twice in {self.sr.shard}")
                self.saved[e.idx] = e
                self.stores[e.idx] = self.store
                self.failed.discard(e.idx)
            elif isinstance(e, ev.SampleInvalid):  # repaired: no longer saved, redone
                self.saved.pop(e.idx, None)
            elif isinstance(e, ev.SampleFailed):  # the latest record of a sample wins
                if e.retry:
                    self.failed.discard(e.idx)
                else:
                    self.failed.add(e.idx)
            elif isinstance(e, ev.RunStarted):
                self.sr.total = e.total
                self.sr.finished = False
                self.sr.started_ts = e.ts
                self.store = e.job.store_dtype
            elif isinstance(e, ev.RunFinished):
                self.sr.finished = True


def verify(output: str, *, quick: bool = False, jobs: int = 4) -> VerifyReport:
    """Verify an output directory (all shards)."""
    report = VerifyReport(os.path.abspath(output))
    saved: dict[int, ev.SampleSaved] = {}
    stores: dict[int, str] = {}
    shards: list[tuple[Shard, ShardReport]] = []
    for shard, jdir in paths.shard_dirs(output):
        sr = ShardReport(shard.name)
        shards.append((shard, sr))
        fold = _ShardFold(sr, report.problems)
        rep = replay(jdir, fold.sink)
        sr.journal_problems = [p.describe() for p in rep.problems]
        sr.journal_fatal = rep.stopped_early
        if rep.stopped_early:
            report.problems.extend(f"{shard.name} journal: {p}" for p in sr.journal_problems)
        shard_saved, failed = fold.saved, fold.failed
        for idx in shard_saved:
            if not shard.owns(idx):
                report.problems.append(
                    f"sample {idx}: saved by {shard.name}, which does not own it"
                )
            if idx in saved:
                report.problems.append(f"sample {idx}: saved by more than one shard")
        saved.update(shard_saved)
        report.saved_by.update(dict.fromkeys(shard_saved, shard))
        stores.update(fold.stores)
        sr.store_dtype = ", ".join(sorted({fold.stores[i] for i in shard_saved} - {""}))
        sr.saved = len(shard_saved)
        sr.failed = len(failed - set(shard_saved))
        report.shards.append(sr)
    current = layouts.current_count((s.count, r.started_ts) for s, r in shards)
    for s, r in shards:
        if s.count != current and current:
            r.closed_by = current
    records = sorted(saved.values(), key=lambda r: r.idx)
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for rec, problem in zip(
            records,
            pool.map(lambda r: check_sample(output, r, quick, stores[r.idx]), records),
            strict=True,
        ):
            report.checked += 1
            report.bytes_checked += rec.bytes
            if problem:
                report.problems.append(problem)
                report.damaged[rec.idx] = problem
    report.saved_records = saved
    return report


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
        "match, tensors load with the right shapes. Exit 0 only if all is consistent "
        "(1: a problem was found, or repaired; 2: no journal under --output; 3: every sample "
        "failed, nothing was saved). "
        "--repair journals damaged or missing samples as invalid (files moved aside to "
        "OUTPUT/.eagle3d/damaged/, never deleted); the next `eagle3d run` redoes them.",
    )
    p.add_argument("--output", "-o", required=True, help="output directory of a job")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.add_argument("--quick", action="store_true", help="sizes only: skip checksums and loads")
    p.add_argument("--jobs", type=int, default=4, help="files checked in parallel")
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


def cmd_verify(args: argparse.Namespace) -> int:
    report = verify(args.output, quick=args.quick, jobs=args.jobs)
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
