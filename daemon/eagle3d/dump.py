"""The dump contract: one file per request, written by a producer, consumed by the daemon.

A dump is a safetensors file ``<dump_dir>/<rid>.e3dump`` holding

* ``input_ids`` int64 ``[T]`` - the ids the producer actually ran,
* ``aux_hidden_state`` ``[T, 3H]`` - the states entering the aux layers, concatenated,
* ``hidden_state`` ``[T, H]`` - the final, post-norm state,

with string metadata ``format`` (``eagle3-dump-v1``), ``rid``, ``layers`` ("2,16,29") and
``dtype``. The two states share one float dtype (F32, BF16 or F16), which ``dtype`` names:
the job's storage dtype (:mod:`eagle3d.storedtype`) when the producer was told it (the HF
worker always is, the SGLang hook when its config has ``store_dtype``), the compute dtype
otherwise; the commit casts a dump in another dtype than the job's. It is written to ``.<rid>.e3dump.tmp`` and renamed into place when complete, so
the daemon only ever sees whole files. Only torch and safetensors are needed here: the
SGLang capture hook imports this module inside SGLang's worker processes. The file is written
by :func:`safetensors_parts` (one ``writev`` from the tensors' memory) and read by safetensors.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .ckpt import raw_bytes, writev_all

if TYPE_CHECKING:
    import torch

FORMAT = "eagle3-dump-v1"
SUFFIX = ".e3dump"
TMP_SUFFIX = ".tmp"


def dump_path(dump_dir: str, rid: str) -> str:
    return os.path.join(dump_dir, rid + SUFFIX)


def rid_of(path: str) -> str | None:
    """The request id a dump file is named after, or None for a name that is not a dump."""
    name = os.path.basename(path)
    if name.startswith(".") or not name.endswith(SUFFIX):
        return None
    return name[: -len(SUFFIX)]


def write_dump(
    dump_dir: str,
    rid: str,
    input_ids: torch.Tensor,
    aux_hidden_state: torch.Tensor,
    hidden_state: torch.Tensor,
    layers: list[int],
) -> str:
    """Write one dump atomically (temp name, then rename). Returns the final path."""
    import torch

    final = dump_path(dump_dir, rid)
    tmp = os.path.join(dump_dir, "." + rid + SUFFIX + TMP_SUFFIX)
    tensors = {
        "input_ids": input_ids.detach().to("cpu", torch.int64).contiguous(),
        "aux_hidden_state": aux_hidden_state.detach().cpu().contiguous(),
        "hidden_state": hidden_state.detach().cpu().contiguous(),
    }
    meta = {
        "format": FORMAT,
        "rid": rid,
        "layers": ",".join(str(i) for i in layers),
        "dtype": str(tensors["hidden_state"].dtype).removeprefix("torch."),
    }
    if all(str(t.dtype) in _SAFETENSORS_DTYPES for t in tensors.values()):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            writev_all(fd, safetensors_parts(tensors, meta))
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # a full dump area keeps no half-written temp file
            raise
        os.close(fd)
    else:  # pragma: no cover - a dtype the table lacks (fp8 capture, say)
        from safetensors.torch import save_file

        save_file(tensors, tmp, metadata=meta)
    os.rename(tmp, final)
    return final


_SAFETENSORS_DTYPES = {
    "torch.float32": "F32",
    "torch.bfloat16": "BF16",
    "torch.float16": "F16",
    "torch.float64": "F64",
    "torch.int64": "I64",
    "torch.int32": "I32",
}


def safetensors_parts(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> list[Any]:
    """A safetensors file as buffers for one ``writev``: the header, then each tensor's own
    memory. ``safetensors.torch.save_file`` first copies everything into one buffer (and
    checks names and sharing in Python): about half the dump writer's CPU per sample in a
    CPU worker, beside the forward."""
    header: dict[str, Any] = {"__metadata__": meta}
    parts: list[Any] = []
    off = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[str(t.dtype)],
            "shape": list(t.shape),
            "data_offsets": [off, off + n],
        }
        parts.append(raw_bytes(t))
        off += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the format asks
    return [struct.pack("<Q", len(text)) + text, *parts]


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


class BadDump(ValueError):
    """A dump that cannot be used; the message names what is wrong."""


class DumpVanished(BadDump):
    """The dump was complete (it had its final name) and is gone: the dump area was removed
    or cleaned under the job. Nothing is wrong with what the producer computed."""


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
    except BadDump:
        raise
    except FileNotFoundError as e:
        raise vanished(path) from e
    except Exception as e:  # safetensors raises several types for truncated/garbled files
        raise BadDump(f"{os.path.basename(path)}: unreadable dump ({type(e).__name__}: {e})") from e
    if meta.get("format") != FORMAT:
        raise BadDump(f"{os.path.basename(path)}: format {meta.get('format')!r}, want {FORMAT}")
    layers = [int(x) for x in meta.get("layers", "").split(",") if x]
    return Dump(meta.get("rid", ""), layers, ids, aux, hid, size)
