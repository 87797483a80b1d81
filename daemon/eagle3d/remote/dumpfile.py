"""The dump contract: one file per request, written by a producer, consumed by the daemon.

A dump is a safetensors file ``<dump_dir>/<rid>.e3dump`` holding

* ``input_ids`` int64 ``[T]`` - the ids the producer actually ran,
* ``aux_hidden_state`` ``[T, 3H]`` - the states entering the aux layers, concatenated,
* ``hidden_state`` ``[T, H]`` - the final, post-norm state,

(and, for fp8 states already in the stored format, ``F8_E4M3`` states with their float32
``aux_hidden_state_scale`` and ``hidden_state_scale`` ``[T, 1]``), with string metadata
``format`` (``eagle3-dump-v1``), ``rid``, ``layers`` ("2,16,29") and ``dtype``. The two
states share one float dtype (F32, BF16, F16, or F8_E4M3 with scales), which ``dtype`` names:
the job's storage dtype (:mod:`eagle3d.remote.storedtype`) when the producer was told it (the HF
worker always is, the SGLang hook when its config has ``store_dtype``), the compute dtype
otherwise; the commit casts a dump in another dtype than the job's. It is written to ``.<rid>.e3dump.tmp`` and renamed into place when complete, so
the daemon only ever sees whole files. Only torch and safetensors are needed here: the
SGLang capture hook imports this module inside SGLang's worker processes. The file is written
by :func:`safetensors_parts` (one ``writev`` from the tensors' memory) and read by safetensors
(the daemon's reading side is :mod:`eagle3d.dumps.format`).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FORMAT = "eagle3-dump-v1"
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
) -> str:
    """Write one dump atomically (temp name, then rename) with ``mode`` (0640: the daemon's
    own dumps; the SGLang hook passes 0644, see docs/sglang.md). Returns the final path.

    ``scales`` (aux's, hidden's; ``[T, 1]`` float32) go with fp8 states already in the
    stored format (:func:`eagle3d.remote.storedtype.to_stored`), as ``<name>_scale``."""
    import torch

    final = dump_path(dump_dir, rid)
    tmp = os.path.join(dump_dir, "." + rid + SUFFIX + TMP_SUFFIX)
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
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
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
        os.chmod(tmp, mode)
    os.rename(tmp, final)
    return final


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
