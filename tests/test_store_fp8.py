"""The fp8 storage format through the commit and verify: the splice's fused quantization
writes byte for byte what the general path writes, a NaN is caught on the scales, the
producers dump bfloat16 for it, and verify holds fp8 files to their scales."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from eagle3d.dumps.format import BadDump, read_dump
from eagle3d.remote import samplefile as ckpt
from eagle3d.remote import storedtype
from eagle3d.remote.dumpfile import write_dump
from eagle3d.store import archive, directio, fp8, splice
from eagle3d.store.committer import Committed, Committer
from eagle3d.tools.verify import check_sample
from eagle3proto import events as ev

H = 32
LAYERS = [2, 4, 5]
FP8 = storedtype.get("fp8")


def _states(t: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    aux = torch.randn(t, 3 * H, generator=g) * torch.tensor([1.0, 5.0, 40.0]).repeat_interleave(H)
    return aux.to(dtype), torch.randn(t, H, generator=g).to(dtype)


def test_the_format_entry() -> None:
    assert FP8.name == "fp8" and FP8.scaled and FP8.torch_dtype == "float8_e4m3fn"
    assert FP8.dump_dtype == "bfloat16"  # the producers dump bfloat16 for it
    assert FP8.keys[-2:] == ("hidden_state_scale", "aux_hidden_state_scale")
    assert "fp8" in storedtype.CHOICES and storedtype.resolve("auto", {}).name == "bfloat16"
    assert storedtype.cast(torch.ones(2), FP8).dtype == torch.bfloat16


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t", [1, 200, 3000])  # 3000: many chunks of rows
def test_the_splice_quantizes_within_its_read_as_the_general_path_does(
    t: int, src: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    aux, hid = _states(t, src)
    path = write_dump(str(tmp_path), "r", torch.arange(t), aux, hid, LAYERS)
    monkeypatch.setattr(os, "urandom", lambda n: b"\x07" * n)
    mask = [k % 2 for k in range(t)]
    staged = splice.stage(
        path, list(range(t)), mask, H, LAYERS, directio.DirectBuffer(), 1 << 30, FP8
    )
    assert staged is not None  # the fused path, not the general one
    spliced = bytes(staged.view[: staged.written.nbytes])
    general = Committer(str(tmp_path / "g"), store=FP8)
    (r,) = general.commit_many([(0, list(range(t)), mask, read_dump(path))])
    assert isinstance(r, Committed)
    assert (tmp_path / "g" / r.relpath).read_bytes() == spliced
    d = torch.load(tmp_path / "g" / r.relpath, weights_only=True, mmap=True)
    assert list(d) == list(FP8.keys)
    q, s = fp8.quantize(aux.to(torch.bfloat16))  # what the producer's bf16 dump holds
    if src == torch.bfloat16:
        assert torch.equal(d["aux_hidden_state"][0].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(d["aux_hidden_state_scale"][0], s)
    back = fp8.dequantize(d["aux_hidden_state"][0], d["aux_hidden_state_scale"][0], torch.float32)
    assert bool(((back - aux.float()).abs() <= fp8.bound(aux, s) * 1.01 + 1e-30).all())
    assert len(spliced) == ckpt.plan(splice.fp8_spec(t, H, 3)).total


def test_a_nan_in_a_dump_is_caught_on_the_scales_and_words_the_problem(tmp_path: Path) -> None:
    t = 12
    aux, hid = _states(t, torch.bfloat16)
    aux[7, 70] = float("nan")
    path = write_dump(str(tmp_path), "r", torch.arange(t), aux, hid, LAYERS)
    assert (
        splice.stage(
            path, list(range(t)), [1] * t, H, LAYERS, directio.DirectBuffer(), 1 << 30, FP8
        )
        is None
    )
    (r,) = Committer(str(tmp_path / "o"), store=FP8).commit_files(
        [(0, list(range(t)), [1] * t, path)], H, LAYERS
    )
    assert isinstance(r, BadDump) and "aux_hidden_state contains NaN or Inf" in str(r)


def _saved(out: Path, t: int) -> ev.SampleSaved:
    aux, hid = _states(t, torch.bfloat16)
    path = write_dump(str(out.parent), "v", torch.arange(t), aux, hid, LAYERS)
    (r,) = Committer(str(out), store=FP8).commit_files(
        [(3, list(range(t)), [1] * t, path)], H, LAYERS
    )
    assert isinstance(r, Committed)
    return ev.SampleSaved(idx=3, path=r.relpath, bytes=r.nbytes, tokens=t, checksum=r.checksum)


def test_verify_checks_fp8_files_with_their_scales(tmp_path: Path) -> None:
    out = tmp_path / "out"
    rec = _saved(out, 40)
    assert check_sample(str(out), rec, store_dtype="fp8") is None
    assert check_sample(str(out), rec, store_dtype="bfloat16") == (
        "sample 3: keys ['aux_hidden_state', 'aux_hidden_state_scale', 'hidden_state', "
        "'hidden_state_scale', 'input_ids', 'loss_mask']"
    )
    # Forged files (their checksums redone, so that only the tensor checks can see it).
    d = torch.load(out / rec.path, weights_only=True)
    bad = d["hidden_state_scale"].clone()
    bad[0, 5, 0] = -1.0
    assert _forged(out, rec, {**d, "hidden_state_scale": bad}) == (
        "sample 3: hidden_state_scale not positive"
    )
    wide = d["aux_hidden_state_scale"].repeat(1, 1, 3)
    assert _forged(out, rec, {**d, "aux_hidden_state_scale": wide}) == (
        "sample 3: aux_hidden_state_scale (1, 40, 3), want (1, 40, 1)"
    )


def _forged(out: Path, rec: ev.SampleSaved, d: dict[str, torch.Tensor]) -> str | None:
    fd = os.open(out / rec.path, os.O_WRONLY | os.O_TRUNC)
    try:
        w = archive.write(fd, {k: v.contiguous() for k, v in d.items()})
    finally:
        os.close(fd)
    forged = ev.SampleSaved(
        idx=rec.idx, path=rec.path, bytes=w.nbytes, tokens=rec.tokens, checksum=f"crc32:{w.crc:08x}"
    )
    return check_sample(str(out), forged, store_dtype="fp8")
