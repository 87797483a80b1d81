"""``eagle3d export --output OUT --to DIR --format specforge|speculators|modelopt``.

Writes every committed sample of ``OUT`` (as its journals list them, :mod:`eagle3d.store.catalog`;
never a directory listing) into ``DIR`` in a trainer's own format (:mod:`eagle3d.tools.exporters`),
exactly once, resumable after a kill at any instant. Its memory is a few numbers a sample,
in arrays by sample id: the journals are read twice (:func:`eagle3d.store.catalog.scan`:
which record of each sample counts, then those records, exported as they come, in journal
order), and the manifest below is kept as each sample's row and source checksum.

``DIR/.eagle3d-export/`` holds the export's own state:

* ``export.json`` - what is exported (format, source output, job fingerprint), written
  atomically before the first sample; a later export into ``DIR`` of another format or
  source is refused;
* ``done.e3x`` - one record per exported sample, framed and checksummed as the journal's
  records are (``eagle3proto.codec``): sample id, its row, file name, size, checksum, and
  the source file's checksum. A record is appended and fdatasync'ed only after its file is
  complete: written under a temp name, fdatasync'ed, renamed, its directory fsync'ed. A torn
  last record (a kill mid-append) is cut off at the next start;
* ``lock`` - held for the whole export (one exporter per directory).

So after a kill a sample's file is either complete and recorded, or complete and not
recorded, or absent: the next export redoes exactly the unrecorded ones (rewriting the
same name), and a sample is never exported twice. A committed sample whose source file no
longer matches the journal (size or checksum) is not exported and is named (exit 1: run
``eagle3d verify --repair``, then the job, then export again). A sample re-extracted since
its export (``verify --repair``, then a resumed run) has a new checksum and is exported
again over its old file. An output still being extracted exports what is committed so far;
running the export again later adds the rest. The format's index files (speculators'
``datasets`` directory and token counts) are rewritten atomically at the end of every run
from the manifest, so they always describe exactly the exported files.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import os
import sys
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import msgspec
from eagle3proto import codec
from eagle3proto.fileops import OsFileOps

from eagle3d.remote import faults
from eagle3d.store import catalog
from eagle3d.store.crc import fd_checksum
from eagle3d.tools import exporters

_FS = OsFileOps()  # the directory fsync, as the journal does it

STATE = ".eagle3d-export"
BATCH = 8  # samples per directory sync and manifest sync


class Done(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One exported sample (a manifest record)."""

    idx: int
    k: int
    name: str
    size: int
    checksum: str
    source: str  # the source file's checksum, from the journal
    ids: bytes = b""  # int64 input ids (formats with an index: speculators)
    mask: bytes = b""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Done).decode


@dataclass(slots=True)
class ExportReport:
    """What an export did; :attr:`exit_code` is the documented exit status."""

    output: str
    to: str
    format: str
    committed: int = 0
    exported: int = 0  # by this run
    already: int = 0  # by earlier runs, unchanged since
    linked: int = 0  # of ``exported``: hard links to the job's own files (same bytes)
    bytes_written: int = 0
    tokens: int = 0  # of ``exported``
    seconds: float = 0.0  # this run's, from the first sample to the index files
    problems: list[str] = field(default_factory=list)
    #: the samples not exported, by reason (``missing``, ``damaged``, ``journal``)
    not_exported: dict[str, int] = field(default_factory=dict)
    refused: str = ""  # why nothing was done (usage): exit 2
    finished_source: bool = False

    @property
    def exit_code(self) -> int:
        """0: every committed sample is exported; 1: some could not be (damaged source
        files, named in ``problems``); 2: refused (no journal under ``--output``, ``--to``
        holds another export, another export is running there, the model is missing)."""
        if self.refused:
            return 2
        return 1 if self.problems else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "to": self.to,
            "format": self.format,
            "committed": self.committed,
            "exported": self.exported,
            "already": self.already,
            "linked": self.linked,
            "copied": self.exported - self.linked,
            "bytes": self.bytes_written,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "not_exported": self.not_exported,
            "source_finished": self.finished_source,
            "problems": self.problems,
            "refused": self.refused,
            "exit_code": self.exit_code,
        }

    def __str__(self) -> str:
        if self.refused:
            return f"eagle3d export: {self.refused}\nREFUSED"
        lines = [
            f"eagle3d export {self.output} -> {self.to} ({self.format})",
            f"  {self.committed} committed sample(s): {self.exported} exported now, "
            f"{self.already} by an earlier run; {self.bytes_written / 1e9:.2f} GB written"
            + (f" ({self.linked} hard-linked: the job's own bytes)" if self.linked else ""),
        ]
        if not self.finished_source:
            lines.append("  the job is not finished: export again once it is, for the rest")
        lines.extend(f"  not exported: {p}" for p in self.problems[:50])
        lines.append(self.summary())
        lines.append("OK" if not self.problems else f"{len(self.problems)} NOT EXPORTED")
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: time taken, samples, tokens, bytes, linked vs copied, what was not
        exported by reason."""
        rate = self.exported / self.seconds if self.seconds > 0 else 0.0
        said = (
            f"summary: {self.exported:,} sample(s) exported in {self.seconds:.1f} s"
            f" ({rate:,.1f} samples/s): {self.tokens:,} tokens, {_size(self.bytes_written)}"
            f" written ({self.linked:,} hard-linked, {self.exported - self.linked:,} copied)"
            f"; {self.already:,} already exported"
        )
        if self.not_exported:
            why = ", ".join(f"{k} {n:,}" for k, n in sorted(self.not_exported.items()))
            said += f"; {sum(self.not_exported.values()):,} not exported ({why})"
        return said


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


#: Bytes of ``done.e3x`` read at a time: with speculators' ids and masks (16 bytes a token)
#: it grows to gigabytes at a million samples, and is never read whole.
WINDOW = 1 << 20


class Manifest:
    """``done.e3x``: the exported samples, latest record per sample wins. In memory, in
    arrays: for the samples the file held when opened, each sample id's row ``k`` (-1: not
    exported) and its source's :func:`~eagle3d.store.catalog.checksum_key` (8 bytes a
    sample: :meth:`row` and :meth:`unchanged` answer as of the open), and for every row,
    where its latest record lies in the file (4 bytes; 8 once the file passes 4 GiB:
    :meth:`record` and :meth:`rows` read records back from there)."""

    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, "done.e3x")
        self.ks = array("i")  # sample id -> its row k (-1: none)
        self.sources = array("I")  # sample id -> checksum key of the source it was made from
        self.at = array("I")  # row k -> 1 + offset of its latest record's frame (0: none)
        end = 0
        with contextlib.suppress(FileNotFoundError), open(self.path, "rb", buffering=0) as f:
            end = self._load(f)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if end != os.fstat(self.fd).st_size:  # a torn or damaged tail: cut it, it recorded nothing
            os.ftruncate(self.fd, end)
            os.fsync(self.fd)
        self.end = os.lseek(self.fd, end, os.SEEK_SET)

    def _load(self, f: Any) -> int:
        """Read the records a :data:`WINDOW` at a time; the end of the last valid one."""
        pos, buf = 0, b""
        while True:
            more = f.read(WINDOW)
            buf += more
            scan = codec.scan(buf)
            at = pos
            for payload in scan.payloads:
                self._keep(_decode(payload), at)
                at += len(payload) + codec.FRAME_OVERHEAD
            pos, buf = pos + scan.end, buf[scan.end :]
            if not more or scan.stop not in (
                codec.Stop.CLEAN,
                codec.Stop.SHORT,
                codec.Stop.PAST_END,
            ):
                return pos

    def _keep(self, rec: Done, offset: int) -> None:
        """A record read at the open: by sample id and by row."""
        n = rec.idx + 1 - len(self.ks)
        if n > 0:
            n = max(n, len(self.ks) >> 3)  # amortized: an eighth more at a time
            self.ks.frombytes(b"\xff" * (4 * n))
            self.sources.frombytes(bytes(4 * n))
        self.ks[rec.idx] = rec.k
        self.sources[rec.idx] = catalog.checksum_key(rec.source)
        self._place(rec, offset)

    def _place(self, rec: Done, offset: int) -> None:
        """Where row ``rec.k``'s latest record lies."""
        if rec.k >= len(self.at):
            self.at.frombytes(bytes(self.at.itemsize * (rec.k + 1 - len(self.at))))
        if offset >= 0xFFFFFFFF and self.at.typecode == "I":
            self.at = array("q", self.at)  # past 4 GiB (speculators' rows): 8 bytes a row
        self.at[rec.k] = offset + 1

    def row(self, idx: int) -> int:
        """Sample ``idx``'s row (-1: not exported)."""
        return self.ks[idx] if idx < len(self.ks) else -1

    def unchanged(self, idx: int, key: int) -> bool:
        """Is sample ``idx`` exported from the source whose checksum key is ``key``?"""
        return self.row(idx) >= 0 and self.sources[idx] == key

    @property
    def next_row(self) -> int:
        """The row a sample exported for the first time gets."""
        return len(self.at)

    def record(self, k: int) -> Done:
        """Row ``k``'s latest record, read back from the file."""
        with open(self.path, "rb") as f:
            return self._read(f, self.at[k] - 1)

    @staticmethod
    def _read(f: IO[bytes], offset: int) -> Done:
        f.seek(offset)
        head = f.read(codec.FRAME_OVERHEAD)
        return _decode(f.read(int.from_bytes(head[4:8], "little")))

    def append(self, records: list[Done]) -> None:
        frames = [codec.encode_frame(_encode(r)) for r in records]
        data = b"".join(frames)
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        faults.kill_point("export_before_sync")
        os.fdatasync(self.fd)
        # Only their places: a run meets each sample once (the commit index names one
        # record a sample), so what it appends is never looked up by sample id again in
        # this run; the next run's open reads them whole. 8 bytes a sample less at 10^6.
        for r, frame in zip(records, frames, strict=True):
            self._place(r, self.end)
            self.end += len(frame)

    def rows(self) -> Iterator[exporters.Row]:
        """Every row's ids and mask in row order, read back from the file one record at a
        time (rows ``0..n-1``; a missing one raises ValueError)."""
        with open(self.path, "rb") as f:
            for k, at in enumerate(self.at):
                if not at:
                    raise ValueError(f"the manifest has no row {k}")
                rec = self._read(f, at - 1)
                yield exporters.Row(k, rec.ids, rec.mask)

    def close(self) -> None:
        os.close(self.fd)


class _IndexFiles:
    """A format's index files, each written under a temp name, synced, renamed into place
    and its directory synced when closed (:class:`exporters.IndexFiles`)."""

    def __init__(self, dest: str) -> None:
        self.dest = dest

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        path = os.path.join(self.dest, name)
        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fdatasync(f.fileno())
        os.rename(tmp, path)
        _FS.fsync_dir(os.path.dirname(path))


def export(
    output: str,
    to: str,
    fmt: str,
    model: str = "",
    progress: Callable[[ExportReport, int, float], None] | None = None,
) -> ExportReport:
    """Export ``output`` into ``to`` in format ``fmt`` (see the module's docstring).
    ``model``: the target model directory (speculators' final norm), default the job's;
    ``progress`` is called before each batch of samples and once at the end with the report,
    the samples to export and the seconds so far (:class:`Progress` decides what to show)."""
    out, dest = os.path.abspath(output), os.path.abspath(to)
    report = ExportReport(out, dest, fmt)
    try:
        cat = catalog.scan(out)
    except catalog.NoJournal as e:
        report.refused = str(e)
        return report
    job = cat.job
    report.finished_source = cat.finished
    report.problems.extend(f"journal: {p}" for p in cat.problems if cat.shards)
    try:
        recipe = (job.recipe if job is not None else "") or "eagle3"
        exp = exporters.make(fmt, model or (job.model if job is not None else ""), recipe)
    except (OSError, KeyError, ValueError) as e:
        report.refused = f"{fmt}: {e} (give the target model with --model)"
        return report
    state = os.path.join(dest, STATE)
    os.makedirs(state, exist_ok=True)
    # 0600 and opened read-write: a lock another user could open could be held by them.
    lock = os.open(os.path.join(state, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    os.fchmod(lock, 0o600)  # one an older version made 0644
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            report.refused = f"another eagle3d export is writing into {dest}"
            return report
        why = _claim(state, out, fmt, job)
        if why:
            report.refused = why
            return report
        manifest = Manifest(state)
        try:
            _run(cat, exp, dest, manifest, report, progress)
        finally:
            manifest.close()
    finally:
        os.close(lock)
    return report


def _claim(state: str, out: str, fmt: str, job: Any) -> str:
    """Write ``export.json`` (or check the one there); '' when this export may go on."""
    path = os.path.join(state, "export.json")
    want = {"format": fmt, "source": out, "version": 1}
    try:
        with open(path, encoding="utf-8") as f:
            have = json.load(f)
    except FileNotFoundError:
        meta = {**want, "fingerprint": job.fingerprint if job else "", "started": time.time()}
        _write_atomic(path, json.dumps(meta, indent=2).encode())
        return ""
    if (have.get("format"), have.get("source")) != (fmt, out):
        return (
            f"{os.path.dirname(state)} holds a {have.get('format')} export of "
            f"{have.get('source')}; export {out} as {fmt} into another --to"
        )
    return ""


def _count(cat: catalog.Streamed, manifest: Manifest, report: ExportReport) -> int:
    """Count the committed samples into ``report``; how many of them have no row yet (those
    re-extracted since their export are found and added as the export meets them)."""
    report.committed = cat.index.committed()
    owners, ks = cat.index.owners, manifest.ks
    rowed = sum(1 for i in range(min(len(owners), len(ks))) if owners[i] and ks[i] >= 0)
    return report.committed - rowed


def _run(
    cat: catalog.Streamed,
    exp: exporters.Exporter,
    dest: str,
    manifest: Manifest,
    report: ExportReport,
    progress: Callable[[ExportReport, int, float], None] | None = None,
) -> None:
    run = _Batches(cat, exp, dest, manifest, report, progress)
    run.todo = _count(cat, manifest, report)
    seen = cat.each(run.take)
    run.flush()
    if seen < report.committed:  # the journal changed under the export (it was read twice)
        report.not_exported["journal"] = report.committed - seen
        report.problems.append(
            f"{report.committed - seen} committed sample(s) no longer in the journal as "
            "first read: export again"
        )
    exp.finish(_IndexFiles(dest), manifest.rows())
    report.seconds = time.monotonic() - run.t0
    if progress is not None:
        progress(report, run.todo, report.seconds)


class _Batches:
    """The samples to export, :data:`BATCH` at a time: each batch's files written under temp
    names, renamed, their directories synced, then their records appended to the manifest."""

    def __init__(
        self,
        cat: catalog.Streamed,
        exp: exporters.Exporter,
        dest: str,
        manifest: Manifest,
        report: ExportReport,
        progress: Callable[[ExportReport, int, float], None] | None,
    ) -> None:
        self.cat, self.exp, self.dest = cat, exp, dest
        self.manifest, self.report, self.progress = manifest, report, progress
        self.todo = 0
        self.next_k = manifest.next_row
        self.pending: list[catalog.Entry] = []
        self.link = exp.same_bytes(cat.job)
        self.slow = faults.armed("export_slow")
        self.t0 = time.monotonic()

    def take(self, e: catalog.Entry) -> None:
        """One committed sample: exported with its batch unless exported as it is."""
        if self.manifest.unchanged(e.idx, catalog.checksum_key(e.checksum)):
            self.report.already += 1
            return
        if self.manifest.row(e.idx) >= 0:
            self.todo += 1  # re-extracted since its export (verify --repair): again
        self.pending.append(e)
        if len(self.pending) >= BATCH:
            self.flush()

    def flush(self) -> None:
        """Export the pending batch."""
        if not self.pending:
            return
        if self.progress is not None:
            self.progress(self.report, self.todo, time.monotonic() - self.t0)
        staged: list[tuple[str, str, Done]] = []  # (temp, final, record)
        for e in self.pending:
            if self.slow is not None:
                time.sleep(self.slow.n / 1000)
            one = self._stage(e)
            if one is not None:
                staged.append(one)
        self.pending = []
        for tmp, final, _ in staged:
            os.rename(tmp, final)
            faults.kill_point("export_after_rename")
        for d in sorted({os.path.dirname(final) for _, final, _ in staged}):
            _FS.fsync_dir(d)
        if staged:
            self.manifest.append([rec for *_, rec in staged])
            self.report.exported += len(staged)
            self.report.bytes_written += sum(rec.size for *_, rec in staged)

    def _stage(self, e: catalog.Entry) -> tuple[str, str, Done] | None:
        """Sample ``e`` written (or linked) under its temp name; None if its source is
        missing or damaged (counted in the report)."""
        report, manifest = self.report, self.manifest
        src = self.cat.path(e)
        problem = _check_source(src, e)
        if problem:
            report.problems.append(problem)
            reason = "missing" if problem.endswith(" is missing") else "damaged"
            report.not_exported[reason] = report.not_exported.get(reason, 0) + 1
            return None
        report.tokens += e.tokens
        k = manifest.row(e.idx)
        # Where it went before, if it did: an export keeps the layout it began with.
        if k >= 0:
            name = manifest.record(k).name
        else:
            k, self.next_k = self.next_k, self.next_k + 1
            name = self.exp.target(e.idx, k)
        final = os.path.join(self.dest, name)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.tmp")
        if self.link and _link(src, tmp):
            # The bytes as they are: the source's own inode, already durable.
            rec = Done(
                idx=e.idx, k=k, name=name, size=e.bytes, checksum=e.checksum, source=e.checksum
            )
            report.linked += 1
        else:
            self.link = False  # another filesystem (or links refused): copies from here on
            rec = _write(self.exp, src, tmp, e, k, name)
        return tmp, final, rec


def _write(
    exp: exporters.Exporter, src: str, tmp: str, e: catalog.Entry, k: int, name: str
) -> Done:
    """Write sample ``e`` (the committed file ``src``) in the format at ``tmp``, synced."""
    from eagle3d.store.reader import load_sample

    sample = load_sample(src)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        size, checksum = exp.write(fd, sample, e.idx)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    rec = Done(idx=e.idx, k=k, name=name, size=size, checksum=checksum, source=e.checksum)
    if exp.keeps_rows:
        r = exporters.row(k, sample)
        rec.ids, rec.mask = r.input_ids, r.loss_mask
    return rec


def _link(src: str, tmp: str) -> bool:
    """Hard-link ``src`` at ``tmp`` (whatever was there replaced); False where the
    filesystem will not (another device, no links)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    try:
        os.link(src, tmp)
    except OSError as e:
        if e.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            return False
        raise
    return True


def _check_source(path: str, e: catalog.Entry) -> str:
    """'' when the committed file is what the journal recorded, else the problem."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return f"sample {e.idx}: {e.path} is missing"
    try:
        size = os.fstat(fd).st_size
        checksum = fd_checksum(fd) if size == e.bytes else ""
    finally:
        os.close(fd)
    if (size, checksum) != (e.bytes, e.checksum):
        return f"sample {e.idx}: {e.path} does not match the journal (eagle3d verify says more)"
    return ""


def _write_atomic(path: str, data: bytes) -> None:
    """``data`` under ``path``: a temp file beside it, fdatasync, rename, directory fsync."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fdatasync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    _FS.fsync_dir(os.path.dirname(path))


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "export",
        help="write the committed samples in another trainer's format",
        description="Write every committed sample of --output (as the journal lists them) "
        "into --to in the format a trainer reads: specforge (bfloat16 .ckpt files, e.g. of "
        "an fp8 output), speculators (a datasets directory and hidden_states/hs_<k>."
        "safetensors), modelopt (<idx>.pt). Exactly once; rerun the same command to resume "
        "after a kill, or to add what a job committed since. Exit 0: all exported; 1: some "
        "committed files do not match the journal (named); 2: refused.",
    )
    p.add_argument("--output", "-o", required=True, help="output directory of a job")
    p.add_argument("--to", required=True, help="directory to export into")
    p.add_argument("--format", required=True, choices=exporters.FORMATS)
    p.add_argument(
        "--model", default="", help="target model directory (default: the job's; speculators)"
    )
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress on stderr (default on): a live line on a terminal, else a plain line"
        " every 2 s; --no-progress for none",
    )
    p.set_defaults(func=cmd_export)


class Progress:
    """The export's progress on stderr: on a terminal one live line rewritten in place
    (``\\r``) each second, else a plain line every :attr:`every` seconds; the first and the
    last always."""

    def __init__(self, tty: bool) -> None:
        self.tty = tty
        self.every = 1.0 if tty else 2.0
        self.shown = -1.0e9
        self.live = False  # a live line is on the screen, not yet ended

    def __call__(self, report: ExportReport, todo: int, seconds: float) -> None:
        n = report.exported + sum(report.not_exported.values())
        if seconds - self.shown < self.every and 0 < n < todo:
            return
        if n == todo and self.shown >= 0 and not self.tty and seconds - self.shown < 0.5:
            return  # the last line just said the same
        self.shown = seconds
        rate = n / seconds if seconds > 0 else 0.0
        eta = f"ETA {(todo - n) / rate:.0f} s" if rate > 0 and n < todo else "ETA —"
        if n == todo:
            eta = f"done in {seconds:.1f} s"
        line = (
            f"export: {n:,}/{todo:,} samples ({100 * n / max(todo, 1):.0f} %), "
            f"{_size(report.bytes_written)}, {rate:,.1f} samples/s, {eta}"
        )
        if self.tty:
            sys.stderr.write("\r" + line + "\x1b[K")
            self.live = True
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def end(self) -> None:
        """End the live line, so that what follows starts on a line of its own."""
        if self.live:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self.live = False


def cmd_export(args: argparse.Namespace) -> int:
    show = args.progress if args.progress is not None else True
    progress = Progress(sys.stderr.isatty()) if show else None
    try:
        report = export(args.output, args.to, args.format, args.model, progress)
    finally:
        if progress is not None:
            progress.end()
    if args.json:
        sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n")
        if not report.refused:
            sys.stderr.write(report.summary() + "\n")
    else:
        print(report)
    return report.exit_code


__all__ = ["ExportReport", "export", "register"]
