"""Dumps in the sample file's layout (``eagle3-dump-v2``, issue #32): the producer writes the
sample file but for its loss mask, with its records' CRC-32 and the finite check made where
the states are; the commit reads all but its states into its buffer (or maps it), checks
the ids, writes the mask and the CRC fields there and writes the file with the states'
pages spliced from the dump (or from the mapping), never reading the states. What it
commits is what a v1 dump of the same tensors gives, and anything wrong with a v2 dump is
worded by the general path as for a v1 dump."""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from eagle3d.dumps.format import BadDump, ContractBroken, DumpVanished, read_dump
from eagle3d.remote import samplefile, storedtype
from eagle3d.remote.dumpfile import TRAILER, write_dump
from eagle3d.store import splice
from eagle3d.store.committer import CommitError, Committed, Committer
from eagle3d.store.crc import file_checksum

H = 32
LAYERS = [2, 4, 5]
BF16 = storedtype.FORMATS["bfloat16"]


def _states(t: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    return (
        torch.randn(t, 3 * H, generator=g).to(dtype),
        torch.randn(t, H, generator=g).to(dtype),
    )


def _commit(
    out: Path, path: str, t: int, store: Any, mask: list[int] | None = None, spliced: bool = True
) -> Any:
    c = Committer(str(out), store=store, splice_pages=spliced)
    mask = [k % 2 for k in range(t)] if mask is None else mask
    (r,) = c.commit_files([(0, list(range(t)), mask, path)], H, LAYERS)
    return r


def _no_cpu_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every read of a dump's states by this CPU fail the test."""

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("the states were read on the CPU")

    for name in ("_read_checked", "_read_cast", "_read_quantize", "finite"):
        monkeypatch.setattr(splice, name, refuse)


@pytest.mark.parametrize("pages", ["spliced", "mapped"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t", [1, 37, 3000])
def test_a_v2_dump_commits_the_file_a_v1_dump_gives_without_reading_its_states(
    dtype: torch.dtype, t: int, pages: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its pages spliced into the write (4 KiB pages) or written from its mapping (2 MiB
    pages): the same file."""
    aux, hid = _states(t, dtype)
    store = storedtype.FORMATS[str(dtype).removeprefix("torch.")]
    v1 = write_dump(str(tmp_path), "a", torch.arange(t), aux, hid, LAYERS, layout="safetensors")
    v2 = write_dump(str(tmp_path), "b", torch.arange(t), aux, hid, LAYERS)
    assert Path(v2).read_bytes()[:4] == b"PK\x03\x04"
    r1 = _commit(tmp_path / "one", v1, t, store)
    before = splice.SEAM.snapshot()
    with monkeypatch.context() as m:
        _no_cpu_pass(m)
        if pages == "spliced":  # laid out in the thread's buffer: the dump is never mapped
            m.setattr(splice, "mmap", _Unmappable)
        r2 = _commit(tmp_path / "two", v2, t, store, spliced=pages == "spliced")
    assert isinstance(r1, Committed) and isinstance(r2, Committed), (r1, r2)
    after = splice.SEAM.snapshot()
    assert after.get("as_is", 0) - before.get("as_is", 0) == 2
    # Spliced: the states' pages moved by splice, all but the blocks shared with a header.
    states = 4 * t * H * (4 if dtype == torch.float32 else 2)
    moved = after.get("spliced", 0) - before.get("spliced", 0)
    assert moved >= states - 6 * 4096 if pages == "spliced" else moved == 0, (moved, states)
    a = (tmp_path / "one" / r1.relpath).read_bytes()
    b = (tmp_path / "two" / r2.relpath).read_bytes()
    # The same bytes but for the random serialization id (its digits, its records' CRCs)
    # and so the file's CRC-32; each file's checksum is its own bytes'.
    plan = samplefile.plan(samplefile.states_spec(t, H, 3, str(dtype).removeprefix("torch.")))
    assert len(a) == len(b) == plan.total == r2.nbytes
    _, _, local, central = plan.variable[-1]
    skip = [(plan.serial, 40), (local, 4), (central, 4)]
    assert _masked(a, skip) == _masked(b, skip)
    assert file_checksum(str(tmp_path / "two" / r2.relpath))[1] == r2.checksum
    got = torch.load(tmp_path / "two" / r2.relpath, weights_only=True)
    assert torch.equal(got["hidden_state"][0], hid) and torch.equal(got["aux_hidden_state"][0], aux)
    assert got["loss_mask"].tolist() == [k % 2 for k in range(t)]
    assert Path(v2).read_bytes()[-TRAILER:].startswith(b"E3D2")  # the dump itself untouched


class _Unmappable:
    """The mmap module as the splice sees it, failing the test on a mapping."""

    MAP_PRIVATE, PROT_READ, PROT_WRITE = mmap.MAP_PRIVATE, mmap.PROT_READ, mmap.PROT_WRITE

    @staticmethod
    def mmap(*_: Any, **__: Any) -> Any:
        raise AssertionError("the dump was mapped")


def _masked(raw: bytes, skip: list[tuple[int, int]]) -> bytes:
    out = bytearray(raw)
    for at, n in skip:
        out[at : at + n] = bytes(n)
    return bytes(out)


def test_a_v2_fp8_dump_is_committed_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp8 states quantized by the producer (:func:`storedtype.to_stored`) are moved as they
    are: values and scales byte for byte, nothing converted, nothing read."""
    t = 300
    fp8 = storedtype.FORMATS["fp8"]
    aux, hid = _states(t)
    (qa, sa), (qh, sh) = storedtype.to_stored(aux, fp8), storedtype.to_stored(hid, fp8)
    assert sa is not None and sh is not None
    path = write_dump(str(tmp_path), "q", torch.arange(t), qa, qh, LAYERS, (sa, sh))
    with monkeypatch.context() as m:
        _no_cpu_pass(m)
        m.setattr(splice, "_positive", lambda raw: True)  # the scales: t floats, not states
        r = _commit(tmp_path / "out", path, t, fp8)
    assert isinstance(r, Committed), r
    got = torch.load(tmp_path / "out" / r.relpath, weights_only=True)
    assert torch.equal(got["aux_hidden_state"][0].view(torch.uint8), qa.view(torch.uint8))
    assert torch.equal(got["hidden_state_scale"][0], sh)
    assert torch.equal(got["aux_hidden_state_scale"][0], sa)


def test_a_v2_dump_in_another_dtype_is_cast_within_the_read(tmp_path: Path) -> None:
    t = 64
    aux, hid = _states(t, torch.float32)
    path = write_dump(str(tmp_path), "c", torch.arange(t), aux, hid, LAYERS)
    before = splice.SEAM.snapshot()
    r = _commit(tmp_path / "out", path, t, BF16)
    assert isinstance(r, Committed), r
    assert splice.SEAM.snapshot().get("cast", 0) - before.get("cast", 0) == 2
    got = torch.load(tmp_path / "out" / r.relpath, weights_only=True)
    assert torch.equal(got["aux_hidden_state"][0], aux.to(torch.bfloat16))


def _v2(tmp_path: Path, t: int = 16, **kw: Any) -> tuple[str, torch.Tensor, torch.Tensor]:
    aux, hid = kw.pop("states", None) or _states(t)
    path = write_dump(str(tmp_path), kw.pop("rid", "x"), torch.arange(t), aux, hid, LAYERS, **kw)
    return path, aux, hid


def test_a_v2_dump_with_a_nan_is_refused_in_words(tmp_path: Path) -> None:
    aux, hid = _states(16)
    hid[3, 5] = float("nan")
    path, *_ = _v2(tmp_path, states=(aux, hid))
    r = _commit(tmp_path / "out", path, 16, BF16)
    assert isinstance(r, BadDump) and "NaN" in str(r), r
    assert not list((tmp_path / "out").glob("rows_*/*.ckpt"))


def test_a_v2_dump_of_other_ids_is_refused_in_words(tmp_path: Path) -> None:
    path, *_ = _v2(tmp_path)
    c = Committer(str(tmp_path / "out"), store=BF16)
    (r,) = c.commit_files([(0, [7] * 16, [1] * 16, path)], H, LAYERS)
    assert isinstance(r, BadDump) and "ids" in str(r), r


@pytest.mark.parametrize("pages", ["spliced", "mapped"])
def test_every_dump_descriptor_is_closed_whatever_the_verdict(pages: str, tmp_path: Path) -> None:
    """The staged dump's descriptor goes with what is written (the splice's source) and is
    closed with it; a dump refused by the fast path's checks closes it at once."""
    t = 3000
    good, *_ = _v2(tmp_path, t=t, rid="good")
    c = Committer(str(tmp_path / "out"), store=BF16, splice_pages=pages == "spliced")
    ids = list(range(t))
    for k in range(20):
        sent = ids if k % 2 else [7] * t  # every other one: ids the dump does not hold
        (r,) = c.commit_files([(k, sent, [1] * t, good)], H, LAYERS)
        assert isinstance(r, Committed if k % 2 else BadDump), r
        assert _open_on(good) == 0, k


def _open_on(path: str) -> int:
    """How many of this process's descriptors are open on ``path``."""
    target = os.path.realpath(path)  # /proc names the file by its resolved path
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            n += os.readlink(f"/proc/self/fd/{fd}") == target
    return n


def test_a_v2_dump_of_other_layers_breaks_the_contract(tmp_path: Path) -> None:
    aux, hid = _states(16)
    path = write_dump(str(tmp_path), "l", torch.arange(16), aux, hid, [1, 2, 3])
    r = _commit(tmp_path / "out", path, 16, BF16)
    assert isinstance(r, ContractBroken), r


@pytest.mark.parametrize("cut", [5, TRAILER, TRAILER + 100])
def test_a_cut_v2_dump_says_so(cut: int, tmp_path: Path) -> None:
    path, *_ = _v2(tmp_path)
    raw = Path(path).read_bytes()
    Path(path).write_bytes(raw[:-cut])
    with pytest.raises(BadDump, match=r"x\.e3dump: truncated|x\.e3dump: \d+ bytes, want"):
        read_dump(path)
    r = _commit(tmp_path / "out", path, 16, BF16)
    assert isinstance(r, BadDump) and not isinstance(r, DumpVanished), r


def test_a_garbled_trailer_says_so(tmp_path: Path) -> None:
    path, *_ = _v2(tmp_path)
    raw = bytearray(Path(path).read_bytes())
    raw[-TRAILER + 4 : -TRAILER + 12] = b"{{{{{{{{"
    Path(path).write_bytes(bytes(raw))
    with pytest.raises(BadDump, match=r"x\.e3dump: garbled trailer"):
        read_dump(path)


def test_a_v2_dump_with_a_header_laid_out_otherwise_is_rebuilt_not_trusted(
    tmp_path: Path,
) -> None:
    """A byte of the archive's headers changed (another writer's layout, a flipped bit):
    the mapped path refuses it and the general path builds the file from the slots."""
    t = 16
    path, _aux, hid = _v2(tmp_path, t)
    plan = samplefile.plan(samplefile.states_spec(t, H, 3, "bfloat16"))
    raw = bytearray(Path(path).read_bytes())
    at = plan.gaps[1][0]  # the header before the ids' record
    raw[at] ^= 0xFF
    Path(path).write_bytes(bytes(raw))
    r = _commit(tmp_path / "out", path, t, BF16)
    assert isinstance(r, Committed), r
    got = torch.load(tmp_path / "out" / r.relpath, weights_only=True)
    assert torch.equal(got["hidden_state"][0], hid)
    assert file_checksum(str(tmp_path / "out" / r.relpath))[1] == r.checksum


def test_a_v2_dump_changed_after_its_crcs_is_caught_by_verify(tmp_path: Path) -> None:
    """The states' CRC-32 are the producer's: a dump whose states changed after they were
    made (here on purpose) makes a file whose records' CRC-32 and whose journal checksum
    (combined from them) do not match its bytes, which ``eagle3d verify`` reports; the
    commit does not recompute them (it never reads the states)."""
    t = 128  # a state's record of 4 KiB or more: its CRC is combined, not recomputed
    path, _aux, _hid = _v2(tmp_path, t)
    plan = samplefile.plan(samplefile.states_spec(t, H, 3, "bfloat16"))
    hid_at, _ = plan.slots[2]
    raw = bytearray(Path(path).read_bytes())
    raw[hid_at] ^= 0x01
    Path(path).write_bytes(bytes(raw))
    r = _commit(tmp_path / "out", path, t, BF16)
    assert isinstance(r, Committed), r
    _, _, local, _ = plan.variable[2]
    out = (tmp_path / "out" / r.relpath).read_bytes()
    from eagle3d.remote.crc import crc32

    (claimed,) = struct.unpack_from("<I", out, local)
    assert claimed != crc32(out[hid_at : hid_at + plan.slots[2][1]], 0)
    assert file_checksum(str(tmp_path / "out" / r.relpath))[1] != r.checksum  # verify's test


def test_a_v2_dump_gone_is_a_vanished_dump(tmp_path: Path) -> None:
    path, *_ = _v2(tmp_path)
    os.unlink(path)
    r = _commit(tmp_path / "out", path, 16, BF16)
    assert isinstance(r, DumpVanished), r


@pytest.mark.parametrize("fmt", ["bfloat16", "float16", "float32", "fp8"])
def test_the_synthetic_producers_dumps_without_torch_are_its_dumps_with_torch(
    fmt: str, tmp_path: Path
) -> None:
    """:func:`constant_dump` (no torch) writes the file the torch path writes (the states
    :func:`storedtype.to_stored` makes for fp8), but for the serialization id."""
    from eagle3d.core.sample import Request
    from eagle3d.produce.synthetic import SyntheticProducer, constant_dump
    from eagle3d.remote.dumpfile import write_parts

    p = SyntheticProducer(dump_dir=str(tmp_path), hidden_size=H, aux_layers=LAYERS, dtype=fmt)
    ids = [5, 9, 1, 300, 7]
    by_torch = Path(p._write_with_torch(Request(rid="a", idx=0, input_ids=ids))).read_bytes()
    parts = constant_dump("a", ids, H, LAYERS, fmt)
    assert parts is not None
    (tmp_path / "p").mkdir()
    plain_path = write_parts(str(tmp_path / "p"), "a", parts)
    plain = Path(plain_path).read_bytes()
    n = len(plain) - TRAILER
    spec_dtype = "float8_e4m3fn" if fmt == "fp8" else fmt
    assert str(read_dump(plain_path).hidden_state.dtype) == f"torch.{spec_dtype}"
    spec = (
        samplefile.fp8_spec(5, H, 3)
        if fmt == "fp8"
        else samplefile.states_spec(5, H, 3, spec_dtype)
    )
    plan = samplefile.plan(spec)
    _, _, local, central = plan.variable[-1]
    skip = [(plan.serial, 40), (local, 4), (central, 4)]
    assert len(by_torch) == len(plain) and n == plan.total
    assert _masked(by_torch, skip) == _masked(plain, skip)


def test_the_workers_device_side_finite_check_skips_the_padding() -> None:
    """:func:`finite_rows` over :func:`storedtype.to_stored_checked` (run on the GPU before
    the copy to the host): a NaN in a sample's real tokens makes its row False; one in the
    padding (never stored) does not."""
    from eagle3d.remote.hf_worker import finite_rows

    final, aux = torch.zeros(3, 5, 4), torch.zeros(3, 5, 12)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    final[1, 4, 0] = float("nan")  # padding
    aux[2, 1, 3] = float("inf")  # a real token
    for fmt in (None, BF16, storedtype.FORMATS["fp8"]):
        (_, _, ok_f), (_, _, ok_a) = (storedtype.to_stored_checked(x, fmt) for x in (final, aux))
        assert finite_rows(ok_f & ok_a, mask).tolist() == [True, True, False], fmt


def test_the_device_side_check_sees_what_is_stored_a_float16_overflow_too() -> None:
    """A float32 state beyond float16's range is finite as computed and infinite as
    stored: the check is on what is stored, so its row is not finite. fp8's scaled values
    cannot overflow: its rows stay finite."""
    x = torch.ones(2, 3, 8)
    x[0, 1, 5] = 1e6  # beyond float16's 65504
    values, _, ok = storedtype.to_stored_checked(x, storedtype.FORMATS["float16"])
    assert bool(torch.isinf(values).any()) and ok.tolist() == [[True, False, True], [True] * 3]
    _, scales, ok8 = storedtype.to_stored_checked(x, storedtype.FORMATS["fp8"])
    assert scales is not None and bool(ok8.all())


def test_a_dump_the_producer_says_is_not_finite_is_checked_by_the_general_path(
    tmp_path: Path,
) -> None:
    """``finite=False`` from the producer (its device-side check) sends the dump the
    general path, which checks it itself: finite states are committed all the same."""
    t = 16
    aux, hid = _states(t)
    path = write_dump(str(tmp_path), "f", torch.arange(t), aux, hid, LAYERS, finite=False)
    before = splice.SEAM.snapshot()
    r = _commit(tmp_path / "out", path, t, BF16)
    assert isinstance(r, Committed), r
    assert splice.SEAM.snapshot().get("as_is", 0) - before.get("as_is", 0) == 2  # v1's way
    got = torch.load(tmp_path / "out" / r.relpath, weights_only=True)
    assert torch.equal(got["hidden_state"][0], hid)


def test_a_dump_that_cannot_be_mapped_is_read_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mapping refused (ENOMEM: the environment's, never the sample's) sends the dump the
    read path: the sample is committed all the same."""
    import errno
    import mmap as real

    def refuse(*_: Any, **__: Any) -> Any:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    class NoMapping:  # the mmap module as the splice sees it, refusing to map
        MAP_PRIVATE, PROT_READ, PROT_WRITE = real.MAP_PRIVATE, real.PROT_READ, real.PROT_WRITE
        mmap = staticmethod(refuse)

    path, _aux, hid = _v2(tmp_path)
    monkeypatch.setattr(splice, "mmap", NoMapping)
    r = _commit(tmp_path / "out", path, 16, BF16, spliced=False)
    assert isinstance(r, Committed), r
    got = torch.load(tmp_path / "out" / r.relpath, weights_only=True)
    assert torch.equal(got["hidden_state"][0], hid)


def test_a_refused_splice_writes_from_the_mapping_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the filesystems refuse ``splice`` into a direct write (EINVAL), the file is
    written from the mapping instead, the same bytes, and splice is not tried again."""
    import errno

    from eagle3d.store import directio

    calls = []

    def refuse(*a: Any, **k: Any) -> int:
        calls.append(a)
        raise OSError(errno.EINVAL, "Invalid argument")

    path, _aux, hid = _v2(tmp_path, t=3000)
    monkeypatch.setattr(directio.os, "splice", refuse)
    c = Committer(str(tmp_path / "out"), store=BF16)
    for idx in (0, 1):
        (r,) = c.commit_files([(idx, list(range(3000)), [1] * 3000, path)], H, LAYERS)
        assert isinstance(r, Committed), r
        got = torch.load(tmp_path / "out" / r.relpath, weights_only=True)
        assert torch.equal(got["hidden_state"][0], hid)
        assert file_checksum(str(tmp_path / "out" / r.relpath))[1] == r.checksum
    assert len(calls) == 1 and not c.splice_pages


def test_a_dump_cut_under_the_splice_is_retried_not_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dump that ends early under the splice (cut after its checks) is an I/O error: the
    sample is sent again (CommitError, never a failed sample), nothing is left behind,
    and the next commit on the same thread gets a clean pipe."""
    from eagle3d.store import directio

    path, _aux, hid = _v2(tmp_path, t=3000)
    real = directio.os.splice
    moved = []

    def short(src: int, dst: int, count: int, **k: Any) -> int:
        if "offset_src" in k and moved:  # the second read finds the end of the file
            return 0
        n = real(src, dst, count, **k)
        moved.append(n)
        return n

    c = Committer(str(tmp_path / "out"), store=BF16)
    with monkeypatch.context() as m:
        m.setattr(directio.os, "splice", short)
        (r,) = c.commit_files([(0, list(range(3000)), [1] * 3000, path)], H, LAYERS)
    assert isinstance(r, CommitError) and "ends at" in str(r), r
    assert [p for p in (tmp_path / "out").rglob("*") if p.is_file()] == []
    (r,) = c.commit_files([(0, list(range(3000)), [1] * 3000, path)], H, LAYERS)
    assert isinstance(r, Committed), r
    got = torch.load(tmp_path / "out" / r.relpath, weights_only=True)
    assert torch.equal(got["hidden_state"][0], hid) and c.splice_pages
