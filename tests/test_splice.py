"""eagle3d.store.splice for v1 (safetensors) dumps: a dump's bytes straight into the sample
archive, the general path's file and the general path's verdict on every dump (v2 dumps:
tests/test_sample_dumps.py)."""

from __future__ import annotations

import fcntl
import json
import os
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from eagle3d.dumps.format import BadDump, Dump, DumpVanished, read_dump, read_header
from eagle3d.remote import samplefile as ckpt
from eagle3d.remote.dumpfile import write_dump
from eagle3d.store import archive, directio, splice
from eagle3d.store import committer as commit
from eagle3d.store.committer import CommitError, Committed, Committer
from eagle3d.store.crc import file_checksum

H = 32
LAYERS = [2, 4, 5]
V1 = "safetensors"


def _dump_file(d: Path, t: int, dtype: torch.dtype = torch.float32, **change: Any) -> str:
    g = torch.Generator().manual_seed(t)
    ids = change.get("ids", torch.arange(t))
    aux = change.get("aux", torch.randn(t, 3 * H, generator=g).to(dtype))
    hid = change.get("hid", torch.randn(t, H, generator=g).to(dtype))
    return write_dump(str(d), f"r{t}", ids, aux, hid, change.get("layers", LAYERS), layout=V1)


def _stage(path: str, t: int, limit: int = 1 << 30) -> splice.Staged | None:
    mask = [k % 2 for k in range(t)]
    return splice.stage(path, list(range(t)), mask, H, LAYERS, directio.DirectBuffer(), limit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 7, 163])
def test_the_archive_is_byte_for_byte_the_general_paths(
    t: int, dtype: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The serialization id is the one random part of a file: fix it for both.
    monkeypatch.setattr(os, "urandom", lambda n: b"\x07" * n)
    path = _dump_file(tmp_path, t, dtype)
    staged = _stage(path, t)
    assert staged is not None
    ours = bytes(staged.view[: staged.written.nbytes])
    d = read_dump(path)
    payload = {
        "input_ids": torch.arange(t),
        "loss_mask": torch.tensor([k % 2 for k in range(t)]),
        "hidden_state": d.hidden_state.unsqueeze(0),
        "aux_hidden_state": d.aux_hidden_state.unsqueeze(0),
    }
    fd = os.open(tmp_path / "general.ckpt", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        general = archive.write(fd, payload)
    finally:
        os.close(fd)
    assert ours == (tmp_path / "general.ckpt").read_bytes()
    assert staged.written == general  # size, and the file's CRC-32 (the journal's checksum)
    (tmp_path / "ours.ckpt").write_bytes(ours)
    assert zipfile.ZipFile(tmp_path / "ours.ckpt").testzip() is None  # every record's CRC
    got = torch.load(tmp_path / "ours.ckpt", weights_only=True)
    for k, v in payload.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_slot_read_in_many_chunks_is_checked_and_checksummed_whole(
    dtype: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The NaN/Inf check and the CRC-32 run chunk by chunk within the read: a file read in
    a dozen chunks is the one read at once, and a NaN in the last chunk is still found."""
    monkeypatch.setattr(os, "urandom", lambda n: b"\x07" * n)  # the serialization id
    t = 163
    path = _dump_file(tmp_path, t, dtype)
    whole = _stage(path, t)
    assert whole is not None
    monkeypatch.setattr(splice, "CHECK_CHUNK", 4096)
    chunked = _stage(path, t)
    assert chunked is not None
    assert chunked.written.nbytes == whole.written.nbytes
    assert bytes(chunked.view[: chunked.written.nbytes]) == bytes(
        whole.view[: whole.written.nbytes]
    )
    (tmp_path / "chunked.ckpt").write_bytes(bytes(chunked.view[: chunked.written.nbytes]))
    assert zipfile.ZipFile(tmp_path / "chunked.ckpt").testzip() is None  # records' CRCs
    assert file_checksum(str(tmp_path / "chunked.ckpt"))[1] == f"crc32:{chunked.written.crc:08x}"
    aux = read_dump(path).aux_hidden_state.clone()
    aux[-1, -1] = float("nan")
    (tmp_path / "bad").mkdir()
    bad = _dump_file(tmp_path / "bad", t, dtype, aux=aux)
    assert _stage(bad, t) is None


def _nan(t: int, dtype: torch.dtype) -> Any:
    x = torch.randn(t, H).to(dtype)
    x[t // 2, 3] = float("nan")
    return x


BAD: dict[str, Any] = {
    "ids differ": lambda t: {"ids": torch.arange(t) + (torch.arange(t) == t - 1)},
    "NaN in hidden_state": lambda t: {"hid": _nan(t, torch.float32)},
    "NaN in bf16": lambda t: {
        "hid": _nan(t, torch.bfloat16),
        "aux": torch.zeros(t, 3 * H).bfloat16(),
    },
    "Inf in aux_hidden_state": lambda t: {"aux": torch.full((t, 3 * H), float("inf"))},
    "aux cut short": lambda t: {"aux": torch.zeros(t - 1, 3 * H)},
    "two layers": lambda t: {"aux": torch.zeros(t, 2 * H), "layers": [2, 4]},
    "other layers": lambda t: {"layers": [1, 4, 5]},
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_dump_goes_to_the_general_path_which_names_the_problem(
    case: str, tmp_path: Path
) -> None:
    t = 9
    path = _dump_file(tmp_path, t, **BAD[case](t))
    assert _stage(path, t) is None
    # The general path's own verdict, word for word, is what commit_files reports.
    with pytest.raises(BadDump) as general:
        commit.validate(read_dump(path), list(range(t)), H, LAYERS)
    c = Committer(str(tmp_path / "out"))
    (result,) = c.commit_files([(0, list(range(t)), [1] * t, path)], H, LAYERS)
    assert isinstance(result, BadDump) and str(result) == str(general.value)
    assert not (tmp_path / "out" / "rows_0-2000" / "data_0.ckpt").exists()


def test_a_truncated_or_garbled_dump_is_worded_by_the_general_path(tmp_path: Path) -> None:
    t = 9
    cut = Path(_dump_file(tmp_path, t))
    os.truncate(cut, cut.stat().st_size - 100)
    garbled = tmp_path / "g.e3dump"
    garbled.write_bytes(struct.pack("<Q", 20) + b"{not json at all!!!}" + b"\0" * 64)
    c = Committer(str(tmp_path / "out"))
    for path in (cut, garbled):
        assert _stage(str(path), t) is None
        (result,) = c.commit_files([(0, list(range(t)), [1] * t, str(path))], H, LAYERS)
        assert isinstance(result, BadDump) and not isinstance(result, DumpVanished)
        assert path.name in str(result) and "unreadable dump" in str(result)


def test_a_vanished_dump_is_dumpvanished(tmp_path: Path) -> None:
    gone = str(tmp_path / "gone.e3dump")
    with pytest.raises(DumpVanished):
        _stage(gone, 3)
    (result,) = Committer(str(tmp_path / "out")).commit_files(
        [(0, [1, 2, 3], [1] * 3, gone)], H, LAYERS
    )
    assert isinstance(result, DumpVanished)
    assert str(result) == "gone.e3dump vanished before it was read"


@pytest.mark.parametrize(
    "dtypes", [(torch.float64, torch.float64), (torch.float16, torch.float32)], ids=str
)
def test_dtypes_it_does_not_handle_are_committed_by_the_general_path(
    dtypes: tuple[torch.dtype, torch.dtype], tmp_path: Path
) -> None:
    t = 5
    g = torch.Generator().manual_seed(0)
    hid = torch.randn(t, H, generator=g).to(dtypes[0])
    aux = torch.randn(t, 3 * H, generator=g).to(dtypes[1])
    path = write_dump(str(tmp_path), "other", torch.arange(t), aux, hid, LAYERS, layout=V1)
    assert _stage(path, t) is None
    (r,) = Committer(str(tmp_path / "out")).commit_files(
        [(3, list(range(t)), [1] * t, path)], H, LAYERS
    )
    assert isinstance(r, Committed)
    got = torch.load(tmp_path / "out" / r.relpath, weights_only=True)
    assert torch.equal(got["hidden_state"][0], hid) and torch.equal(got["aux_hidden_state"][0], aux)


def test_an_archive_over_the_limit_goes_to_the_general_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = 50
    path = _dump_file(tmp_path, t)
    assert _stage(path, t, limit=100_000) is not None
    assert _stage(path, t, limit=10_000) is None
    monkeypatch.setattr(commit, "DIRECT_MAX", 10_000)
    (r,) = Committer(str(tmp_path / "out")).commit_files(
        [(0, list(range(t)), [1] * t, path)], H, LAYERS
    )
    assert isinstance(r, Committed)
    assert file_checksum(str(tmp_path / "out" / r.relpath)) == (r.nbytes, r.checksum)


@pytest.mark.parametrize("direct", [True, False])
def test_commit_files_commits_the_good_and_refuses_the_bad_in_one_batch(
    direct: bool, tmp_path: Path
) -> None:
    good = [_dump_file(tmp_path, t) for t in (3, 40, 163)]
    bad = _dump_file(tmp_path, 11, hid=_nan(11, torch.float32))
    gone = str(tmp_path / "gone.e3dump")
    samples = [
        (0, list(range(3)), [0, 1, 1], good[0]),
        (1, list(range(11)), [1] * 11, bad),
        (2, list(range(40)), [1] * 40, good[1]),
        (3, [1, 2], [1, 1], gone),
        (4, list(range(163)), [1] * 163, good[2]),
    ]
    out = tmp_path / "out"
    results = Committer(str(out), direct=direct).commit_files(samples, H, LAYERS)
    assert [type(r) for r in results] == [Committed, BadDump, Committed, DumpVanished, Committed]
    for (idx, ids, mask, path), r in zip(samples, results, strict=True):
        final = out / "rows_0-2000" / f"data_{idx}.ckpt"
        if not isinstance(r, Committed):
            assert not final.exists()
            continue
        assert file_checksum(str(final)) == (r.nbytes, r.checksum)
        d = read_dump(path)
        got = torch.load(final, weights_only=True)
        assert got["input_ids"].tolist() == ids and got["loss_mask"].tolist() == mask
        assert torch.equal(got["hidden_state"][0], d.hidden_state)
        assert torch.equal(got["aux_hidden_state"][0], d.aux_hidden_state)
    assert [p.name for p in (out / "rows_0-2000").iterdir() if p.name.startswith(".")] == []


def test_a_direct_write_refused_midway_is_redone_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.pwrite
    refused = []

    def refusing(fd: int, data: memoryview, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            if offset > 0:  # say, a device wanting another alignment
                refused.append(offset)
                raise OSError(22, "Invalid argument")
            return real(fd, memoryview(data)[:4096], offset)
        return real(fd, data, offset)

    path = _dump_file(tmp_path, 300)
    c = Committer(str(tmp_path / "out"))
    monkeypatch.setattr(os, "pwrite", refusing)
    (r,) = c.commit_files([(8, list(range(300)), [1] * 300, path)], H, LAYERS)
    assert refused == [4096] and c.direct is False
    assert isinstance(r, Committed)
    assert file_checksum(str(tmp_path / "out" / r.relpath)) == (r.nbytes, r.checksum)
    got = torch.load(tmp_path / "out" / r.relpath, weights_only=True)
    assert torch.equal(got["hidden_state"][0], read_dump(path).hidden_state)


def test_a_full_disk_is_a_commit_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _dump_file(tmp_path, 20)

    def full(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    (r,) = Committer(str(tmp_path / "out")).commit_files(
        [(0, list(range(20)), [1] * 20, path)], H, LAYERS
    )
    assert isinstance(r, CommitError) and r.errno == 28
    assert list((tmp_path / "out" / "rows_0-2000").iterdir()) == []  # no temp file left


def test_finite_decides_an_overflowing_sum_exactly() -> None:
    x = torch.full((1000,), 3e38, dtype=torch.float32)
    raw = ckpt.raw_bytes(x)
    assert splice.finite(raw, "F32")  # the sum is inf; every element is finite
    x[500] = float("-inf")
    assert not splice.finite(ckpt.raw_bytes(x), "F32")
    for name, dtype in (("BF16", torch.bfloat16), ("F16", torch.float16)):
        y = torch.ones(100, dtype=dtype)
        assert splice.finite(ckpt.raw_bytes(y), name)
        y[99] = float("nan")
        assert not splice.finite(ckpt.raw_bytes(y), name)


def test_read_header_refuses_what_is_not_a_safetensors_header(tmp_path: Path) -> None:
    def header_of(data: bytes) -> None:
        p = tmp_path / "x"
        p.write_bytes(data)
        fd = os.open(p, os.O_RDONLY)
        try:
            read_header(fd)
        finally:
            os.close(fd)

    meta = {"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    text = json.dumps(meta).encode()
    header_of(struct.pack("<Q", len(text)) + text + b"\0" * 16)  # well formed: no error
    cases = {
        "truncated: 3 bytes": b"abc",
        "header of 1000 bytes in a file of 12": struct.pack("<Q", 1000) + b"abcd",
        "garbled header": struct.pack("<Q", 4) + b"{{{{",
        "beyond the end": struct.pack("<Q", len(text)) + text + b"\0" * 15,
    }
    for words, data in cases.items():
        with pytest.raises(BadDump, match=words):
            header_of(data)


def test_a_long_header_is_read_past_the_first_page(tmp_path: Path) -> None:
    meta = {
        "__metadata__": {"pad": "x" * 6000},
        "t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    }
    text = json.dumps(meta).encode()
    p = tmp_path / "long"
    p.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 8)
    fd = os.open(p, os.O_RDONLY)
    try:
        h = read_header(fd)
    finally:
        os.close(fd)
    assert h.meta["pad"] == "x" * 6000
    assert h.tensors["t"] == ("F32", (2,), 8 + len(text), 16 + len(text))


def test_commit_many_still_takes_loaded_dumps(tmp_path: Path) -> None:
    d = Dump("r", LAYERS, torch.arange(4), torch.zeros(4, 3 * H), torch.ones(4, H), 0)
    (r,) = Committer(str(tmp_path)).commit_many([(0, [0, 1, 2, 3], [1] * 4, d)])
    assert isinstance(r, Committed)


@pytest.mark.parametrize(("writer", "splice"), [("archive", False), ("torch", True)])
def test_every_writer_gives_the_same_sample(writer: str, splice: bool, tmp_path: Path) -> None:
    """The general path (``splice=False``) and the reference writer (``torch.save``) write
    the sample the splice fast path writes: the same tensors, read back by ``torch.load``."""
    t = 40
    mask = [k % 2 for k in range(t)]
    (d1 := tmp_path / "d1").mkdir()
    (d2 := tmp_path / "d2").mkdir()
    fast = Committer(str(tmp_path / "fast"))
    other = Committer(str(tmp_path / "other"), writer=writer, splice=splice)
    (a,) = fast.commit_files([(0, list(range(t)), mask, _dump_file(d1, t))], H, LAYERS)
    (b,) = other.commit_files([(0, list(range(t)), mask, _dump_file(d2, t))], H, LAYERS)
    assert isinstance(a, Committed) and isinstance(b, Committed), (a, b)
    x = torch.load(tmp_path / "fast" / a.relpath, weights_only=True)
    y = torch.load(tmp_path / "other" / b.relpath, weights_only=True)
    assert x.keys() == y.keys() == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
    for k in x:
        assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k
    assert file_checksum(str(tmp_path / "other" / b.relpath)) == (b.nbytes, b.checksum)
    if writer == "torch":  # torch's own zip writer, not ours: its files differ, not its data
        with zipfile.ZipFile(tmp_path / "other" / b.relpath) as z:
            assert z.testzip() is None


def test_an_unknown_writer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="writer must be one of archive, torch"):
        Committer(str(tmp_path), writer="fast")
