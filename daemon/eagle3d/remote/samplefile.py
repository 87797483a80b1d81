"""A sample file's layout: ``torch.save``'s format, without ``torch.save`` (or torch).

A committed sample is a ``torch.save`` zip of CPU tensors. ``torch.save`` builds it with a
pickler that walks each tensor through torch's reduce machinery, and a zip writer that CRCs
every record with a slow table-driven CRC, then hands the bytes to Python in dozens of small
writes. This module lays out the same archive directly:

* ``archive/data.pkl`` is pickled from stand-ins that reduce exactly as tensors do, so its
  bytes equal ``torch.save``'s (tests compare them);
* the records are stored (not compressed), each data record 64-byte aligned as torch's
  writer aligns them (``torch.load(mmap=True)`` needs that), with CRC-32
  (:mod:`eagle3d.remote.crc`);
* :func:`build` gives the file as parts to write from the tensors' own memory; a
  :class:`Plan` gives it for names, dtypes and shapes alone, so that the bytes can be put
  straight into their slots (:func:`fill`, :func:`seal`); the file's own CRC-32 (the
  journal's checksum) is combined from the records' CRCs (``crc32_combine``) instead of a
  second pass over the data;
* the file ends on a 4 KiB boundary: the zip's end record carries a comment of spaces as
  padding, which zip readers (``torch.load`` among them) skip. A direct write of whole
  blocks is then exactly the file: cutting a block-rounded write back with ``ftruncate``
  made ext4 read the file's last block back from the disk, a synchronous read per sample.

It lives with the producers' code (``remote``) because a producer can write its dumps in
this layout already (:mod:`eagle3d.remote.dumpfile`), leaving the daemon only bytes to move.
The daemon's writer is :mod:`eagle3d.store.archive`. Only archives under 4 GiB are laid out
here (no zip64 records); :func:`fits` says when, and the caller uses ``torch.save``
otherwise.
"""

from __future__ import annotations

import functools
import io
import math
import os
import pickle
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from eagle3d.remote.crc import crc32

if TYPE_CHECKING:
    import torch

ALIGN = 64
_LIMIT = 0xFFFFFFFF - (1 << 20)  # zip32 offsets and sizes, less room for headers
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_END = struct.Struct("<IHHHHIIH")
#: Records from this size up have their CRC-32 combined into the file's, not recomputed
#: (where zlib's ``crc32_combine`` loads: :func:`combines`).
COMBINE_MIN = 4096
#: Files end on a whole block (see the docstring): the ``O_DIRECT`` unit.
BLOCK = 4096


@dataclass(frozen=True, slots=True)
class Written:
    nbytes: int
    crc: int


#: torch dtype name -> (bytes per element, the legacy typed-storage class ``torch.save``
#: records for it: "" for a dtype it records with an untyped storage counted in bytes and
#: ``_rebuild_tensor_v3``). A test holds the classes to torch's own table.
DTYPES: dict[str, tuple[int, str]] = {
    "float64": (8, "DoubleStorage"),
    "float32": (4, "FloatStorage"),
    "float16": (2, "HalfStorage"),
    "bfloat16": (2, "BFloat16Storage"),
    "int64": (8, "LongStorage"),
    "int32": (4, "IntStorage"),
    "int16": (2, "ShortStorage"),
    "int8": (1, "CharStorage"),
    "uint8": (1, "ByteStorage"),
    "bool": (1, "BoolStorage"),
    "float8_e4m3fn": (1, ""),
}


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the key of :data:`DTYPES`."""
    return str(dtype).removeprefix("torch.")


class _Global:
    """Stands for a module-level name (a class, a function, a dtype) in ``data.pkl``:
    pickled as ``GLOBAL module name``, as the pickler pickles the object itself, but
    without importing its module (torch) to check that it is there."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Any:
        # The pickler takes only a callable as a reduce's function; this one is never called.
        raise TypeError(f"{self.module}.{self.name} is a stand-in for pickling")


@functools.cache
def _global(module: str, name: str) -> _Global:
    # One object per name: the pickler memoizes it, and a second use is a BINGET, as for
    # the real class.
    return _Global(module, name)


class _Storage:
    """Stands for a tensor's storage: pickled as a persistent id, as torch does."""

    __slots__ = ("cls", "key", "numel")

    def __init__(self, cls: _Global, key: str, numel: int) -> None:
        self.cls, self.key, self.numel = cls, key, numel


class _Tensor:
    """Reduces as ``torch.Tensor`` does for a contiguous CPU tensor without grad: with
    ``_rebuild_tensor_v2`` over a typed storage, or for the dtypes that have no typed
    storage class (float8), ``_rebuild_tensor_v3`` over an untyped one and the dtype."""

    __slots__ = ("dtype", "shape", "storage", "stride")

    def __init__(
        self,
        storage: _Storage,
        shape: tuple[int, ...],
        stride: tuple[int, ...],
        dtype: _Global | None = None,
    ):
        self.storage, self.shape, self.stride, self.dtype = storage, shape, stride, dtype

    def __reduce_ex__(self, protocol: Any) -> Any:
        args: tuple[Any, ...] = (self.storage, 0, self.shape, self.stride, False, OrderedDict())
        if self.dtype is not None:
            return (_global("torch._utils", "_rebuild_tensor_v3"), (*args, self.dtype))
        return (_global("torch._utils", "_rebuild_tensor_v2"), args)


class _Pickler(pickle._Pickler):
    """Python's own pickler (the C one checks each global by importing its module), with
    :class:`_Global` written as the global it stands for. Protocol 2 has no framing: the
    bytes are the C pickler's (a test holds them to ``torch.save``'s)."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return ("storage", obj.cls, obj.key, "cpu", obj.numel)
        return None

    def _save_global(self, obj: _Global) -> None:
        me: Any = self  # the Python pickler's write and memoize: not in typeshed's stub
        me.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        me.memoize(obj)

    dispatch: ClassVar[dict[type, Any]] = {**pickle._Pickler.dispatch, _Global: _save_global}


def data_pkl(tensors: dict[str, torch.Tensor]) -> bytes:
    """The ``data.pkl`` record ``torch.save`` writes for a dict of contiguous CPU tensors."""
    return _data_pkl(
        tuple(
            (name, dtype_name(t.dtype), tuple(t.shape), t.stride()) for name, t in tensors.items()
        )
    )


@functools.lru_cache(maxsize=4096)
def _data_pkl(spec: tuple[tuple[str, str, tuple[int, ...], tuple[int, ...]], ...]) -> bytes:
    # Cached: the record depends only on names, dtypes, shapes and strides, and a job's
    # samples repeat their lengths. Pickling it was a fifth of building an archive.
    objs = {}
    for key, (name, dtype, shape, stride) in enumerate(spec):
        itemsize, cls = DTYPES[dtype]
        if cls:
            storage = _Storage(_global("torch", cls), str(key), math.prod(shape))
            objs[name] = _Tensor(storage, shape, stride)
        else:  # counted in bytes, and the dtype goes with the tensor
            untyped = _global("torch.storage", "UntypedStorage")
            storage = _Storage(untyped, str(key), math.prod(shape) * itemsize)
            objs[name] = _Tensor(storage, shape, stride, _global("torch", dtype))
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(objs)
    return buf.getvalue()


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy (any dtype, bf16 included)."""
    import torch

    raw: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(raw)


def fits(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the archive is small enough for this writer (and every tensor qualifies)."""
    total = 0
    for t in tensors.values():
        if t.device.type != "cpu" or not t.is_contiguous() or t.requires_grad:
            return False
        if dtype_name(t.dtype) not in DTYPES:
            return False
        total += t.numel() * t.element_size() + 256
    return total < _LIMIT


@functools.cache
def _crc32_combine() -> Any:
    """zlib's ``crc32_combine`` (Python's zlib module does not expose it), or None.

    Loaded on first use, not at import, and ``ctypes.util.find_library`` (an ``ldconfig``
    subprocess) only where the usual soname fails: this module is imported inside SGLang's
    workers (via the dump writer).
    """
    import ctypes.util

    for k in range(2):
        name = "libz.so.1" if k == 0 else ctypes.util.find_library("z")
        if not name:
            continue
        try:
            fn = ctypes.CDLL(name).crc32_combine
        except (OSError, AttributeError):  # pragma: no cover - try the next name
            continue
        fn.restype = ctypes.c_ulong
        fn.argtypes = (ctypes.c_ulong, ctypes.c_ulong, ctypes.c_longlong)
        return fn
    return None  # pragma: no cover - no shared zlib: a second pass over the data instead


def combines() -> bool:
    """Whether :func:`seal` combines large records' known CRC-32 into the file's instead
    of reading their bytes again."""
    return _crc32_combine() is not None


class _Hole:
    """Stands for a record's data in a :class:`Plan`: its size, without the bytes."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class _Archive:
    def __init__(self, file_crc: bool = True) -> None:
        self.parts: list[Any] = []
        self.pos = 0
        self.crc = 0  # of the file so far (left 0 without ``file_crc``)
        self.file_crc = file_crc
        self.entries: list[tuple[bytes, int, int, int]] = []  # name, crc, size, offset

    def _emit(self, data: Any, crc: int | None = None) -> None:
        n = len(data)
        if isinstance(data, _Hole) or not self.file_crc:  # no file CRC to keep
            self.parts.append(data)
            self.pos += n
            return
        # Combining costs a ctypes call; a short record is cheaper to checksum again.
        combine = _crc32_combine() if crc is not None and n >= COMBINE_MIN else None
        if combine is None:
            self.crc = crc32(data, self.crc)
        else:
            self.crc = combine(self.crc, crc, n)
        self.parts.append(data)
        self.pos += n

    def record(self, name: str, data: Any) -> None:
        raw = name.encode()
        crc = 0 if isinstance(data, _Hole) else crc32(data, 0)
        size = len(data)
        offset = self.pos
        # The "FB" extra field pads the header so the data starts on a 64-byte boundary.
        start = offset + _LOCAL.size + len(raw) + 4
        pad = -start % ALIGN
        header = (
            _LOCAL.pack(0x04034B50, 20, 0, 0, 0, 0, crc, size, size, len(raw), 4 + pad)
            + raw
            + b"FB"
            + struct.pack("<H", pad)
            + b"Z" * pad
        )
        self._emit(header)
        self._emit(data, crc)
        self.entries.append((raw, crc, size, offset))

    def finish(self) -> None:
        start = self.pos
        central = bytearray()
        for raw, crc, size, offset in self.entries:
            central += _CENTRAL.pack(
                0x02014B50, 20, 20, 0, 0, 0, 0, crc, size, size, len(raw), 0, 0, 0, 0, 0, offset
            )
            central += raw
        n = len(self.entries)
        # The archive's comment (spaces) pads the file to whole blocks: see the docstring.
        pad = -(start + len(central) + _END.size) % BLOCK
        end = _END.pack(0x06054B50, 0, 0, n, n, len(central), start, pad)
        self._emit(bytes(central) + end + b" " * pad)


def build(tensors: dict[str, torch.Tensor], file_crc: bool = True) -> tuple[list[Any], Written]:
    """The archive ``torch.save(tensors)`` would write (contiguous CPU tensors; see
    :func:`fits`), as parts to write in order (the tensors' own memory, not copied), and
    its size and CRC-32 (0 without ``file_crc``: a producer's dump, whose file CRC the
    commit makes from the records' own)."""
    a = _Archive(file_crc)
    a.record("archive/data.pkl", data_pkl(tensors))
    a.record("archive/.format_version", b"1")
    a.record("archive/.storage_alignment", b"64")
    a.record("archive/byteorder", b"little")
    for key, t in enumerate(tensors.values()):
        a.record(f"archive/data/{key}", raw_bytes(t))
    a.record("archive/version", b"3\n")
    # torch writes a random 128-bit number in decimal, zero-padded to 40 digits.
    serial = int.from_bytes(os.urandom(16), "little")
    a.record("archive/.data/serialization_id", f"{serial:040d}".encode())
    a.finish()
    return a.parts, Written(a.pos, a.crc)


@dataclass(frozen=True, slots=True)
class Plan:
    """The archive :func:`write` makes for tensors of given names, dtypes and shapes, laid
    out ahead of their bytes, so that a caller can put each tensor's bytes straight where
    they belong in one buffer (:func:`fill`, then :func:`seal`) instead of building tensors
    first and gathering them after.

    ``slots`` are the (offset, size) of each tensor's data record, in the dict's order;
    ``gaps`` are the (offset, bytes) of everything in between (headers, the constant
    records, the central directory), with each variable record's CRC-32 left to patch.
    """

    total: int
    slots: tuple[tuple[int, int], ...]
    gaps: tuple[tuple[int, bytes], ...]
    serial: int  # offset of the serialization id's 40 digits
    # (data offset, size, local header's CRC field, central entry's CRC field) of the
    # records whose content changes from file to file: the slots, then the serial id.
    variable: tuple[tuple[int, int, int, int], ...]
    # The file as (offset, size, index into ``variable`` or -1) runs, in order: the file's
    # CRC-32 is combined from the variable records' and recomputed over the rest.
    runs: tuple[tuple[int, int, int], ...]


@functools.lru_cache(maxsize=1024)
def plan(spec: tuple[tuple[str, str, tuple[int, ...]], ...]) -> Plan:
    """The :class:`Plan` for contiguous tensors given as ((name, dtype name, shape), ...)
    (dtype names as :data:`DTYPES` keys them); imports no torch."""
    strides = []
    for _, _, shape in spec:
        stride, step = [], 1
        for dim in reversed(shape):
            stride.append(step)
            step *= dim
        strides.append(tuple(reversed(stride)))
    pkl = _data_pkl(tuple((n, d, sh, st) for (n, d, sh), st in zip(spec, strides, strict=True)))
    sizes = [math.prod(shape) * DTYPES[dtype][0] for _, dtype, shape in spec]
    a = _Archive()
    a.record("archive/data.pkl", pkl)
    a.record("archive/.format_version", b"1")
    a.record("archive/.storage_alignment", b"64")
    a.record("archive/byteorder", b"little")
    first = len(a.entries)
    for key, size in enumerate(sizes):
        a.record(f"archive/data/{key}", _Hole(size))
    a.record("archive/version", b"3\n")
    a.record("archive/.data/serialization_id", b"0" * 40)
    central = a.pos
    a.finish()
    variable_records = [*range(first, first + len(spec)), len(a.entries) - 1]
    variable = []
    for j, (raw, _crc, size, offset) in enumerate(a.entries):
        pos = central
        for raw2, *_ in a.entries[:j]:
            pos += _CENTRAL.size + len(raw2)
        if j in variable_records:
            data = offset + _LOCAL.size + len(raw) + 4
            data += -data % ALIGN
            variable.append((data, size, offset + 14, pos + 16))
    # Everything between the slots, as bytes; the file's CRC in runs around the slots.
    slots = tuple((off, n) for off, n, _, _ in variable[:-1])
    gaps: list[tuple[int, bytes]] = []
    runs: list[tuple[int, int, int]] = []
    pos = 0
    gap = bytearray()
    for part in a.parts:
        if isinstance(part, _Hole):
            gaps.append((pos - len(gap), bytes(gap)))
            runs += [(pos - len(gap), len(gap), -1), (pos, len(part), len(runs) // 2)]
            gap = bytearray()
        else:
            gap += memoryview(part).cast("B")
        pos += len(part)
    gaps.append((pos - len(gap), bytes(gap)))
    runs.append((pos - len(gap), len(gap), -1))
    assert [r[:2] for r in runs if r[2] >= 0] == list(slots)
    return Plan(
        total=pos,
        slots=slots,
        gaps=tuple(gaps),
        serial=variable[-1][0],
        variable=tuple(variable),
        runs=tuple(r for r in runs if r[1]),
    )


def fill(p: Plan, mv: memoryview) -> None:
    """Put everything but the tensors' bytes in place in ``mv`` (at least ``p.total``)."""
    for off, data in p.gaps:
        mv[off : off + len(data)] = data


def seal(p: Plan, mv: memoryview, known: dict[int, int] | None = None) -> Written:
    """Finish the archive in ``mv`` once the slots hold the tensors' bytes: a fresh
    serialization id, every variable record's CRC-32 patched in, the file's CRC-32.
    ``known`` maps slot offsets to their CRC-32 where the caller computed it already."""
    serial = int.from_bytes(os.urandom(16), "little")
    mv[p.serial : p.serial + 40] = f"{serial:040d}".encode()
    crcs = []
    for off, n, local, central in p.variable:
        crc = known[off] if known and off in known else crc32(mv[off : off + n], 0)
        struct.pack_into("<I", mv, local, crc)
        struct.pack_into("<I", mv, central, crc)
        crcs.append(crc)
    combine = _crc32_combine()
    total = 0
    for off, n, k in p.runs:
        if k < 0 or combine is None or n < COMBINE_MIN:
            total = crc32(mv[off : off + n], total)
        else:
            total = combine(total, crcs[k], n)
    return Written(p.total, total)


Spec = tuple[tuple[str, str, tuple[int, ...]], ...]


def states_spec(t: int, hidden_size: int, n_layers: int, dtype: str) -> Spec:
    """The tensors of a sample file of ``t`` tokens whose states are ``dtype`` (a torch
    dtype's name), as :func:`plan` takes them."""
    return (
        ("input_ids", "int64", (t,)),
        ("loss_mask", "int64", (t,)),
        ("hidden_state", dtype, (1, t, hidden_size)),
        ("aux_hidden_state", dtype, (1, t, n_layers * hidden_size)),
    )


def fp8_spec(t: int, hidden_size: int, n_layers: int) -> Spec:
    """The tensors of an fp8 sample file of ``t`` tokens, as :func:`plan` takes them."""
    return (
        *states_spec(t, hidden_size, n_layers, "float8_e4m3fn"),
        ("hidden_state_scale", "float32", (1, t, 1)),
        ("aux_hidden_state_scale", "float32", (1, t, 1)),
    )
