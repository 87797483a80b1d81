"""The dump contract: one file per request, written by a producer, consumed by the daemon.

A dump is a safetensors file ``<dump_dir>/<rid>.e3dump`` holding

* ``input_ids`` int64 ``[T]`` - the ids the producer actually ran,
* ``aux_hidden_state`` ``[T, 3H]`` - the states entering the aux layers, concatenated,
* ``hidden_state`` ``[T, H]`` - the final, post-norm state,

with string metadata ``format`` (``eagle3-dump-v1``), ``rid``, ``layers`` ("2,16,29") and
``dtype``. It is written to ``.<rid>.e3dump.tmp`` and renamed into place when complete, so
the daemon only ever sees whole files. Only torch and safetensors are needed here: the
SGLang capture hook imports this module inside SGLang's worker processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

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
    from safetensors.torch import save_file

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
    save_file(tensors, tmp, metadata=meta)
    os.rename(tmp, final)
    return final


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
    except Exception as e:  # safetensors raises several types for truncated/garbled files
        raise BadDump(f"{os.path.basename(path)}: unreadable dump ({type(e).__name__}: {e})") from e
    if meta.get("format") != FORMAT:
        raise BadDump(f"{os.path.basename(path)}: format {meta.get('format')!r}, want {FORMAT}")
    layers = [int(x) for x in meta.get("layers", "").split(",") if x]
    return Dump(meta.get("rid", ""), layers, ids, aux, hid, size)
