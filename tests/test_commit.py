"""eagle3d.store.committer: the finite check, and committing a batch of samples."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from eagle3d.dumps.format import BadDump, ContractBroken, Dump
from eagle3d.store.committer import CommitError, Committed, Committer
from eagle3d.store.crc import file_checksum
from eagle3d.store.validate import all_finite, finite_bits, validate


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_all_finite_finds_every_nan_and_inf(dtype: torch.dtype) -> None:
    x = torch.randn(163, 768).to(dtype)
    assert all_finite(x)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for pos in ((0, 0), (81, 400), (162, 767)):
            y = x.clone()
            y[pos] = bad
            assert not all_finite(y), (bad, pos)


@pytest.mark.parametrize(
    ("np_dtype", "finite", "bad"),
    [
        # bfloat16: the largest finite values, -0 and the smallest negative subnormal;
        # +-Inf, NaNs of either sign.
        ("int16", [0x7F7F, 0xFF7F, 0x8000, 0x8001, 0], [0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0xFFFF]),
        ("int16-f16", [0x7BFF, 0xFBFF, 0x8000], [0x7C00, 0xFC00, 0x7E00, 0xFE00]),
        ("int32", [0x7F7FFFFF, 0xFF7FFFFF, 0x80000000], [0x7F800000, 0xFF800000, 0xFFC00000]),
    ],
)
def test_finite_bits_at_the_edges_of_the_exponent(
    np_dtype: str, finite: list[int], bad: list[int]
) -> None:
    import numpy as np

    name, mask = {
        "int16": ("int16", 0x7F80),
        "int16-f16": ("int16", 0x7C00),
        "int32": ("int32", 0x7F800000),
    }[np_dtype]
    unsigned = np.dtype(name.replace("int", "uint"))
    ok = np.array(finite, dtype=unsigned).view(name)
    assert finite_bits(ok, mask)
    for b in bad:
        for pos in (0, 5, 9):  # first chunk, a later chunk, the last element
            x = np.zeros(10, dtype=unsigned)
            x[:] = finite[0]
            x[pos] = b
            assert not finite_bits(x.view(name), mask, chunk=4), (hex(b), pos)


def test_all_finite_with_an_overflowing_sum_of_finite_values() -> None:
    # The fast path's sum overflows to inf here; the exact check must still say finite.
    x = torch.full((1000,), 3e38, dtype=torch.float32)
    assert torch.isinf(x.sum())
    assert all_finite(x)
    x[500] = float("inf")
    assert not all_finite(x)
    # +inf and -inf cancel to NaN in a sum: still caught.
    x[501] = float("-inf")
    assert not all_finite(x)


def _dump(t: int, h: int = 32) -> Dump:
    g = torch.Generator().manual_seed(t)
    return Dump(
        rid=f"r{t}",
        layers=[2, 4, 5],
        input_ids=torch.arange(t),
        aux_hidden_state=torch.randn(t, 3 * h, generator=g),
        hidden_state=torch.randn(t, h, generator=g),
        nbytes=0,
    )


def test_commit_many_syncs_each_row_directory_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real = os.fsync

    def counting(fd: int) -> None:  # row folders are synced by descriptor
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    c = Committer(str(tmp_path))
    ids = [3, 4, 1999, 2000, 2001]  # two row directories
    samples = [(i, list(range(5 + k)), [1] * (5 + k), _dump(5 + k)) for k, i in enumerate(ids)]
    synced.clear()
    results = c.commit_many(samples)
    assert all(isinstance(r, Committed) for r in results)
    rows = [s for s in synced if os.path.basename(s).startswith("rows_")]
    assert sorted(map(os.path.basename, rows)) == ["rows_0-2000", "rows_2000-4000"]
    for (_, input_ids, _, d), r in zip(samples, results, strict=True):
        assert isinstance(r, Committed)
        path = tmp_path / r.relpath
        assert file_checksum(str(path)) == (r.nbytes, r.checksum)
        got = torch.load(path, weights_only=True)
        assert got["input_ids"].tolist() == input_ids
        assert torch.equal(got["aux_hidden_state"][0], d.aux_hidden_state)
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]


def test_commit_many_one_failure_leaves_the_others_committed(tmp_path: Path) -> None:
    c = Committer(str(tmp_path))
    # A directory squatting on sample 1's final name makes its rename fail (EISDIR).
    (tmp_path / "rows_0-2000" / "data_1.ckpt").mkdir(parents=True)
    samples = [(i, [1, 2, 3], [0, 1, 1], _dump(3)) for i in (0, 1, 2)]
    r0, r1, r2 = c.commit_many(samples)
    assert isinstance(r0, Committed) and isinstance(r2, Committed)
    assert isinstance(r1, CommitError) and "sample 1" in str(r1)
    assert (tmp_path / r0.relpath).is_file() and (tmp_path / r2.relpath).is_file()
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]  # its temp file is gone
    with pytest.raises(CommitError):
        c.commit(1, [1, 2, 3], [0, 1, 1], _dump(3))


def _sample_ok(root: Path, r: Committed | CommitError, d: Dump, ids: list[int]) -> None:
    assert isinstance(r, Committed)
    path = root / r.relpath
    assert file_checksum(str(path)) == (r.nbytes, r.checksum)
    assert path.stat().st_size == r.nbytes
    got = torch.load(path, weights_only=True)
    assert got["input_ids"].tolist() == ids
    assert torch.equal(got["hidden_state"][0], d.hidden_state)
    assert torch.equal(got["aux_hidden_state"][0], d.aux_hidden_state)


@pytest.mark.parametrize("t", [1, 5, 163, 1000])
def test_direct_and_buffered_writes_give_the_same_sample(t: int, tmp_path: Path) -> None:
    d = _dump(t)
    ids = list(range(t))
    rd = Committer(str(tmp_path / "d"), direct=True).commit(0, ids, [1] * t, d)
    rb = Committer(str(tmp_path / "b"), direct=False).commit(0, ids, [1] * t, d)
    _sample_ok(tmp_path / "d", rd, d, ids)
    _sample_ok(tmp_path / "b", rb, d, ids)
    assert rd.nbytes == rb.nbytes  # the same archive; only its serial id differs


def test_a_filesystem_refusing_direct_io_at_open_gets_buffered_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.open

    def no_direct(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")  # as an older kernel's tmpfs does
        return real(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", no_direct)
    c = Committer(str(tmp_path))
    d = _dump(50)
    r = c.commit(7, list(range(50)), [1] * 50, d)
    assert c.direct is False
    _sample_ok(tmp_path, r, d, list(range(50)))


def test_a_direct_write_refused_midway_is_redone_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.pwrite
    calls = []

    def refusing(fd: int, data: memoryview, offset: int) -> int:
        calls.append(offset)
        if offset > 0:
            raise OSError(22, "Invalid argument")  # say, a device wanting other alignment
        return real(fd, memoryview(data)[:4096], offset)

    monkeypatch.setattr(os, "pwrite", refusing)
    c = Committer(str(tmp_path))
    d = _dump(300)
    r = c.commit(8, list(range(300)), [1] * 300, d)
    assert calls[:2] == [0, 4096] and c.direct is False
    _sample_ok(tmp_path, r, d, list(range(300)))


# (case, the dump's layers, tokens, aux width, hidden width) -> the class of the refusal and
# words of its message; the job sends 4 tokens and captures layers [1, 3, 5] of hidden size 8.
CONTRACT = [
    ("as the job wants", [1, 3, 5], 4, 24, 8, None, ""),
    ("no layer names, widths right", [], 4, 24, 8, None, ""),
    ("other layer ids", [1, 2, 5], 4, 24, 8, ContractBroken, "layers [1, 2, 5] (3)"),
    ("one layer fewer", [1, 3], 4, 16, 8, ContractBroken, "layers [1, 3] (2)"),
    ("one layer fewer, unnamed", [], 4, 16, 8, ContractBroken, "2 layers of hidden size 8"),
    ("another hidden size", [], 4, 48, 16, ContractBroken, "hidden size is 16"),
    ("a token short (the sample's)", [1, 3, 5], 3, 24, 8, BadDump, "sent 4 tokens"),
]


@pytest.mark.parametrize(
    ("case", "layers", "t", "aux_w", "hid_w", "kind", "words"),
    CONTRACT,
    ids=[c[0] for c in CONTRACT],
)
def test_a_dump_off_the_capture_contract_is_the_producers_fault(
    case: str, layers: list[int], t: int, aux_w: int, hid_w: int, kind: type | None, words: str
) -> None:
    """Layers (ids or count) or a hidden size not the job's: ContractBroken, naming what was
    expected and found; a dump cut along its tokens stays the sample's BadDump."""
    dump = Dump("r", layers, torch.arange(t), torch.zeros(t, aux_w), torch.zeros(t, hid_w), 0)
    if kind is None:
        validate(dump, [0, 1, 2, 3], 8, [1, 3, 5])
        return
    with pytest.raises(BadDump) as e:
        validate(dump, [0, 1, 2, 3], 8, [1, 3, 5])
    assert type(e.value) is kind, e.value
    assert words in str(e.value), e.value
    if kind is ContractBroken:
        assert "[1, 3, 5]" in str(e.value), e.value
