"""Move a dump's tensors into their sample archive without unpacking them.

The general commit path loads a dump with safetensors into fresh tensors, checks them,
builds an archive around them (:mod:`eagle3d.remote.samplefile`) and gathers it into the
commit thread's direct-I/O buffer: three copies of the data, a dozen tensor objects and their page faults
per sample. Here the dump's header is read, the archive's layout (:func:`ckpt.plan`, cached
per shape) is laid out in that buffer, and each tensor's bytes are read (``preadv``) straight
into their slot, where they are checked and from where they are written. The checks are
:func:`eagle3d.store.validate.validate`'s and the file is byte for byte the general path's (but for
its random serialization id).

On a CPU producer the daemon's commits run beside the forward on the same cores, so what
they cost is taken from the forward (docs/benchmarks.md).

A dump in another float dtype than the job's storage format (:mod:`eagle3d.remote.storedtype`) is
cast within that read: its bytes come in cache-sized chunks into a small reused buffer and
are cast from there into their slot, so the data still crosses memory once. The NaN/Inf
check runs on the slot, on what is stored.

For the fp8 format (``store.scaled``) the rows are quantized within that read instead
(:func:`eagle3d.store.fp8.quantize_rows_into`: chunks of whole rows, values into their slot, one
scale per row into the scale tensor's slot), and the finite check runs on the scales: a
NaN or an Inf anywhere in a row makes its scale NaN or infinite.

A v2 dump (:mod:`eagle3d.remote.dumpfile`) is the sample file already, but for its loss
mask: all of it but its large states is read into the commit thread's buffer (a few KiB),
its ids checked, the mask and the CRC fields put there, and the file is written from the
buffer with the states' blocks spliced from the dump between (:func:`_stage_mapped`); its
states never pass through this CPU. Where the caller writes from memory instead (2 MiB
pages in the dump area, no direct I/O), the dump is mapped privately and those few pages
copied on write. One in another dtype than stored is read as a v1 dump is (its trailer
gives the same byte ranges).

Anything unusual (another dtype, a garbled header, a failed check) makes :func:`stage`
return None: the caller then takes the general path, which reads the dump with safetensors
and words the error. The fast path never has to describe a bad dump.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import math
import mmap
import os
import struct
import threading
from array import array
from dataclasses import dataclass
from typing import Any

from eagle3d.dumps.format import (
    BadDump,
    Trailer,
    is_sample_dump,
    open_dump,
    read_header,
    read_trailer,
)
from eagle3d.remote import samplefile as ckpt
from eagle3d.remote.dumpfile import FORMAT
from eagle3d.remote.samplefile import fp8_spec, states_spec
from eagle3d.remote.storedtype import SCALE_SUFFIX, StoreFormat
from eagle3d.store import fp8
from eagle3d.store.crc import crc32
from eagle3d.store.directio import BLOCK, DirectBuffer

# safetensors dtype -> torch dtype name, for the states (the ids are I64).
_STATES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_CODES = {name: code for code, name in _STATES.items()}
_NAMES = {"input_ids", "aux_hidden_state", "hidden_state"}
_SCALED_NAMES = _NAMES | {"aux_hidden_state" + SCALE_SUFFIX, "hidden_state" + SCALE_SUFFIX}


class Seam:
    """What the fast path did to each state tensor (two per dump) of the dumps it staged,
    by kind: ``as_is`` (already in the stored format: bytes moved, nothing converted),
    ``cast`` (cast to the stored dtype), ``quantized`` (quantized to fp8 here). Counted so
    that a test (and a benchmark) can tell that a dump in the stored format is never
    converted twice; thread-safe.

    Each thread counts in a dict of its own (no lock taken per dump: the commit threads
    would contend for it on every file); :meth:`snapshot` adds them up."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the list of the threads' dicts
        self._mine = threading.local()
        self._all: list[dict[str, int]] = []

    def add(self, kind: str, n: int = 1) -> None:
        counts: dict[str, int] | None = getattr(self._mine, "counts", None)
        if counts is None:
            counts = self._mine.counts = {}
            with self._lock:
                self._all.append(counts)
        counts[kind] = counts.get(kind, 0) + n

    def snapshot(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with self._lock:
            threads = list(self._all)
        for counts in threads:
            for kind, n in list(counts.items()):
                out[kind] = out.get(kind, 0) + n
        return out


SEAM = Seam()


@dataclass(frozen=True, slots=True)
class Staged:
    """A sample archive complete in a buffer: write ``view[:written.nbytes]``, then
    :meth:`close`."""

    view: memoryview
    written: ckpt.Written
    #: The private mapping of a v2 dump the view lies in (None: the commit thread's buffer).
    mapping: mmap.mmap | None = None
    #: The v2 dump's descriptor (-1: none): the file is ``copied`` from the view and the
    #: rest spliced from here (:func:`eagle3d.store.directio.write_spliced`).
    source: int = -1
    #: The block-aligned ranges of the view that differ from the dump (its headers, mask).
    copied: tuple[tuple[int, int], ...] = ()
    #: The ranges of the view never read from ``source`` (its large states): a view in the
    #: commit thread's buffer that a splice fills from the dump, or :meth:`complete` reads.
    holes: tuple[tuple[int, int], ...] = ()

    def complete(self) -> None:
        """Read the :attr:`holes` from the dump, so that the view holds the whole file
        (where it is written from the view instead of spliced)."""
        for begin, end in self.holes:
            part = self.view[begin:end]
            if os.preadv(self.source, [part], begin) != len(part):
                raise OSError(errno.EIO, f"the dump ends before {end}")

    def close(self) -> None:
        """Unmap a v2 dump's mapping (at once, not when the last view is collected) and
        close its descriptor."""
        if self.source >= 0:
            os.close(self.source)
        if self.mapping is not None:
            self.view.release()
            with contextlib.suppress(BufferError):  # a view still held: unmapped when freed
                self.mapping.close()


def stage(
    path: str,
    sent_ids: list[int],
    loss_mask: list[int],
    hidden_size: int,
    layers: list[int],
    buf: DirectBuffer,
    limit: int,
    store: StoreFormat | None = None,
    sparse: bool = False,
) -> Staged | None:
    """Build the sample archive of the dump at ``path`` in ``buf``, checked against what
    was sent, its states in ``store`` (None: as dumped); None when the dump needs the
    general path (see the module's docstring), or when the archive would exceed ``limit``
    bytes. Raises DumpVanished if the file is gone.

    ``sparse``: a v2 dump's archive is laid out in ``buf`` but for its large states, which
    the caller splices from :attr:`Staged.source` (or reads by :meth:`Staged.complete`),
    instead of a private mapping of the dump.
    """
    fd = open_dump(path)
    handed = False  # the descriptor went with a Staged (its close() closes it)
    try:
        if is_sample_dump(fd):
            tr = read_trailer(fd)
            where = buf if sparse else None
            staged = _stage_mapped(
                fd, tr, sent_ids, loss_mask, hidden_size, layers, limit, store, where
            )
            if staged is not None:
                handed = staged.source == fd
                return staged
            h = tr.header()  # another dtype than stored (or a failed check): read as v1's
        else:
            h = read_header(fd)
        if h.meta.get("format") != FORMAT:
            return None
        if set(h.tensors) == _SCALED_NAMES and store is not None and store.scaled:
            return _stage_as_is(fd, h, sent_ids, loss_mask, hidden_size, len(layers), buf, limit)
        if set(h.tensors) != _NAMES:
            return None
        if h.meta.get("layers") and h.meta["layers"] != ",".join(map(str, layers)):
            return None
        t = len(sent_ids)
        ids, aux, hid = (h.tensors[k] for k in ("input_ids", "aux_hidden_state", "hidden_state"))
        if ids[:2] != ("I64", (t,)) or aux[0] != hid[0] or hid[0] not in _STATES:
            return None
        if aux[1] != (t, len(layers) * hidden_size) or hid[1] != (t, hidden_size):
            return None
        if store is not None and store.scaled:
            return _stage_scaled(fd, h, sent_ids, loss_mask, hidden_size, len(layers), buf, limit)
        code = store.safetensors if store is not None else hid[0]
        if code not in _STATES:
            return None
        plan = ckpt.plan(states_spec(t, hidden_size, len(layers), _STATES[code]))
        if plan.total > limit or len(loss_mask) != t:
            return None
        view = buf.view(plan.total)
        ckpt.fill(plan, view)
        _, _, (hid_at, n_hid), (aux_at, n_aux) = plan.slots
        if not _put_ids(fd, view, plan.slots, ids, sent_ids, loss_mask):
            return None
        crcs: dict[int, int] = {}
        for (src, *_, begin, end), at, n in ((hid, hid_at, n_hid), (aux, aux_at, n_aux)):
            SEAM.add("as_is" if src == code else "cast")
            if src == code:
                crc = _read_checked(fd, begin, end, view[at : at + n], code)
                if crc is None:
                    return None
                crcs[at] = crc
            else:
                slot = view[at : at + n]
                if not _read_cast(fd, begin, end, src, slot, code) or not finite(slot, code):
                    return None
        return Staged(view, ckpt.seal(plan, view, crcs))
    except BadDump:  # a garbled header: the general path words it
        return None
    finally:
        if not handed:
            os.close(fd)


def warm_up(store: StoreFormat | None) -> None:
    """Import and run once what :func:`stage` uses for dumps in the stored format (the
    archive's layout and pickle, the NaN/Inf check, the CRC-32); imports no torch unless
    the states are stored as float32."""
    scaled = store is not None and store.scaled
    dtype = store.torch_dtype if store is not None else "bfloat16"
    ckpt.plan(fp8_spec(1, 8, 1) if scaled else states_spec(1, 8, 1, dtype))
    finite(bytes(8), "F8_E4M3" if scaled else _CODES.get(dtype, "BF16"))
    crc32(bytes(8), 0)


def _stage_mapped(
    fd: int,
    tr: Trailer,
    sent_ids: list[int],
    loss_mask: list[int],
    hidden_size: int,
    layers: list[int],
    limit: int,
    store: StoreFormat | None,
    buf: DirectBuffer | None = None,
) -> Staged | None:
    """:func:`stage` for a v2 dump (:mod:`eagle3d.remote.dumpfile`), which is the sample
    file already, but for its loss mask and serialization id: mapped privately (or, with
    ``buf``, all but its large states read into ``buf``: :func:`_sparse_view`), its ids
    checked against what was sent, the archive's headers laid over it again (copied on
    write: a few pages), the mask written into its slot, the records' CRC-32 fields and
    the file's CRC-32 made from the producer's CRCs of the states (read from the headers
    before they were laid over) and the ids' and mask's. The states' pages are only read
    by the write that follows, straight from the mapping (``O_DIRECT`` where the output
    allows it); this CPU never passes over them. The producer checked them finite where
    they were made (the trailer's ``finite``). None for a dump that says otherwise, or
    that is not in this job's format: the caller reads it as it reads a v1 dump."""
    t = len(sent_ids)
    dtype = store.torch_dtype if store is not None else tr.dtype
    if not tr.finite or tr.dtype != dtype or tr.layers != ",".join(map(str, layers)):
        return None
    if (tr.tokens, tr.hidden) != (t, hidden_size) or len(loss_mask) != t:
        return None
    plan = tr.plan()
    if plan.total > limit:
        return None
    sparse = _sparse(plan) if buf is not None else None
    if buf is not None and sparse is not None:
        staged = _sparse_view(fd, plan, buf, sparse[0])
        if staged is None:
            return None
    else:
        try:
            m = mmap.mmap(
                fd, plan.total, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        except OSError:  # no room for the mapping (ENOMEM), a filesystem without it: read it
            return None
        staged = Staged(memoryview(m), ckpt.Written(0, 0), m)
    view = staged.view
    try:
        (ids_at, n_ids), (mask_at, n_mask), *states = plan.slots
        ids_ok = view[ids_at : ids_at + n_ids] == memoryview(array("q", sent_ids)).cast("B")
        if not ids_ok or not _same_layout(plan, view):
            staged.close()
            return None
        if tr.scaled and not all(_positive(view[at : at + n]) for at, n in states[2:]):
            staged.close()
            return None
        # The states' CRC-32 as the producer put them in their records' local headers.
        known = {
            off: struct.unpack_from("<I", view, local)[0]
            for off, _, local, _ in plan.variable[2:-1]
        }
        ckpt.fill(plan, view)
        view[mask_at : mask_at + n_mask] = memoryview(array("q", loss_mask)).cast("B")
        SEAM.add("as_is", 2)
        written = ckpt.seal(plan, view, known)
        # The caller's descriptor goes with the Staged from here (stage() sees it).
        if sparse is not None:
            return Staged(view, written, None, fd, sparse[0], sparse[1])
        copied = _changed_blocks(plan)
        if copied is None:  # not in whole blocks: written from the mapping
            return Staged(view, written, staged.mapping)
        return Staged(view, written, staged.mapping, fd, copied)
    except BaseException:
        staged.close()
        raise


def _sparse_view(fd: int, plan: ckpt.Plan, buf: DirectBuffer, copied: _Ranges) -> Staged | None:
    """The dump's archive in ``buf``, its ``copied`` ranges (what :func:`_sparse` gives: all
    but the holes) read there (a few KiB); None on a short read. The Staged does not hold
    ``fd`` (its close() leaves it open)."""
    view = buf.view(plan.total)[: plan.total]
    for begin, end in copied:
        if os.preadv(fd, [view[begin:end]], begin) != end - begin:
            return None
    return Staged(view, ckpt.Written(0, 0))


_Ranges = tuple[tuple[int, int], ...]


@functools.lru_cache(maxsize=256)
def _sparse(plan: ckpt.Plan) -> tuple[_Ranges, _Ranges] | None:
    """(the blocks a commit writes from its buffer, the holes it splices) for a v2 dump
    staged sparsely: the holes are the whole blocks inside the states' slots whose CRC-32
    the producer wrote (:func:`ckpt.seal` never reads them: none where zlib's
    ``crc32_combine`` is missing), everything else is read and written from the buffer.
    None for an archive that does not end on a block boundary (the caller maps it)."""
    if plan.total % BLOCK:
        return None
    holes = []
    for off, n, _local, _central in plan.variable[2:-1]:  # the states (and fp8's scales)
        begin, end = -(-off // BLOCK) * BLOCK, (off + n) // BLOCK * BLOCK
        if n >= ckpt.COMBINE_MIN and begin < end and ckpt.combines():
            holes.append((begin, end))
    copied, pos = [], 0
    for begin, end in (*holes, (plan.total, plan.total)):
        if pos < begin:
            copied.append((pos, begin))
        pos = end
    return tuple(copied), tuple(holes)


@functools.lru_cache(maxsize=256)
def _changed_blocks(plan: ckpt.Plan) -> tuple[tuple[int, int], ...] | None:
    """The block-aligned ranges of a v2 dump that its commit changes (the headers, records
    and directory :func:`ckpt.fill` and :func:`ckpt.seal` write, and the loss mask's slot),
    merged; None for an archive that does not end on a block boundary."""
    if plan.total % BLOCK:
        return None
    _ids, (mask_at, n_mask), *_ = plan.slots
    spans = sorted(
        [(off, off + len(data)) for off, data in plan.gaps] + [(mask_at, mask_at + n_mask)]
    )
    out: list[tuple[int, int]] = []
    for begin, end in spans:
        b, e = begin // BLOCK * BLOCK, min(plan.total, -(-end // BLOCK) * BLOCK)
        if out and b <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((b, e))
    return tuple(out)


def _same_layout(plan: ckpt.Plan, view: memoryview) -> bool:
    """Whether the archive in ``view`` has ``plan``'s headers, records and directory, but
    for what changes from file to file (the records' CRC-32 fields, the serialization
    id): a few KiB compared, so that a dump laid out otherwise is never taken slot by
    slot."""
    for off, data, fields in _gap_fields(plan):
        got = bytearray(view[off : off + len(data)])
        for begin, end in fields:
            got[begin:end] = data[begin:end]
        if got != data:
            return False
    return True


@functools.lru_cache(maxsize=256)
def _gap_fields(plan: ckpt.Plan) -> tuple[tuple[int, bytes, tuple[tuple[int, int], ...]], ...]:
    """``plan``'s gaps, each with the ranges within it (from the gap's start) that change
    from file to file: the records' CRC-32 fields and the serialization id."""
    out = []
    for off, data in plan.gaps:
        end = off + len(data)
        fields = [(f, f + 4) for _, _, *crcs in plan.variable for f in crcs]
        fields.append((plan.serial, plan.serial + 40))
        mine = tuple((b - off, e - off) for b, e in fields if off <= b < end)
        out.append((off, data, mine))
    return tuple(out)


def _stage_scaled(
    fd: int,
    h: Any,
    sent_ids: list[int],
    loss_mask: list[int],
    hidden_size: int,
    n_layers: int,
    buf: DirectBuffer,
    limit: int,
) -> Staged | None:
    """:func:`stage` for the fp8 format: the states quantized within the read."""
    SEAM.add("quantized", 2)
    t = len(sent_ids)
    ids, aux, hid = (h.tensors[k] for k in ("input_ids", "aux_hidden_state", "hidden_state"))
    plan = ckpt.plan(fp8_spec(t, hidden_size, n_layers))
    if plan.total > limit or len(loss_mask) != t:
        return None
    view = buf.view(plan.total)
    ckpt.fill(plan, view)
    (ids_at, n_ids), (mask_at, _), *states = plan.slots
    (hid_at, _), (aux_at, _), (hs_at, n_hs), (as_at, n_as) = states
    *_, begin, end = ids
    if end - begin != n_ids or os.preadv(fd, [view[ids_at : ids_at + n_ids]], begin) != n_ids:
        return None
    if bytes(view[ids_at : ids_at + n_ids]) != array("q", sent_ids).tobytes():
        return None
    view[mask_at : mask_at + 8 * t] = memoryview(array("q", loss_mask)).cast("B")
    for (src, *_, begin, end), at, s_at, s_n in (
        (hid, hid_at, hs_at, n_hs),
        (aux, aux_at, as_at, n_as),
    ):
        if not _read_quantize(fd, begin, end, src, view, at, s_at, t, 1):
            return None
        if not finite(view[s_at : s_at + s_n], "F32"):
            return None
    return Staged(view, ckpt.seal(plan, view))


def _stage_as_is(
    fd: int,
    h: Any,
    sent_ids: list[int],
    loss_mask: list[int],
    hidden_size: int,
    n_layers: int,
    buf: DirectBuffer,
    limit: int,
) -> Staged | None:
    """:func:`stage` for a dump already in the fp8 format (e4m3 states and their float32
    scales, :func:`eagle3d.remote.storedtype.to_stored`): every tensor read once into its
    slot, checked (no NaN among the values, every scale positive and finite) and
    checksummed there, nothing converted."""
    t = len(sent_ids)
    names = ("input_ids", "hidden_state", "aux_hidden_state")
    ids, hid, aux = (h.tensors[k] for k in names)
    hs, as_ = (h.tensors[k + SCALE_SUFFIX] for k in ("hidden_state", "aux_hidden_state"))
    if ids[:2] != ("I64", (t,)) or hid[0] != "F8_E4M3" or aux[0] != "F8_E4M3":
        return None
    if hid[1] != (t, hidden_size) or aux[1] != (t, n_layers * hidden_size):
        return None
    if hs[:2] != ("F32", (t, 1)) or as_[:2] != ("F32", (t, 1)):
        return None
    plan = ckpt.plan(fp8_spec(t, hidden_size, n_layers))
    if plan.total > limit or len(loss_mask) != t:
        return None
    view = buf.view(plan.total)
    ckpt.fill(plan, view)
    _, _, *states = plan.slots
    if not _put_ids(fd, view, plan.slots, ids, sent_ids, loss_mask):
        return None
    crcs: dict[int, int] = {}
    for (*_, begin, end), (at, n), code in zip(
        (hid, aux, hs, as_), states, ("F8_E4M3", "F8_E4M3", "F32", "F32"), strict=True
    ):
        crc = _read_checked(fd, begin, end, view[at : at + n], code)
        if crc is None:
            return None
        crcs[at] = crc
    for at, n in states[2:]:
        if not _positive(view[at : at + n]):
            return None
    SEAM.add("as_is", 2)
    return Staged(view, ckpt.seal(plan, view, crcs))


def _put_ids(
    fd: int,
    view: memoryview,
    slots: tuple[tuple[int, int], ...],
    ids: Any,
    sent_ids: list[int],
    loss_mask: list[int],
) -> bool:
    """Read the dump's ids (header entry ``ids``) into their slot and the loss mask into
    its own; False on a short read or ids that differ from what was sent."""
    (ids_at, n_ids), (mask_at, _) = slots[:2]
    *_, begin, end = ids
    if end - begin != n_ids or os.preadv(fd, [view[ids_at : ids_at + n_ids]], begin) != n_ids:
        return False
    if bytes(view[ids_at : ids_at + n_ids]) != array("q", sent_ids).tobytes():
        return False
    view[mask_at : mask_at + 8 * len(sent_ids)] = memoryview(array("q", loss_mask)).cast("B")
    return True


def _positive(raw: Any) -> bool:
    """True when every float32 in ``raw`` is above zero (finite is checked already)."""
    import numpy as np

    a = np.frombuffer(raw, np.float32)
    return bool(a.size == 0 or a.min() > 0)


def _read_quantize(
    fd: int,
    begin: int,
    end: int,
    src: str,
    view: memoryview,
    at: int,
    scales_at: int,
    rows: int,
    groups: int,
) -> bool:
    """Read ``rows`` rows of ``src``-typed floats at ``[begin, end)`` of ``fd`` and quantize
    them into e4m3 values at ``view[at:]`` and float32 scales at ``view[scales_at:]``, a
    chunk of whole rows at a time through a reused buffer; False on a short read."""
    import torch

    size = _SIZES[src]
    row = (end - begin) // size // rows if rows else 0
    if row == 0 or row * rows * size != end - begin or row % groups:
        return False
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = bytearray(CAST_CHUNK)
    step = max(1, CAST_CHUNK // (row * size))
    if step * row * size > len(buf):  # one row beyond the chunk: grow the scratch once
        buf = _scratch.buf = bytearray(step * row * size)
    src_t = getattr(torch, _STATES[src])
    for r in range(0, rows, step):
        k = min(step, rows - r)
        chunk = memoryview(buf)[: k * row * size]
        if os.preadv(fd, [chunk], begin + r * row * size) != len(chunk):
            return False
        x = torch.frombuffer(chunk, dtype=src_t).view(k, row)
        values = torch.frombuffer(view[at + r * row : at + (r + k) * row], dtype=torch.uint8)
        scales = torch.frombuffer(
            view[scales_at + 4 * r * groups : scales_at + 4 * (r + k) * groups],
            dtype=torch.float32,
        )
        fp8.quantize_rows_into(x, values.view(k, row), scales.view(k, groups), groups)
    return True


_SIZES = {"F32": 4, "BF16": 2, "F16": 2}
#: Source bytes per chunk of a cast read: small enough to stay in the core's cache between
#: the read and the cast, large enough that the per-chunk calls cost nothing.
CAST_CHUNK = 256 << 10
_scratch = threading.local()


def _read_cast(fd: int, begin: int, end: int, src: str, out: memoryview, dst: str) -> bool:
    """Read the ``src``-typed floats at ``[begin, end)`` of ``fd`` into ``out`` as ``dst``,
    chunk by chunk through a reused buffer; False if the sizes do not match (a short read)."""
    import torch

    n = (end - begin) // _SIZES[src]
    if n * _SIZES[src] != end - begin or n * _SIZES[dst] != len(out):
        return False
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = bytearray(CAST_CHUNK)
    src_t, dst_t = getattr(torch, _STATES[src]), getattr(torch, _STATES[dst])
    step = CAST_CHUNK // _SIZES[src]
    for i in range(0, n, step):
        k = min(step, n - i)
        chunk = memoryview(buf)[: k * _SIZES[src]]
        if os.preadv(fd, [chunk], begin + i * _SIZES[src]) != len(chunk):
            return False
        part = out[i * _SIZES[dst] : (i + k) * _SIZES[dst]]
        torch.frombuffer(part, dtype=dst_t).copy_(torch.frombuffer(chunk, dtype=src_t))
    return True


#: Bytes per chunk of a checked read: the NaN/Inf check and the CRC-32 run on each chunk
#: while the copy has left it in the core's cache, instead of two more passes over memory.
CHECK_CHUNK = 256 << 10


def _read_checked(fd: int, begin: int, end: int, out: memoryview, code: str) -> int | None:
    """Read the ``code``-typed floats at ``[begin, end)`` of ``fd`` into ``out`` chunk by
    chunk, checking each for NaN/Inf and folding it into a CRC-32 while it is in cache.
    Returns the CRC-32 of ``out``; None on a short read or a NaN/Inf."""
    n = len(out)
    if end - begin != n:
        return None
    crc = 0
    for off in range(0, n, CHECK_CHUNK):
        part = out[off : off + CHECK_CHUNK]
        if os.preadv(fd, [part], begin + off) != len(part) or not finite(part, code):
            return None
        crc = crc32(part, crc)
    return crc


def finite(raw: Any, dtype: str) -> bool:
    """True when the little-endian floats in ``raw`` (safetensors ``dtype``) hold no NaN
    or Inf; see :func:`eagle3d.store.validate.all_finite`."""
    import numpy as np

    from eagle3d.store.validate import finite_bits

    if dtype == "F8_E4M3":  # no Inf in e4m3fn; NaN is 0x7F or 0xFF
        return finite_bits(np.frombuffer(raw, np.int8), 0x7F)
    if dtype == "F32":
        # A NaN or an Inf makes the sum NaN or infinite whatever the order of additions: a
        # finite sum proves every element finite (an overflowing one is decided below).
        # torch's sum, over the same memory: a third of numpy's time here (float32 states
        # are the rare format: the others check without torch's import).
        import torch

        if math.isfinite(torch.frombuffer(raw, dtype=torch.float32).sum()):
            return True
        return finite_bits(np.frombuffer(raw, np.int32), 0x7F800000)
    return finite_bits(np.frombuffer(raw, np.int16), 0x7F80 if dtype == "BF16" else 0x7C00)
