"""The sample writer: ``torch.save``'s format, written without ``torch.save``."""

from __future__ import annotations

import io
import os
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from eagle3d.dumps.format import Dump
from eagle3d.remote import samplefile as ckpt
from eagle3d.store import archive, directio
from eagle3d.store.committer import Committer
from eagle3d.store.crc import file_checksum


def _sample(t: int, h: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(t * 1000 + h)
    return {
        "input_ids": torch.randint(0, 50_000, (t,), generator=g),
        "loss_mask": (torch.rand(t, generator=g) > 0.5).to(torch.int64),
        "hidden_state": torch.randn(1, t, h, generator=g).to(dtype),
        "aux_hidden_state": torch.randn(1, t, 3 * h, generator=g).to(dtype),
    }


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 7, 163])
def test_data_pkl_is_byte_for_byte_torch_saves(t: int, dtype: torch.dtype) -> None:
    sample = _sample(t, 64, dtype)
    buf = io.BytesIO()
    torch.save(sample, buf)
    theirs = zipfile.ZipFile(io.BytesIO(buf.getvalue())).read("archive/data.pkl")
    assert ckpt.data_pkl(sample) == theirs


@pytest.mark.parametrize("name", sorted(ckpt.DTYPES))
def test_every_dtype_pickles_as_torch_saves_it(name: str) -> None:
    """The record is written without torch (stand-ins for its classes and functions): for
    each dtype of the table, the bytes torch.save writes, sizes and repeats included."""
    dtype = getattr(torch, name)
    sample = {
        "a": torch.zeros(5, dtype=torch.int64),
        "b": torch.zeros(1, 3, 4).to(dtype),
        "c": torch.zeros(300, 2).to(dtype),
    }
    buf = io.BytesIO()
    torch.save(sample, buf)
    theirs = zipfile.ZipFile(io.BytesIO(buf.getvalue())).read("archive/data.pkl")
    assert ckpt.data_pkl(sample) == theirs
    assert ckpt.DTYPES[name][0] == dtype.itemsize


def test_the_dtype_table_names_torchs_storage_classes() -> None:
    theirs = {
        ckpt.dtype_name(d): cls for d, cls in torch.storage._dtype_to_storage_type_map().items()
    }
    for name, (_, cls) in ckpt.DTYPES.items():
        assert theirs.get(name, "") == cls, name


def test_a_plan_is_the_file_torch_tensors_give(tmp_path: Path) -> None:
    """:func:`ckpt.plan` (dtype names and shapes, no tensors) lays out the file
    :func:`ckpt.write` writes from real tensors of those shapes, byte for byte but for the
    serialization id."""
    sample = _sample(37, 64, torch.bfloat16)
    spec = tuple((k, ckpt.dtype_name(v.dtype), tuple(v.shape)) for k, v in sample.items())
    p = ckpt.plan(spec)
    buf = bytearray(p.total)
    mv = memoryview(buf)
    ckpt.fill(p, mv)
    for (at, n), t in zip(p.slots, sample.values(), strict=True):
        mv[at : at + n] = ckpt.raw_bytes(t)
    sealed = ckpt.seal(p, mv)
    path = tmp_path / "s.ckpt"
    written = _write(path, sample)
    theirs = path.read_bytes()
    assert (sealed.nbytes, len(buf)) == (written.nbytes, len(theirs))
    ours, theirs_zip = zipfile.ZipFile(io.BytesIO(buf)), zipfile.ZipFile(io.BytesIO(theirs))
    assert ours.testzip() is None and zlib.crc32(buf) == sealed.crc
    layout = [(i.filename, i.header_offset, i.file_size) for i in ours.infolist()]
    assert layout == [(i.filename, i.header_offset, i.file_size) for i in theirs_zip.infolist()]
    for name, *_ in layout:
        if not name.endswith("serialization_id"):
            assert ours.read(name) == theirs_zip.read(name), name
    loaded = torch.load(io.BytesIO(buf), weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in sample.items())


def test_data_pkl_cached_by_shape_keeps_each_tensors_own_strides() -> None:
    """The record is cached by names, dtypes, shapes and strides. A size-1 dimension may
    have any stride in a contiguous tensor and torch.save records the one it has, so two
    such tensors of one shape must not share a cached record."""
    plain = {"x": torch.zeros(3, 1)}
    strided = {"x": torch.zeros(1, 3).t()}  # shape (3, 1), stride (1, 3): contiguous too
    assert strided["x"].is_contiguous() and strided["x"].stride() != plain["x"].stride()
    for sample in (plain, strided, plain, strided):  # the second time from the cache
        buf = io.BytesIO()
        torch.save(sample, buf)
        theirs = zipfile.ZipFile(io.BytesIO(buf.getvalue())).read("archive/data.pkl")
        assert ckpt.data_pkl(sample) == theirs
    assert ckpt._data_pkl.cache_info().hits >= 2


def _write(path: Path, sample: dict[str, torch.Tensor]) -> ckpt.Written:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        return archive.write(fd, sample)
    finally:
        os.close(fd)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_load_reads_it_every_way(dtype: torch.dtype, tmp_path: Path) -> None:
    sample = _sample(163, 256, dtype)
    path = tmp_path / "data_0.ckpt"
    w = _write(path, sample)
    assert w.nbytes == path.stat().st_size
    assert f"crc32:{w.crc:08x}" == file_checksum(str(path))[1]  # the journal's checksum
    for kwargs in ({}, {"weights_only": True}, {"mmap": True, "weights_only": True}):
        got: dict[str, Any] = torch.load(path, **kwargs)
        assert list(got) == list(sample)
        for k, v in sample.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert torch.equal(got[k], v), k


def test_it_is_a_valid_zip_with_aligned_data_records(tmp_path: Path) -> None:
    sample = _sample(31, 64, torch.bfloat16)
    path = tmp_path / "s.ckpt"
    _write(path, sample)
    buf = io.BytesIO()
    torch.save(sample, buf)
    theirs = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # every record's CRC checks out (what `unzip -t` does)
        assert z.namelist() == theirs.namelist()  # the same records, in the same order
        for name in z.namelist():
            assert z.read(name) == theirs.read(name) or name.endswith("serialization_id")
        raw = path.read_bytes()
        for info in z.infolist():
            name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
            start = info.header_offset + 30 + name_len + extra_len
            assert start % ckpt.ALIGN == 0, info.filename


def test_short_writes_are_continued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.writev

    def at_most_1000_bytes(fd: int, buffers: Any) -> int:
        left, cut = 1000, []
        for b in buffers:
            cut.append(memoryview(b)[:left])
            left -= len(cut[-1])
            if not left:
                break
        return real(fd, cut)

    monkeypatch.setattr(os, "writev", at_most_1000_bytes)
    sample = _sample(50, 64, torch.float32)
    path = tmp_path / "s.ckpt"
    _write(path, sample)
    got = torch.load(path)
    assert all(torch.equal(got[k], v) for k, v in sample.items())


def test_what_it_does_not_take() -> None:
    sample = _sample(5, 8, torch.float32)
    assert ckpt.fits(sample)
    assert not ckpt.fits({**sample, "hidden_state": sample["aux_hidden_state"][..., ::3]})
    assert not ckpt.fits({**sample, "hidden_state": torch.zeros(2, requires_grad=True)})
    assert not ckpt.fits({**sample, "x": torch.zeros(2, dtype=torch.uint16)})


def _dump(t: int, h: int) -> Dump:
    s = _sample(t, h, torch.float32)
    return Dump("r", [2, 4, 5], s["input_ids"], s["aux_hidden_state"][0], s["hidden_state"][0], 0)


def test_committer_uses_torch_save_beyond_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Archives of 4 GiB and more need zip64 records: those go through torch.save. Shown
    here by lowering the limit, with both files read back and checksummed."""
    dump = _dump(40, 32)
    ids, mask = dump.input_ids.tolist(), [1] * 40
    small = Committer(str(tmp_path / "small")).commit(3, ids, mask, dump)
    monkeypatch.setattr(ckpt, "_LIMIT", 1000)
    big = Committer(str(tmp_path / "big")).commit(3, ids, mask, dump)
    for out, done in ((tmp_path / "small", small), (tmp_path / "big", big)):
        path = out / done.relpath
        assert file_checksum(str(path)) == (done.nbytes, done.checksum)
        got = torch.load(path)
        assert torch.equal(got["hidden_state"][0], dump.hidden_state)
        assert torch.equal(got["aux_hidden_state"][0], dump.aux_hidden_state)
        assert got["input_ids"].tolist() == ids and got["loss_mask"].tolist() == mask
    assert small.nbytes != big.nbytes  # really two writers (torch's adds zip64 records)


def test_direct_buffer_grows_while_an_old_view_is_still_held() -> None:
    buf = directio.DirectBuffer()
    old = buf.view(10)
    assert len(old) == directio.BLOCK and buf.size == 1 << 20
    new = buf.view((1 << 20) + 1)  # must not fail on the view still held above
    assert len(new) == (1 << 20) + directio.BLOCK
    old[0] = 7  # the old mapping stays valid for whoever still holds it
    assert old[0] == 7


@pytest.mark.parametrize("t", [1, 31, 163, 1000])
def test_the_file_ends_on_a_block_boundary_padded_by_the_zip_comment(
    t: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A direct write of whole blocks is then the whole file: no ftruncate, which on ext4
    read the file's last block back from the disk after every direct write."""
    truncated = []
    monkeypatch.setattr(os, "ftruncate", lambda fd, n: truncated.append(n))
    sample = _sample(t, 64, torch.float32)
    path = tmp_path / "s.ckpt"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        w = archive.write(fd, sample, direct=directio.DirectBuffer())
    finally:
        os.close(fd)
    assert truncated == []
    assert w.nbytes % directio.BLOCK == 0 and path.stat().st_size == w.nbytes
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
        assert set(z.comment) <= {ord(" ")} and len(z.comment) < directio.BLOCK
    for kwargs in ({}, {"weights_only": True}, {"mmap": True, "weights_only": True}):
        got = torch.load(path, **kwargs)
        assert all(torch.equal(got[k], v) for k, v in sample.items())


def test_flush_direct_cuts_data_that_does_not_fill_its_last_block(tmp_path: Path) -> None:
    buf = directio.DirectBuffer()
    view = buf.view(5000)
    view[:5000] = b"x" * 5000
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        directio.flush_direct(fd, view, 5000)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"x" * 5000
