"""The formats ``eagle3d export`` writes, each as its trainer's own reader expects it.

Every writer gets one sample as :func:`eagle3d.reader.load_sample` returns it (states in
bfloat16, dequantized from fp8 where stored so) and writes one file to an open descriptor,
returning its size and CRC-32; :mod:`eagle3d.tools.export` owns the temp names, syncs, renames
and the manifest. Formats, as read in each project's source:

* ``specforge`` (SpecForge 0.2.0, ``runtime/data_plane/offline_reader.py`` and
  ``algorithms/eagle3/data.py``): ``rows_<g>-<g+2000>/data_<idx>.ckpt``, a ``torch.save``
  dict of ``input_ids [T]``, ``loss_mask [T]`` (int64), ``hidden_state [1, T, H]``,
  ``aux_hidden_state [1, T, 3H]`` (bfloat16: its target head is bfloat16). eagle3d's own
  bfloat16 output already is this; the export is for the other storage formats.
* ``speculators`` (vllm-project/speculators 0.9.0, ``train/data.py`` ``ArrowDataset`` and
  hs_connectors' ``FileTransfer``): a Hugging Face ``datasets`` directory (``save_to_disk``
  layout: ``data-00000-of-00001.arrow``, ``dataset_info.json``, ``state.json``, torch
  format) whose rows hold ``input_ids``, ``loss_mask`` and ``seq_len``, row ``k``'s states
  in ``hidden_states/hs_<k>.safetensors`` as ``token_ids [T]`` (int64) and
  ``hidden_states [T, layers + 1, H]`` (bfloat16): the aux layers, then the last layer;
  plus ``token_freq.pt`` (loss-token counts, from which its trainer builds the draft
  vocabulary). Its trainer applies the target's final norm to the last layer itself
  (``verifier_norm``), so it wants the state *before* that norm, which eagle3d does not
  store: the export writes ``y / w`` instead (``y`` the stored post-norm state, ``w`` the
  norm's weight, read from the target model), which an RMSNorm with weight ``w`` maps back
  to ``y`` (RMSNorm does not see its input's scale) up to its epsilon. Rows are numbered in
  export order, so an export that resumes or grows keeps every row where it was. The
  ``hidden_states`` folder stays flat: ``FileTransfer`` opens ``hidden_states_path /
  f"hs_{k}.safetensors"`` and nothing else.
* ``modelopt`` (NVIDIA Model-Optimizer, ``torch/speculative/eagle/utils.py``
  ``OfflineSupervisedDataset`` and ``collect_hidden_states/compute_hidden_states_hf.py``):
  ``rows_<g>-<g+2000>/<idx, 8 digits>.pt`` (its example's ``main.py`` lists
  ``offline_data_path.rglob("*.pt")``: subfolders are read, and keep a folder at 2,000
  entries however large the job), a ``torch.save`` dict of ``input_ids [T]``,
  ``hidden_states [T, H]`` (post-norm, which its reader assumes unless the file says
  ``hidden_states_prenorm``), ``aux_hidden_states [T, 3H]``, ``loss_mask [T]`` (read with
  ``answer_only_loss``) and ``conversation_id`` (the same 8 digits).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Protocol, cast

from eagle3proto import paths

from eagle3d.remote import samplefile
from eagle3d.remote.dumpfile import safetensors_parts
from eagle3d.store import archive
from eagle3d.store.crc import crc32

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class Row:
    """What the manifest keeps of an exported sample for a format's final files."""

    k: int
    input_ids: bytes  # int64, little endian
    loss_mask: bytes  # int64, little endian


class IndexFiles(Protocol):
    """Where a format's index files go: ``with open(name) as f`` gives a file to write
    that appears under ``name`` (relative to the export directory) whole and synced when
    the block ends."""

    def open(self, name: str) -> AbstractContextManager[IO[bytes]]: ...


class Exporter:
    """One format. ``target`` names a sample's file (relative to the export directory);
    ``write`` writes it to ``fd`` and returns (bytes, checksum); ``finish`` writes the
    format's files beside the samples (an index), given every exported row in row order,
    streamed (a row at a time: a million rows' ids are never held at once)."""

    name = ""
    #: Whether ``finish`` needs each sample's ids and mask (kept in the manifest).
    keeps_rows = False

    def target(self, idx: int, k: int) -> str:
        raise NotImplementedError

    def same_bytes(self, job: Any) -> bool:
        """Whether the job's own sample files are this format's files byte for byte (then
        the export hard-links them instead of writing them again)."""
        return False

    def write(self, fd: int, sample: dict[str, torch.Tensor], idx: int) -> tuple[int, str]:
        raise NotImplementedError

    def finish(self, files: IndexFiles, rows: Iterable[Row]) -> None:
        """Write the format's index files into ``files``; none by default."""


class SpecForge(Exporter):
    """SpecForge's record for the output's recipe: v0.2.0's (and v0.3.0's) EAGLE-3 one above,
    or v0.3.0's DFlash/Domino ``hidden_states [1, T, kH]`` and DSpark's ``hidden_states``
    plus ``target_last_hidden_states [1, T, H]`` (:mod:`eagle3d.remote.recipes`)."""

    name = "specforge"

    def __init__(self, recipe: str = "eagle3") -> None:
        from eagle3d.remote import recipes

        self.recipe = recipes.get(recipe)

    def target(self, idx: int, k: int) -> str:
        return paths.sample_relpath(idx)

    def same_bytes(self, job: Any) -> bool:
        # eagle3d's own bfloat16 EAGLE-3 files are SpecForge's record as it is.
        return (
            self.recipe.name == "eagle3"
            and job is not None
            and job.store_dtype == "bfloat16"
            and (getattr(job, "recipe", "") or "eagle3") == "eagle3"
        )

    def write(self, fd: int, sample: dict[str, torch.Tensor], idx: int) -> tuple[int, str]:
        if self.recipe.name == "eagle3":  # the order eagle3d's own files have
            payload = {
                "input_ids": sample["input_ids"].contiguous(),
                "loss_mask": sample["loss_mask"].contiguous(),
                "hidden_state": sample["hidden_state"].contiguous(),
                "aux_hidden_state": sample["aux_hidden_state"].contiguous(),
            }
        else:
            payload = self.recipe.record(
                sample["input_ids"].contiguous(),
                sample["loss_mask"].contiguous(),
                sample["aux_hidden_state"].contiguous(),
                sample["hidden_state"].contiguous(),
            )
        w = archive.write(fd, payload)
        return w.nbytes, f"crc32:{w.crc:08x}"


class ModelOpt(Exporter):
    name = "modelopt"

    def target(self, idx: int, k: int) -> str:
        return f"{paths.rows_dir(idx)}/{idx:08d}.pt"

    def write(self, fd: int, sample: dict[str, torch.Tensor], idx: int) -> tuple[int, str]:
        import torch

        from eagle3d.store.reference import ChecksumWriter

        payload = {
            "input_ids": sample["input_ids"].contiguous(),
            "hidden_states": sample["hidden_state"][0].contiguous(),
            "aux_hidden_states": sample["aux_hidden_state"][0].contiguous(),
            "loss_mask": sample["loss_mask"].contiguous(),
            "conversation_id": f"{idx:08d}",
        }
        w = ChecksumWriter(fd)
        torch.save(payload, cast("IO[bytes]", w))
        w.flush()
        return w.size, w.checksum


class Speculators(Exporter):
    """See the module's docstring. ``norm_weight`` is the target's final norm weight
    (float32, ``[H]``), as it multiplies: RMSNorm's ``w``, or ``1 + w`` for Gemma's."""

    name = "speculators"
    keeps_rows = True

    def __init__(self, norm_weight: torch.Tensor) -> None:
        import torch

        w = norm_weight.to(torch.float32)
        self.inverse = torch.where(w != 0, 1.0 / w, torch.zeros_like(w))

    def target(self, idx: int, k: int) -> str:
        return f"hidden_states/hs_{k}.safetensors"

    def write(self, fd: int, sample: dict[str, torch.Tensor], idx: int) -> tuple[int, str]:
        import torch

        from eagle3d.remote.dumpfile import writev_all

        aux = sample["aux_hidden_state"][0]
        last = sample["hidden_state"][0]
        t, h = last.shape
        pre = (last.to(torch.float32) * self.inverse).to(torch.bfloat16)
        states = torch.cat([aux.reshape(t, -1, h), pre.reshape(t, 1, h)], dim=1)
        tensors = {
            "token_ids": sample["input_ids"].to(torch.int64).contiguous(),
            "hidden_states": states.contiguous(),
        }
        parts = safetensors_parts(tensors, {"format": "pt", "producer": "eagle3d export"})
        crc, size = 0, 0
        for p in parts:
            mv = memoryview(p).cast("B")
            crc = crc32(mv, crc)
            size += len(mv)
        writev_all(fd, parts)
        return size, f"crc32:{crc:08x}"

    def finish(self, files: IndexFiles, rows: Iterable[Row]) -> None:
        speculators_index(files, rows)


#: Rows, and tokens, per Arrow record batch of the speculators index at most: what is held
#: of it at once (1M tokens: 16 MB of ids and masks, whatever the rows' lengths).
INDEX_BATCH = 4096
INDEX_BATCH_TOKENS = 1 << 20

_FEATURES = {
    "input_ids": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
    "loss_mask": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
    "seq_len": {"dtype": "int64", "_type": "Value"},
}


def speculators_index(files: IndexFiles, rows: Iterable[Row]) -> None:
    """The ``datasets`` directory files (``save_to_disk`` layout: one Arrow stream of
    record batches, as ``datasets`` itself writes them) and ``token_freq.pt`` for the
    exported rows, given in row order ``0..n-1``; written a batch of rows at a time."""
    import io
    from collections import Counter

    import pyarrow as pa
    import torch

    meta = {b"huggingface": json.dumps({"info": {"features": _FEATURES}}).encode()}
    schema = pa.schema(
        [
            ("input_ids", pa.list_(pa.int64())),
            ("loss_mask", pa.list_(pa.int64())),
            ("seq_len", pa.int64()),
        ],
        metadata=meta,
    )
    freq: Counter[int] = Counter()
    n = 0
    with files.open("data-00000-of-00001.arrow") as f:
        sink = _Crc(f)
        with pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), schema) as w:
            for batch in _batches(rows):
                w.write_batch(_record_batch(batch, schema, freq))
                n += len(batch)
    state: dict[str, Any] = {
        "_data_files": [{"filename": "data-00000-of-00001.arrow"}],
        "_fingerprint": f"{sink.crc:08x}{n:08x}",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": "torch",
        "_output_all_columns": False,
        "_split": None,
    }
    info = {
        "citation": "",
        "description": "",
        "features": _FEATURES,
        "homepage": "",
        "license": "",
    }
    buf = io.BytesIO()
    torch.save(dict(freq), buf)
    for name, data in (
        ("dataset_info.json", json.dumps(info, indent=2).encode()),
        ("state.json", json.dumps(state, indent=2).encode()),
        ("token_freq.pt", buf.getvalue()),
    ):
        with files.open(name) as f:
            f.write(data)


def _batches(rows: Iterable[Row]) -> Iterator[list[Row]]:
    """``rows`` in lists of :data:`INDEX_BATCH` rows or :data:`INDEX_BATCH_TOKENS` tokens,
    checked to be numbered ``0..n-1``."""
    batch: list[Row] = []
    tokens = 0
    for want, r in enumerate(rows):
        if r.k != want:
            raise ValueError(f"speculators rows are not numbered 0..n-1 (row {r.k} at {want})")
        batch.append(r)
        tokens += len(r.input_ids) // 8
        if len(batch) == INDEX_BATCH or tokens >= INDEX_BATCH_TOKENS:
            yield batch
            batch, tokens = [], 0
    if batch:
        yield batch


def _record_batch(rows: list[Row], schema: Any, freq: Any) -> Any:
    """One Arrow record batch of the index from ``rows`` (their int64 bytes as they are, no
    Python int per token), and their loss tokens counted into ``freq``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    lens = [len(r.input_ids) // 8 for r in rows]
    if any(len(r.loss_mask) != len(r.input_ids) for r in rows):
        raise ValueError("a speculators row's loss mask is not as long as its ids")
    offsets = pa.array([0, *_cumsum(lens)], pa.int32())
    ids = _int64s(b"".join(r.input_ids for r in rows), sum(lens))
    mask = _int64s(b"".join(r.loss_mask for r in rows), sum(lens))
    counted = pc.value_counts(pc.filter(ids, pc.not_equal(mask, 0)))
    for v in counted.to_pylist():
        freq[v["values"]] += v["counts"]
    return pa.RecordBatch.from_arrays(
        [
            pa.ListArray.from_arrays(offsets, ids),
            pa.ListArray.from_arrays(offsets, mask),
            pa.array(lens, pa.int64()),
        ],
        schema=schema,
    )


def _cumsum(xs: list[int]) -> list[int]:
    out, t = [], 0
    for x in xs:
        t += x
        out.append(t)
    return out


def _int64s(data: bytes, n: int) -> Any:
    import pyarrow as pa

    return pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(data)])


class _Crc:
    """A file that CRCs what is written through it (the index's fingerprint)."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.crc = 0
        self.closed = False

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        self.crc = crc32(mv, self.crc)
        return self.f.write(mv)

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        self.closed = True  # the caller closes the file itself


#: Norm weights of the final norm, by where models keep them.
_NORM_KEYS = (
    "model.norm.weight",
    "model.language_model.norm.weight",
    "language_model.model.norm.weight",
    "transformer.ln_f.weight",
)


def final_norm_weight(model_dir: str) -> torch.Tensor:
    """The target's final norm weight as it multiplies (``1 + w`` for Gemma-style norms),
    read from its safetensors. Raises FileNotFoundError / KeyError naming what is missing."""
    from safetensors import safe_open

    index = os.path.join(model_dir, "model.safetensors.index.json")
    files: list[str] = []
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        files = [weight_map[k] for k in _NORM_KEYS if k in weight_map]
    if not files:
        files = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no safetensors weights (the final norm's weight)")
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    model_type = str(cfg.get("text_config", cfg).get("model_type", cfg.get("model_type", "")))
    for name in dict.fromkeys(files):
        with safe_open(os.path.join(model_dir, name), framework="pt") as st:
            for key in _NORM_KEYS:
                if key in st.keys():  # noqa: SIM118 - safe_open has keys(), not __contains__
                    w = cast("torch.Tensor", st.get_tensor(key).float())
                    return w + 1.0 if model_type.startswith("gemma") else w
    raise KeyError(f"{model_dir}: no final norm weight ({', '.join(_NORM_KEYS)})")


FORMATS = ("specforge", "speculators", "modelopt")


def make(name: str, model_dir: str, recipe: str = "eagle3") -> Exporter:
    """The exporter of a format for an output of ``recipe`` (``speculators`` reads the
    model's final norm; its layout, the layers then the last state, serves every recipe)."""
    if name == "specforge":
        return SpecForge(recipe)
    if name == "modelopt":
        return ModelOpt()
    if name == "speculators":
        return Speculators(final_norm_weight(model_dir))
    raise ValueError(f"--format: {name!r} is not one of {', '.join(FORMATS)}")


def row(k: int, sample: dict[str, Any]) -> Row:
    """The manifest's row of an exported sample."""
    import torch

    ids = sample["input_ids"].to(torch.int64).contiguous()
    mask = sample["loss_mask"].to(torch.int64).contiguous()
    return Row(k, bytes(samplefile.raw_bytes(ids)), bytes(samplefile.raw_bytes(mask)))
