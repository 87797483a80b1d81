"""The daemon's side of the dump contract (:mod:`eagle3d.remote.dumpfile`): reading a dump
back, and the errors that say what is wrong with one."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from eagle3d.remote.dumpfile import FORMAT, SCALE_SUFFIX

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


def read_dump(path: str) -> Dump:
    """Load a dump (memory-mapped). Raises BadDump for anything malformed or truncated."""
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
