"""Validate a dump and commit it as a SpecForge-readable sample, atomically.

Commit order per sample: write ``.data_<idx>.ckpt.tmp-*`` in the shard's staging folder
(``.eagle3d/staging/shard-*``, on the output's filesystem) while
computing the content checksum (in ``torch.save``'s format by :mod:`eagle3d.store.archive`, with
direct I/O where the filesystem allows it, or by ``torch.save`` itself for samples of 4 GiB
and more), fdatasync it, rename it to ``rows_*/data_<idx>.ckpt``, fsync that directory. Only then
may the caller append ``sample_saved`` to the journal. A crash at any instant leaves the
sample either complete under its final name, or absent (a stray temp file is removed at the
next start, which lists the staging folder only: at most what was committing, never the
rows' folders). :meth:`Committer.commit_many` does this for a batch, with one directory sync
per row directory for all of it.

The states are written in the job's storage format (:mod:`eagle3d.remote.storedtype`): a dump that
arrives in another float dtype is cast on its way into the archive (in
:func:`eagle3d.store.splice.stage`, within the read it already does), and the NaN/Inf check runs
on what is stored, so a float16 overflow is caught too. The fp8 format quantizes the
states (:mod:`eagle3d.store.fp8`) in that same read, or here on the general path after the
checks, and writes their scales beside them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import itertools
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from eagle3proto import paths
from eagle3proto.paths import TMP_MARK, sample_relpath

from eagle3d.dumps.format import BadDump, Dump, read_dump
from eagle3d.remote import faults, samplefile, storedtype
from eagle3d.remote.storedtype import StoreFormat
from eagle3d.store import archive as ckpt
from eagle3d.store import fp8, splice
from eagle3d.store.directio import DirectBuffer, SplicePipe, flush_direct, write_spliced
from eagle3d.store.reference import ChecksumWriter, save
from eagle3d.store.rowdirs import RowDirs
from eagle3d.store.validate import validate

log = logging.getLogger("eagle3d")

# Larger samples are written buffered: a direct write's gathering buffer stays allocated per
# commit thread, and per-sample overheads matter less at that size.
DIRECT_MAX = 256 << 20
#: How sample files can be written (``--writer``).
WRITERS = ("archive", "torch")


#: The mode of a sample file: the owner's; the group may read (under the umask).
FILE_MODE = 0o640

# A temp file written and not yet synced: (descriptor, temp name, the row folder's
# descriptor, final name, relpath, size, checksum).
_Temp = tuple[int, str, int, str, str, int, str]


class CommitError(OSError):
    """Writing the output failed (the errno says why, e.g. ENOSPC)."""


@dataclass(frozen=True, slots=True)
class Committed:
    relpath: str
    nbytes: int
    checksum: str


class Committer:
    """Writes samples under ``output``; thread-safe (several commit threads share one).

    ``store`` is the storage format of the states (None: as dumped)."""

    def __init__(
        self,
        output: str,
        direct: bool = True,
        store: StoreFormat | None = None,
        writer: str = "archive",
        splice: bool = True,
        rows: RowDirs | None = None,
        staging: str = "",
        splice_pages: bool = True,
    ) -> None:
        """``staging``: the folder temp files are written in (default
        ``OUTPUT/.eagle3d/staging/shard-0-of-1``); ``writer``: ``archive`` (own writer, direct I/O, the ``splice`` fast path from dump
        files; ``splice=False`` for its A/B) or ``torch`` (``torch.save``, the reference);
        ``splice_pages``: move a v2 dump's pages into its direct write by ``splice`` (False:
        write from its mapping, cheaper where the dump area keeps 2 MiB pages)."""
        if writer not in WRITERS:
            raise ValueError(f"writer must be one of {', '.join(WRITERS)}, not {writer!r}")
        self.writer = writer
        self.splice = splice and writer == "archive"
        self.output = output
        os.makedirs(output, exist_ok=True)  # here, once: never again under a running job
        # Row folders by descriptor, never through a link (store.rowdirs).
        self.rows = rows if rows is not None else RowDirs(output)
        self.staging = staging or paths.staging_dir(output, paths.Shard())
        # 0750 as the row folders (makedirs gives only the last folder its mode).
        os.makedirs(os.path.dirname(self.staging), 0o750, exist_ok=True)
        os.makedirs(self.staging, 0o750, exist_ok=True)
        self.store = store
        # Samples are written with O_DIRECT where the filesystem allows it (see
        # write_direct); the first refusal switches to buffered writes for good.
        self.direct = direct
        # A v2 dump's unchanged pages are spliced into its direct write (see _spliced);
        # the first refusal writes from the mapping for good.
        self.splice_pages = splice_pages
        self._local = threading.local()
        self._lock = threading.Lock()
        self._n = itertools.count()
        self._torch_threads_set = False

    def warm_up(self) -> None:
        """Pay the fast path's lazy imports (numpy, the CRC, the archive's layout) at start,
        not inside the first commits. torch and safetensors load only when a dump needs
        the general path (another dtype than stored, a failed check, a torch.save writer):
        a second of CPU that a resume of the usual job no longer pays."""
        splice.warm_up(self.store)
        self._one_torch_thread()

    def _one_torch_thread(self) -> None:
        """Once torch is loaded (by whatever needed it first), give its work here one
        intra-op thread: the daemon's tensor work (casts, the general path's checks) is
        memory-bound, and OpenMP's spinning threads would take cores from a producer on the
        same host. Checked after each stage of a batch: a commit that loads torch runs at
        most that one sample with torch's default threads."""
        if not self._torch_threads_set and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(1)
            self._torch_threads_set = True

    def clean_temp_files(self) -> int:
        """Remove the temp files a crash left in the staging folder (the one folder listed:
        it holds at most what was committing)."""
        removed = 0
        for name in os.listdir(self.staging):
            if TMP_MARK in name and name.startswith("."):
                _unlink_quietly(os.path.join(self.staging, name))
                removed += 1
        return removed

    def _ensure_dir(self, rel_dir: str) -> int:
        """The row folder's descriptor (made relative to the output's: an output removed
        or moved under the run is never made again; ENOENT tells the daemon it is gone)."""
        return self.rows.open(rel_dir)

    def withdraw(self, relpaths: list[str]) -> None:
        """Remove committed files that the journal then refused to record (its disk full):
        no file stands in a row folder without its ``sample_saved`` record, and the space
        goes back to the journal. Their samples are sent again. Quiet: a file already gone,
        or a row folder that cannot be opened, leaves nothing to remove."""
        for rel in relpaths:
            rel_dir, name = os.path.split(rel)
            with contextlib.suppress(OSError):
                _unlink_quietly(name, self._ensure_dir(rel_dir))

    def forget_dirs(self) -> None:
        """Check the row directories again (one was removed under the run)."""
        self.rows.forget()

    def commit(
        self,
        idx: int,
        input_ids: list[int],
        loss_mask: list[int],
        dump: Dump,
    ) -> Committed:
        """Write sample ``idx`` atomically and durably. Raises CommitError on I/O failure."""
        (result,) = self.commit_many([(idx, input_ids, loss_mask, dump)])
        if isinstance(result, (CommitError, BadDump)):
            raise result
        return result

    def commit_many(
        self, samples: list[tuple[int, list[int], list[int], Dump]]
    ) -> list[Committed | CommitError | BadDump]:
        """Write several samples from loaded dumps, each atomically and durably; one result
        per sample, in order (a CommitError for each that failed, the others stand).

        The samples' temp files are all written, then each is fdatasync'ed, then all are
        renamed, then each row directory is fsync'ed once for all its renames: a batch
        costs one directory sync instead of one per sample. A sample is committed only once
        its directory sync returned; until then a crash may keep or lose it, and either is
        consistent (the journal has no record of it yet, so it is redone).
        """
        return self._commit(
            [s[0] for s in samples], [functools.partial(self._write_temp, *s) for s in samples]
        )

    def commit_files(
        self,
        samples: list[tuple[int, list[int], list[int], str]],
        hidden_size: int,
        layers: list[int],
    ) -> list[Committed | CommitError | BadDump]:
        """As :meth:`commit_many`, from dump files: each is first checked against what was
        sent (:func:`validate`); a dump that fails is not written, and its result is the
        BadDump (DumpVanished when the file is gone).

        Dumps of the usual kind go from the file straight into the archive
        (:mod:`eagle3d.store.splice`); the rest are loaded with safetensors first.
        """
        return self._commit(
            [s[0] for s in samples],
            [functools.partial(self._write_file, *s, hidden_size, layers) for s in samples],
        )

    def _commit(
        self, idxs: list[int], stages: list[Callable[[], _Temp]]
    ) -> list[Committed | CommitError | BadDump]:
        out: list[Committed | CommitError | BadDump | None] = [None] * len(idxs)
        written: list[tuple[int, *_Temp]] = []  # (k, *temp file)
        try:
            for k, stage in enumerate(stages):
                try:
                    written.append((k, *stage()))
                except (CommitError, BadDump) as e:
                    out[k] = e
                self._one_torch_thread()
        except BaseException:  # a bug: leave no descriptor or temp file behind
            for _, fd, tmp, *_rest in written:
                os.close(fd)
                _unlink_quietly(tmp)
            raise
        staged: list[tuple[int, str, int, str, str, int, str]] = []
        for k, fd, tmp, full_dir, name, rel, size, checksum in written:
            try:
                os.fdatasync(fd)
            except OSError as e:
                _unlink_quietly(tmp, full_dir)
                out[k] = _error(idxs[k], e)
                continue
            finally:
                os.close(fd)
            faults.kill_point("after_tmp_write")
            staged.append((k, tmp, full_dir, name, rel, size, checksum))
        by_dir: dict[int, list[int]] = {}
        for k, tmp, full_dir, name, rel, size, checksum in staged:
            try:
                os.rename(tmp, name, src_dir_fd=full_dir, dst_dir_fd=full_dir)
            except OSError as e:
                _unlink_quietly(tmp, full_dir)
                out[k] = _error(idxs[k], e)
                continue
            faults.kill_point("after_rename")
            by_dir.setdefault(full_dir, []).append(k)
            out[k] = Committed(rel, size, checksum)
        for full_dir, ks in by_dir.items():
            try:
                os.fsync(full_dir)
            except OSError as e:
                for k in ks:
                    out[k] = _error(idxs[k], e)
        return [r for r in out if r is not None]

    def _write_file(
        self,
        idx: int,
        input_ids: list[int],
        loss_mask: list[int],
        path: str,
        hidden_size: int,
        layers: list[int],
    ) -> _Temp:
        """Check the dump at ``path`` and write it as sample ``idx`` under a temp name (as
        :meth:`_write_temp`). Raises BadDump for a dump that fails the checks."""
        staged = None
        if self.splice:
            staged = splice.stage(
                path,
                input_ids,
                loss_mask,
                hidden_size,
                layers,
                self._buffer(),
                DIRECT_MAX,
                self.store,
                sparse=self.direct and self.splice_pages,
            )
        if staged is None:  # not the usual kind, or bad: the general path says why
            dump = self._stored(read_dump(path))
            validate(dump, input_ids, hidden_size, layers)
            return self._write_temp(idx, input_ids, loss_mask, dump)
        size = staged.written.nbytes

        def write(fd: int, direct: bool) -> tuple[int, str]:
            if not (direct and self._spliced(fd, staged, size)):
                staged.complete()  # a sparse view: its states read in, to write them
                self._flush(fd, staged.view, size, direct)
            return size, f"crc32:{staged.written.crc:08x}"

        try:
            return self._new_temp(idx, True, write)
        finally:
            staged.close()

    def _new_temp(
        self, idx: int, direct_ok: bool, write: Callable[[int, bool], tuple[int, str]]
    ) -> _Temp:
        """Create sample ``idx``'s temp file in its row directory (with direct I/O where
        allowed and ``direct_ok``) and fill it by ``write(fd, direct)``, which returns the
        size and checksum. The caller fdatasyncs and closes the descriptor. Raises
        CommitError on I/O failure, leaving no temp file."""
        rel = sample_relpath(idx)
        rel_dir, name = os.path.split(rel)
        try:
            full_dir = self._ensure_dir(rel_dir)
            # In the staging folder (absolute: the row folder's descriptor is the rename's).
            tmp = os.path.join(self.staging, f".{name}{TMP_MARK}{os.getpid()}-{next(self._n)}")
            direct = self.direct and direct_ok
            fd = self._open_temp(tmp, full_dir, direct)
            try:
                size, checksum = write(fd, direct and self.direct)
            except BaseException:
                os.close(fd)
                _unlink_quietly(tmp, full_dir)
                raise
        except OSError as e:
            raise _error(idx, e) from e
        return fd, tmp, full_dir, name, rel, size, checksum

    def _buffer(self) -> DirectBuffer:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = DirectBuffer()
        return buf

    def _spliced(self, fd: int, staged: splice.Staged, size: int) -> bool:
        """Write a mapped v2 dump to ``fd`` (direct I/O) by moving its unchanged pages with
        ``splice`` (:func:`write_spliced`): the mapping's pages are never faulted in,
        pinned or unmapped. False where that is refused (the caller writes from the
        mapping; the refusal is remembered and said once)."""
        if staged.source < 0 or not self.splice_pages:
            return False
        pipe = getattr(self._local, "pipe", None)
        try:
            if pipe is None:
                pipe = self._local.pipe = SplicePipe()
            splice.SEAM.add(
                "spliced", write_spliced(fd, staged.view, staged.source, staged.copied, size, pipe)
            )
        except OSError as e:
            if pipe is not None:  # it may hold bytes of this file
                pipe.close()
                self._local.pipe = None
            if e.errno != errno.EINVAL:
                raise
            self.splice_pages = False
            log.info("splice refused under %s (%s): writes from the mapping", self.output, e)
            return False
        return True

    def _flush(self, fd: int, view: memoryview, size: int, direct: bool) -> None:
        try:
            flush_direct(fd, view, size)
        except OSError as e:
            if e.errno != errno.EINVAL or not direct:
                raise
            self._no_direct(f"write: {e}")
            # The same file, buffered from the start.
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            os.ftruncate(fd, 0)
            flush_direct(fd, view, size)

    def _stored(self, dump: Dump) -> Dump:
        """The dump with its states in the storage format (the same object if they are).
        fp8 states stay as dumped: they are quantized from them when the archive is built
        (as the splice does), and a scaled format cannot overflow."""
        if dump.scales and (self.store is None or not self.store.scaled):
            # fp8 states dumped for another job's format: their values, in bfloat16 first
            for name in ("aux_hidden_state", "hidden_state"):
                scale = dump.scales.get(name + fp8.SCALE_SUFFIX)
                if scale is not None:
                    setattr(dump, name, fp8.dequantize(getattr(dump, name), scale))
            dump.scales = {}
        if self.store is None or self.store.scaled:
            return dump
        aux = dump.aux_hidden_state
        hid = dump.hidden_state
        if not (aux.is_floating_point() and hid.is_floating_point()):
            return dump  # validate() words it
        dump.aux_hidden_state = storedtype.cast(aux, self.store)
        dump.hidden_state = storedtype.cast(hid, self.store)
        return dump

    def _write_temp(
        self, idx: int, input_ids: list[int], loss_mask: list[int], dump: Dump
    ) -> _Temp:
        """Write sample ``idx`` from a loaded dump under a temp name (see :meth:`_new_temp`),
        its states in the storage format.

        Returns (descriptor, temp path, directory, final name, relpath, size, checksum)."""
        import torch

        dump = self._stored(dump)
        payload = {
            "input_ids": torch.tensor(input_ids, dtype=torch.int64),
            "loss_mask": torch.tensor(loss_mask, dtype=torch.int64),
            "hidden_state": dump.hidden_state.contiguous().unsqueeze(0),
            "aux_hidden_state": dump.aux_hidden_state.contiguous().unsqueeze(0),
        }
        if self.store is not None and self.store.scaled:
            if len(dump.scales) == 2:  # already in the stored format: as it is
                for name in fp8.STATES:
                    payload[name + fp8.SCALE_SUFFIX] = dump.scales[name + fp8.SCALE_SUFFIX][None]
            else:
                payload.update(fp8.quantized_states(payload))
        fits = self.writer == "archive" and samplefile.fits(payload)

        def write(fd: int, direct: bool) -> tuple[int, str]:
            if fits:
                written = self._write_archive(fd, payload, direct)
                return written.nbytes, f"crc32:{written.crc:08x}"
            # The reference writer, and 4 GiB and up: torch's own (zip64) writer
            w = ChecksumWriter(fd)
            save(torch, payload, w)
            return w.size, w.checksum

        return self._new_temp(idx, fits and _nbytes(payload) <= DIRECT_MAX, write)

    def _open_temp(self, tmp: str, dir_fd: int, direct: bool) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        if direct:
            try:
                return os.open(tmp, flags | os.O_DIRECT, FILE_MODE, dir_fd=dir_fd)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._no_direct(f"open: {e}")  # no direct I/O here (an older kernel's tmpfs)
        return os.open(tmp, flags, FILE_MODE, dir_fd=dir_fd)

    def _write_archive(self, fd: int, payload: dict[str, Any], direct: bool) -> samplefile.Written:
        if direct:
            try:
                return ckpt.write(fd, payload, direct=self._buffer())
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._no_direct(f"write: {e}")
                # The same file, buffered from the start.
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                os.ftruncate(fd, 0)
                os.lseek(fd, 0, os.SEEK_SET)
        return ckpt.write(fd, payload)

    def _no_direct(self, why: str) -> None:
        if self.direct:
            self.direct = False
            log.info("direct I/O refused under %s (%s): buffered writes", self.output, why)


def _nbytes(payload: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in payload.values())


def _error(idx: int, e: OSError) -> CommitError:
    return CommitError(e.errno or 5, f"commit of sample {idx} failed: {e.strerror or e}")


def _unlink_quietly(path: str, dir_fd: int | None = None) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path, dir_fd=dir_fd)
