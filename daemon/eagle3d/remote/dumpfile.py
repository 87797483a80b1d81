"""The dump contract: one file per request, written by a producer, consumed by the daemon.

A dump ``<dump_dir>/<rid>.e3dump`` holds, for the request's ``T`` tokens,

* ``input_ids`` int64 ``[T]`` - the ids the producer actually ran,
* ``aux_hidden_state`` ``[T, nH]`` - the states entering the aux layers, concatenated,
* ``hidden_state`` ``[T, H]`` - the final, post-norm state,

(and, for fp8 states already in the stored format, ``F8_E4M3`` states with their float32
``aux_hidden_state_scale`` and ``hidden_state_scale``, one per token), with string metadata
``rid``, ``layers`` ("2,16,29") and ``dtype``. The two states share one float dtype (F32,
BF16, F16, or F8_E4M3 with scales), which ``dtype`` names: the job's storage dtype
(:mod:`eagle3d.remote.storedtype`) when the producer was told it (the HF worker always is,
the SGLang hook when its config has ``store_dtype``), the compute dtype otherwise; the
commit casts a dump in another dtype than the job's.

It comes in two layouts:

* ``eagle3-dump-v2`` (what :func:`write_dump` writes): the sample file itself
  (:mod:`eagle3d.remote.samplefile`, ``torch.save``'s zip of ``input_ids``, ``loss_mask``,
  ``hidden_state [1, T, H]``, ``aux_hidden_state [1, T, nH]`` and the scales), its loss mask
  zeros (the daemon knows the mask, the producer does not), its records' CRC-32 made here,
  followed by a trailer of :data:`TRAILER` bytes: :data:`TRAILER_MAGIC`, then the metadata as
  JSON (with ``tokens``, ``hidden``, and ``finite``: whether every state is finite, checked
  here, where the states are), padded with spaces. The daemon maps it, checks the ids,
  writes the mask and the CRC fields into its private copy of those pages, and writes the
  archive to the output straight from the mapping: the states are never read by its CPU.
* ``eagle3-dump-v1``: a safetensors file of the three tensors (and the scales) with the
  metadata ``format``, ``rid``, ``layers``, ``dtype``; :func:`write_dump` writes it for
  tensors the sample layout cannot hold (``layout="safetensors"`` asks for it), and the daemon
  reads both.

A dump is written to ``.<rid>.e3dump.tmp`` and renamed into place when complete, so the
daemon only ever sees whole files. Only torch (and safetensors for a v1 dump of an unusual
dtype) are needed here: the SGLang capture hook imports this module inside SGLang's worker
processes. The daemon's reading side is :mod:`eagle3d.dumps.format`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FORMAT = "eagle3-dump-v1"
#: The sample-file layout (the module's docstring).
FORMAT_SAMPLE = "eagle3-dump-v2"
#: The v2 trailer: its size (one block, so the archive before it ends on a block too) and
#: its first bytes.
TRAILER = 4096
TRAILER_MAGIC = b"E3D2"
#: The states' dtypes a v2 dump holds (the storage formats'); others are written as v1.
SAMPLE_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")
#: The dump layouts :func:`write_dump` writes.
LAYOUTS = ("sample", "safetensors")
#: Beside fp8 states already in the stored format: their scales, ``<name>_scale``.
SCALE_SUFFIX = "_scale"
SUFFIX = ".e3dump"
TMP_SUFFIX = ".tmp"


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default: the states entering layers 2, L//2 and L-3 (SGLang's), distinct for
    any model of 4 layers or more (:func:`eagle3d.remote.recipes.default_layers`)."""
    from eagle3d.remote.recipes import default_layers

    return default_layers("eagle3", num_layers)


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
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    mode: int = 0o640,
    layout: str = "sample",
    finite: bool | None = None,
) -> str:
    """Write one dump atomically (temp name, then rename) with ``mode`` (0640: the daemon's
    own dumps; the SGLang hook passes 0644, see docs/sglang.md). Returns the final path.

    ``scales`` (aux's, hidden's; ``[T, 1]`` float32) go with fp8 states already in the
    stored format (:func:`eagle3d.remote.storedtype.to_stored`), as ``<name>_scale``.
    ``layout``: ``sample`` (v2, where the sample layout holds the tensors; else v1) or
    ``safetensors`` (v1); see the module's docstring. ``finite``: whether the states are
    all finite, where the caller checked it on their device (None: checked here)."""
    final = dump_path(dump_dir, rid)
    tmp = os.path.join(dump_dir, "." + rid + SUFFIX + TMP_SUFFIX)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    parts = None
    if layout == "sample":
        parts = sample_parts(rid, input_ids, aux_hidden_state, hidden_state, layers, scales, finite)
    if parts is not None:
        return write_parts(dump_dir, rid, parts, mode)
    _write_v1(tmp, rid, input_ids, aux_hidden_state, hidden_state, layers, scales, mode)
    os.rename(tmp, final)
    return final


def write_parts(dump_dir: str, rid: str, parts: list[Any], mode: int = 0o640) -> str:
    """Write a dump made of ``parts`` (for one ``writev``) atomically; its final path."""
    final = dump_path(dump_dir, rid)
    tmp = os.path.join(dump_dir, "." + rid + SUFFIX + TMP_SUFFIX)
    _write_file(tmp, parts, mode)
    os.rename(tmp, final)
    return final


def _write_file(tmp: str, parts: list[Any], mode: int) -> None:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        writev_all(fd, parts)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a full dump area keeps no half-written temp file
        raise
    os.close(fd)


def sample_parts(
    rid: str,
    input_ids: torch.Tensor,
    aux_hidden_state: torch.Tensor,
    hidden_state: torch.Tensor,
    layers: list[int],
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    finite: bool | None = None,
) -> list[Any] | None:
    """A v2 dump (the module's docstring) as parts for one ``writev``, from the tensors'
    own memory once on the host; None when the sample layout cannot hold these tensors
    (a dtype it lacks, 4 GiB or more, states of unexpected shapes): write a v1 dump.
    ``finite`` as :func:`write_dump` takes it."""
    import torch

    from eagle3d.remote import samplefile

    if hidden_state.dim() != 2 or aux_hidden_state.dim() != 2:
        return None
    (t, hidden), dtype = hidden_state.shape, hidden_state.dtype
    dtype_name = str(dtype).removeprefix("torch.")
    if aux_hidden_state.shape != (t, len(layers) * hidden) or aux_hidden_state.dtype != dtype:
        return None  # the v1 layout holds what the job did not ask for: the commit words it
    if dtype_name not in SAMPLE_DTYPES or (scales is not None) != (dtype_name == "float8_e4m3fn"):
        return None
    if finite is None:
        finite = states_finite(aux_hidden_state, hidden_state, scales)
    ids = input_ids.detach().to("cpu", torch.int64).contiguous()
    tensors = {
        "input_ids": ids,
        "loss_mask": torch.zeros_like(ids),
        "hidden_state": hidden_state.detach().cpu().contiguous()[None],
        "aux_hidden_state": aux_hidden_state.detach().cpu().contiguous()[None],
    }
    if scales is not None:
        if any(sc.shape != (t, 1) for sc in scales):
            return None
        aux_s, hid_s = (sc.detach().to("cpu", torch.float32).contiguous()[None] for sc in scales)
        tensors["hidden_state" + SCALE_SUFFIX] = hid_s
        tensors["aux_hidden_state" + SCALE_SUFFIX] = aux_s
    if not samplefile.fits(tensors):
        return None
    end = trailer(rid, layers, dtype_name, int(t), int(hidden), finite)
    if end is None:
        return None
    parts, _ = samplefile.build(tensors, file_crc=False)
    return [*parts, end]


def trailer(
    rid: str, layers: list[int], dtype: str, tokens: int, hidden: int, finite: bool
) -> bytes | None:
    """A v2 dump's trailer (the module's docstring); None if its metadata do not fit (a
    rid of kilobytes: the v1 layout's header has room for it)."""
    meta = {
        "format": FORMAT_SAMPLE,
        "rid": rid,
        "layers": ",".join(str(i) for i in layers),
        "dtype": dtype,
        "tokens": tokens,
        "hidden": hidden,
        "finite": finite,
    }
    text = TRAILER_MAGIC + json.dumps(meta, separators=(",", ":")).encode()
    return text + b" " * (TRAILER - len(text)) if len(text) <= TRAILER else None


def states_finite(
    aux: torch.Tensor, hid: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None
) -> bool:
    """Whether the states hold no NaN or Inf, checked on their device (for fp8 states, no
    NaN among the values and every scale positive and finite)."""
    import torch

    if scales is not None:  # e4m3fn has no Inf; its NaN is 0x7F or 0xFF
        values = all(bool(((x.view(torch.uint8) & 0x7F) != 0x7F).all()) for x in (aux, hid))
        return values and all(bool(((s > 0) & torch.isfinite(s)).all()) for s in scales)
    # A NaN or an Inf makes a sum NaN or infinite; a finite sum proves every element
    # finite. A sum that overflows (finite states) is decided by the exact check.
    return all(
        not x.is_floating_point()
        or math.isfinite(float(x.sum(dtype=torch.float32)))
        or bool(torch.isfinite(x).all())
        for x in (aux, hid)
    )


def _write_v1(
    tmp: str,
    rid: str,
    input_ids: torch.Tensor,
    aux_hidden_state: torch.Tensor,
    hidden_state: torch.Tensor,
    layers: list[int],
    scales: tuple[torch.Tensor, torch.Tensor] | None,
    mode: int,
) -> None:
    import torch

    tensors = {
        "input_ids": input_ids.detach().to("cpu", torch.int64).contiguous(),
        "aux_hidden_state": aux_hidden_state.detach().cpu().contiguous(),
        "hidden_state": hidden_state.detach().cpu().contiguous(),
    }
    if scales is not None:
        for name, sc in zip(("aux_hidden_state", "hidden_state"), scales, strict=True):
            tensors[name + SCALE_SUFFIX] = sc.detach().to("cpu", torch.float32).contiguous()
    meta = {
        "format": FORMAT,
        "rid": rid,
        "layers": ",".join(str(i) for i in layers),
        "dtype": str(tensors["hidden_state"].dtype).removeprefix("torch."),
    }
    if all(str(t.dtype) in _SAFETENSORS_DTYPES for t in tensors.values()):
        _write_file(tmp, safetensors_parts(tensors, meta), mode)
    else:  # pragma: no cover - a dtype the table lacks (fp8 capture, say)
        from safetensors.torch import save_file

        save_file(tensors, tmp, metadata=meta)
        os.chmod(tmp, mode)


_SAFETENSORS_DTYPES = {
    "torch.float32": "F32",
    "torch.bfloat16": "BF16",
    "torch.float16": "F16",
    "torch.float64": "F64",
    "torch.int64": "I64",
    "torch.int32": "I32",
    "torch.float8_e4m3fn": "F8_E4M3",
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


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy (any dtype, bf16 included)."""
    import torch

    raw: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(raw)


def writev_all(fd: int, parts: list[Any]) -> None:
    """``os.writev`` until everything is written (a regular file may take it in pieces)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
