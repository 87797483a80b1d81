"""The daemon's side of the dump contract (:mod:`eagle3d.remote.dumpfile`): reading a dump
back (either layout), and the errors that say what is wrong with one."""

from __future__ import annotations

import functools
import json
import os
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from eagle3d.remote import samplefile
from eagle3d.remote.dumpfile import (
    FORMAT,
    FORMAT_SAMPLE,
    SAMPLE_DTYPES,
    SCALE_SUFFIX,
    TRAILER,
    TRAILER_MAGIC,
)

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class Header:
    """A dump's safetensors header: what it holds and where, without reading the data."""

    meta: dict[str, str]
    #: name -> (safetensors dtype such as "F32", shape, first byte, end) in the file
    tensors: dict[str, tuple[str, tuple[int, ...], int, int]]


# A header longer than this is not one of ours (ours are a few hundred bytes).
HEADER_MAX = 1 << 20


def read_header(fd: int) -> Header:
    """Read and check the header of the dump open on ``fd``. Raises BadDump (with no file
    name: the caller knows it) when it is not a well-formed safetensors header."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 4096, 0)
    if len(head) < 8:
        raise BadDump(f"truncated: {size} bytes")
    (n,) = struct.unpack_from("<Q", head)
    if n > HEADER_MAX or 8 + n > size:
        raise BadDump(f"header of {n} bytes in a file of {size}")
    if 8 + n > len(head):
        head += os.pread(fd, 8 + n - len(head), len(head))
    try:
        raw = json.loads(head[8 : 8 + n])
        meta = {str(k): str(v) for k, v in (raw.pop("__metadata__", None) or {}).items()}
        tensors = {}
        for name, t in raw.items():
            begin, end = (int(x) for x in t["data_offsets"])
            shape = tuple(int(x) for x in t["shape"])
            tensors[name] = (str(t["dtype"]), shape, 8 + n + begin, 8 + n + end)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise BadDump(f"garbled header ({type(e).__name__}: {e})") from e
    if any(not (8 + n <= b <= e <= size) for _, _, b, e in tensors.values()):
        raise BadDump(f"a tensor lies beyond the end of the file ({size} bytes)")
    return Header(meta, tensors)


#: The first bytes of a v2 dump (a zip's first local header); a v1 dump starts with its
#: header's length, which is never this (it would exceed :data:`HEADER_MAX`).
ZIP_MAGIC = b"PK\x03\x04"


#: torch dtype names -> safetensors dtype codes, and the codes' sizes.
_CODES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float8_e4m3fn": "F8_E4M3"}
_SIZES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I64": 8}


@dataclass(frozen=True, slots=True)
class Trailer:
    """A v2 dump's trailer: what its archive holds, and what the producer checked."""

    rid: str
    layers: str  # as written: "2,16,29"
    dtype: str  # the states' torch dtype name
    tokens: int
    hidden: int
    finite: bool

    @property
    def scaled(self) -> bool:
        return self.dtype == "float8_e4m3fn"

    @property
    def layer_ids(self) -> list[int]:
        """The layers as numbers; ValueError for a garbled list."""
        return [int(x) for x in self.layers.split(",") if x]

    def header(self) -> Header:
        """The dump's tensors as a v1 dump's header gives them (safetensors dtype codes,
        shapes ``[T, H]``, byte ranges in the file), without the loss mask: so that the
        commit's reads that cast or quantize take either layout alike."""
        plan = self.plan()
        t, code = self.tokens, _CODES.get(self.dtype, self.dtype)
        names = ["input_ids", "loss_mask", "hidden_state", "aux_hidden_state"]
        codes = ["I64", "I64", code, code]
        if self.scaled:
            names += ["hidden_state" + SCALE_SUFFIX, "aux_hidden_state" + SCALE_SUFFIX]
            codes += ["F32", "F32"]
        tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, c, (at, n) in zip(names, codes, plan.slots, strict=True):
            row = n // (_SIZES.get(c, 1) * t)
            tensors[name] = (c, (t,) if c == "I64" else (t, row), at, at + n)
        del tensors["loss_mask"]
        meta = {"format": FORMAT, "rid": self.rid, "layers": self.layers, "dtype": self.dtype}
        return Header(meta, tensors)

    def plan(self) -> samplefile.Plan:
        """The archive's layout, from the trailer alone."""
        return _plan(self.tokens, self.hidden, self.layers, self.dtype)


@functools.lru_cache(maxsize=256)
def _plan(tokens: int, hidden: int, layers: str, dtype: str) -> samplefile.Plan:
    n = len([x for x in layers.split(",") if x])
    if dtype == "float8_e4m3fn":
        return samplefile.plan(samplefile.fp8_spec(tokens, hidden, n))
    return samplefile.plan(samplefile.states_spec(tokens, hidden, n, dtype))


class _TrailerMeta(msgspec.Struct, frozen=True):
    """A v2 dump's trailer as :func:`eagle3d.remote.dumpfile.trailer` writes it (fields
    beyond these are ignored)."""

    rid: str
    layers: str
    dtype: str
    tokens: int
    hidden: int
    finite: bool
    format: str | None = None


_decode_trailer = msgspec.json.Decoder(_TrailerMeta).decode


def is_sample_dump(fd: int) -> bool:
    """Whether the dump open on ``fd`` is in the sample layout (v2)."""
    return os.pread(fd, len(ZIP_MAGIC), 0) == ZIP_MAGIC


def read_trailer(fd: int) -> Trailer:
    """The trailer of the v2 dump open on ``fd``; BadDump (with no file name: the caller
    knows it) when it is missing or garbled, or the file's size is not what it describes."""
    size = os.fstat(fd).st_size
    raw = os.pread(fd, TRAILER, size - TRAILER) if size >= TRAILER else b""
    if not raw.startswith(TRAILER_MAGIC) or len(raw) != TRAILER:
        raise BadDump(f"truncated: {size} bytes and no trailer")
    try:
        meta = _decode_trailer(memoryview(raw)[len(TRAILER_MAGIC) :])
        t = Trailer(meta.rid, meta.layers, meta.dtype, meta.tokens, meta.hidden, meta.finite)
        n_layers = len(t.layer_ids)
    except (msgspec.DecodeError, ValueError) as e:
        raise BadDump(f"garbled trailer ({type(e).__name__}: {e})") from e
    if meta.format != FORMAT_SAMPLE:
        raise BadDump(f"format {meta.format!r}, want {FORMAT_SAMPLE}")
    if t.dtype not in SAMPLE_DTYPES or min(t.tokens, t.hidden, n_layers) < 1:
        raise BadDump(
            f"a trailer of {t.tokens} tokens, hidden {t.hidden} {t.dtype}, layers {t.layers!r}"
        )
    want = t.plan().total + TRAILER
    if size != want:
        raise BadDump(f"{size} bytes, want {want} for its {t.tokens} tokens")
    return t


@dataclass(slots=True)
class Dump:
    rid: str
    layers: list[int]
    input_ids: torch.Tensor
    aux_hidden_state: torch.Tensor
    hidden_state: torch.Tensor
    nbytes: int
    #: ``<state>_scale`` -> its float32 ``[T, 1]`` scales, for fp8 states dumped already in
    #: the stored format (:func:`eagle3d.remote.storedtype.to_stored`); else empty.
    scales: dict[str, torch.Tensor] = field(default_factory=dict)


class BadDump(ValueError):
    """A dump that cannot be used; the message names what is wrong."""


class DumpVanished(BadDump):
    """The dump was complete (it had its final name) and is gone: the dump area was removed
    or cleaned under the job. Nothing is wrong with what the producer computed."""


class ContractBroken(BadDump):
    """The dump's layers (their ids, their count) or its hidden size are not the job's
    capture contract: the producer is set up for another capture (an SGLang server launched
    without the job's layer arguments), so every dump it writes will be refused alike.
    Nothing is wrong with the sample."""


def vanished(path: str) -> DumpVanished:
    return DumpVanished(f"{os.path.basename(path)} vanished before it was read")


def open_dump(path: str) -> int:
    """A descriptor of the dump at ``path``; DumpVanished if it is gone."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise vanished(path) from e


def read_dump(path: str) -> Dump:
    """Load a dump of either layout. Raises BadDump for anything malformed or truncated."""
    fd = open_dump(path)
    try:
        if is_sample_dump(fd):
            return _read_sample_dump(fd)
    except BadDump as e:
        raise BadDump(f"{os.path.basename(path)}: {e}") from e
    finally:
        os.close(fd)
    return _read_safetensors_dump(path)


def _read_sample_dump(fd: int) -> Dump:
    """A v2 dump's tensors, copied out of its archive (the general path: the commit's own
    path maps the file instead, :mod:`eagle3d.store.splice`)."""
    import torch

    tr = read_trailer(fd)
    plan = tr.plan()
    data = bytearray(plan.total)
    if os.preadv(fd, [data], 0) != plan.total:
        raise BadDump("truncated while read")
    (ids_at, n_ids), _mask, (hid_at, n_hid), (aux_at, n_aux), *scale_slots = plan.slots
    mv = memoryview(data)

    def tensor(at: int, n: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.frombuffer(mv[at : at + n], dtype=getattr(torch, dtype)).view(shape)

    t, h = tr.tokens, tr.hidden
    ids = tensor(ids_at, n_ids, "int64", (t,))
    hid = tensor(hid_at, n_hid, tr.dtype, (t, h))
    aux = tensor(aux_at, n_aux, tr.dtype, (t, -1))
    names = ("hidden_state" + SCALE_SUFFIX, "aux_hidden_state" + SCALE_SUFFIX)
    scales = {
        name: tensor(at, n, "float32", (t, 1))
        for name, (at, n) in zip(names[: len(scale_slots)], scale_slots, strict=True)
    }
    return Dump(tr.rid, tr.layer_ids, ids, aux, hid, plan.total + TRAILER, scales)


def _read_safetensors_dump(path: str) -> Dump:
    """A v1 dump, memory-mapped by safetensors."""
    from safetensors import safe_open

    try:
        size = os.path.getsize(path)
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            keys = set(f.keys())
            missing = {"input_ids", "aux_hidden_state", "hidden_state"} - keys
            if missing:
                raise BadDump(f"{os.path.basename(path)}: missing tensors {sorted(missing)}")
            ids = f.get_tensor("input_ids")
            aux = f.get_tensor("aux_hidden_state")
            hid = f.get_tensor("hidden_state")
            scales = {k: f.get_tensor(k) for k in sorted(keys) if k.endswith(SCALE_SUFFIX)}
    except BadDump:
        raise
    except FileNotFoundError as e:
        raise vanished(path) from e
    except Exception as e:  # safetensors raises several types for truncated/garbled files
        raise BadDump(f"{os.path.basename(path)}: unreadable dump ({type(e).__name__}: {e})") from e
    if meta.get("format") != FORMAT:
        raise BadDump(f"{os.path.basename(path)}: format {meta.get('format')!r}, want {FORMAT}")
    layers = [int(x) for x in meta.get("layers", "").split(",") if x]
    return Dump(meta.get("rid", ""), layers, ids, aux, hid, size, scales)
