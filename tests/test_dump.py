"""The dump file in its v1 layout: written by our safetensors writer, read by safetensors
itself (the v2 layout, the sample file: tests/test_sample_dumps.py)."""

from __future__ import annotations

import itertools
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from eagle3d.dumps.format import BadDump, DumpVanished, read_dump
from eagle3d.remote.dumpfile import FORMAT, write_dump
from safetensors import safe_open
from safetensors.torch import load_file

V1 = "safetensors"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_dump_reads_back_with_safetensors(dtype: torch.dtype, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (37,), generator=g)
    aux = torch.randn(37, 96, generator=g).to(dtype)
    hid = torch.randn(37, 32, generator=g).to(dtype)
    path = write_dump(str(tmp_path), "r-1", ids, aux, hid, [2, 4, 5], layout=V1)
    assert path == str(tmp_path / "r-1.e3dump")
    assert not list(tmp_path.glob(".*"))  # the temp name is gone
    got = load_file(path)  # safetensors' own reader
    assert torch.equal(got["input_ids"], ids)
    assert torch.equal(got["aux_hidden_state"], aux) and got["aux_hidden_state"].dtype == dtype
    assert torch.equal(got["hidden_state"], hid)
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    want_dtype = str(dtype).removeprefix("torch.")
    assert meta == {"format": FORMAT, "rid": "r-1", "layers": "2,4,5", "dtype": want_dtype}
    d = read_dump(path)
    assert (d.rid, d.layers, d.nbytes) == ("r-1", [2, 4, 5], Path(path).stat().st_size)


def test_the_header_follows_the_format(tmp_path: Path) -> None:
    """8-byte length, JSON header padded so the data starts 8-byte aligned, offsets that
    tile the data exactly."""
    ids, aux, hid = torch.arange(5), torch.zeros(5, 12), torch.zeros(5, 4)
    raw = Path(write_dump(str(tmp_path), "x", ids, aux, hid, [1, 2, 3], layout=V1)).read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    assert (8 + n) % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and spans[-1][1] == len(raw) - 8 - n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_a_slice_of_a_batch_is_written_alone(tmp_path: Path) -> None:
    """The worker writes each sample's cut of the batch: only that cut reaches the file."""
    batch = torch.randn(3, 50, 8)
    for layout in ("safetensors", "sample"):
        path = write_dump(
            str(tmp_path),
            "s",
            torch.arange(20),
            batch[1, :20, :6],
            batch[1, :20],
            [1],
            layout=layout,
        )
        got = read_dump(path)
        assert torch.equal(got.aux_hidden_state, batch[1, :20, :6]), layout
        assert torch.equal(got.hidden_state, batch[1, :20]), layout


def test_a_dump_gone_before_it_is_read_is_told_from_a_bad_one(tmp_path: Path) -> None:
    """A missing file is a DumpVanished (the daemon resends it as DumpLost); a cut one is a
    plain BadDump."""
    with pytest.raises(DumpVanished, match=r"gone\.e3dump vanished before it was read"):
        read_dump(str(tmp_path / "gone.e3dump"))
    path = Path(
        write_dump(
            str(tmp_path), "cut", torch.arange(4), torch.zeros(4, 6), torch.zeros(4, 2), [1, 2, 3]
        )
    )
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(BadDump) as e:
        read_dump(str(path))
    assert not isinstance(e.value, DumpVanished)


def test_the_daemons_dumps_are_0640_and_the_sglang_hooks_0644(tmp_path: Path) -> None:
    """The daemon's own dumps give nothing to others; the SGLang hook's stay readable to a
    daemon of another user (who reaches them is the dump folder's mode: docs/sglang.md)."""
    from eagle3d.remote.sglang_writer import DumpAssembler

    ids, aux, hid = torch.arange(3), torch.zeros(3, 12), torch.zeros(3, 4)
    own = write_dump(str(tmp_path), "a", ids, aux, hid, [1, 2, 3])
    assert os.stat(own).st_mode & 0o777 == 0o640
    hook = DumpAssembler(str(tmp_path), [1, 2, 3]).write(
        str(tmp_path), "b", ids, aux, hid, [1, 2, 3]
    )
    assert os.stat(hook).st_mode & 0o777 == 0o644
