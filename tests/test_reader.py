"""The reader (eagle3d.reader) and the journal's catalogue of committed samples
(eagle3d.store.catalog): any storage format back in bfloat16, a Dataset driven by the journal."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from eagle3d.reader import HiddenStates, load_sample
from eagle3d.store import catalog, fp8
from eagle3proto import paths
from runkit import ENV


def test_fp8_and_bf16_files_read_back_as_the_same_samples(stored_outputs: Any) -> None:
    bf16, f8 = HiddenStates(stored_outputs["bfloat16"]), HiddenStates(stored_outputs["fp8"])
    assert len(bf16) == len(f8) == 40  # the malformed line is no sample
    assert [e.store_dtype for e in f8.entries] == ["fp8"] * 40
    for a, b in zip(bf16, f8, strict=True):
        assert a["idx"] == b["idx"]
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["loss_mask"], b["loss_mask"])
        assert set(b) == {"idx", "input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        for k in ("hidden_state", "aux_hidden_state"):
            assert b[k].dtype == torch.bfloat16 and b[k].shape == a[k].shape
            ref = a[k].float()
            err = float((b[k].float() - ref).norm() / ref.norm())
            assert err < 0.035, (k, err)  # e4m3: 3 mantissa bits


def test_load_sample_returns_the_requested_dtype_and_rejects_other_files(
    stored_outputs: Any, tmp_path: Path
) -> None:
    cat = catalog.read(str(stored_outputs["fp8"]))
    path = cat.path(cat.entries[0])
    raw = torch.load(path, weights_only=True)
    assert raw["hidden_state"].dtype == torch.float8_e4m3fn
    assert raw["aux_hidden_state_scale"].shape == (1, cat.entries[0].tokens, 1)
    got = load_sample(path, torch.float32)
    want = fp8.dequantize(raw["aux_hidden_state"], raw["aux_hidden_state_scale"], torch.float32)
    assert torch.equal(got["aux_hidden_state"], want)
    other = tmp_path / "x.ckpt"
    torch.save({"weights": torch.zeros(2)}, other)
    with pytest.raises(ValueError, match="not an eagle3d sample file"):
        load_sample(other)


def test_the_dataset_lists_what_the_journal_says_never_what_the_folder_holds(
    stored_outputs: Any, tmp_path: Path
) -> None:
    """A stray file with a sample's name, a temp file and a sample that ``verify --repair``
    moved aside: the journal decides, not a listing."""
    out = tmp_path / "out"
    shutil.copytree(stored_outputs["fp8"], out)
    before = HiddenStates(out)
    stray = out / paths.sample_relpath(1999)
    shutil.copy(out / before.entries[0].path, stray)
    (out / paths.rows_dir(0) / ".data_7.ckpt.tmp-1-2").write_bytes(b"x")
    victim = before.entries[3]
    with open(out / victim.path, "r+b") as f:  # damage a committed file
        f.seek(4096)
        f.write(b"\xff" * 64)
    r = subprocess.run(
        [sys.executable, "-m", "eagle3d", "verify", "-o", str(out), "--repair"],
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and "REPAIRED" in r.stdout, r.stdout + r.stderr
    ds = HiddenStates(out)
    assert [e.idx for e in ds.entries] == [e.idx for e in before.entries if e.idx != victim.idx]
    assert 1999 not in {e.idx for e in ds.entries}
    assert len(ds) == len(before) - 1
    for item in ds:  # every listed sample loads
        assert item["hidden_state"].dtype == torch.bfloat16


def test_the_dataset_feeds_a_torch_dataloader(stored_outputs: Any) -> None:
    ds = HiddenStates(stored_outputs["fp8"], dtype=torch.float32)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, shuffle=False, num_workers=2)
    seen = [int(s["idx"]) for s in loader]
    assert seen == [e.idx for e in ds.entries]


def test_an_output_without_a_journal_is_refused(tmp_path: Path) -> None:
    with pytest.raises(catalog.NoJournal, match="no eagle3d journal"):
        HiddenStates(tmp_path)
    os.makedirs(tmp_path / paths.rows_dir(0))
    with pytest.raises(catalog.NoJournal):
        catalog.read(str(tmp_path))
