"""``eagle3d export``'s formats loaded by each trainer's own reader: SpecForge 0.2.0's file
listing, feature store and normalizer; speculators 0.9.0's ``ArrowDataset`` over
hs_connectors' ``FileTransfer`` (and its collator); Model-Optimizer 0.47.0's
``OfflineSupervisedDataset`` and ``EagleOfflineDataCollator``.

Runs only inside ``.venv-specforge`` (``scripts/specforge_env`` installs all three)::

    .venv-specforge/bin/python -m pytest -q tests/test_downstream_readers.py

The extraction and the exports run with eagle3d's own CLI from the project's ``.venv``;
the comparison values come from :mod:`eagle3d.reader` (installed in this venv too).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("speculators", reason="needs scripts/specforge_env (.venv-specforge)")
pytest.importorskip("modelopt", reason="needs scripts/specforge_env (.venv-specforge)")

import torch
from eagle3d.reader import HiddenStates

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[1]
DEMO_DATA = ROOT / "daemon" / "eagle3d" / "data" / "demo.jsonl"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def eagle3d(*args: str) -> dict[str, Any]:
    venv = Path(os.environ.get("EAGLE3D_VENV", ROOT / ".venv"))
    exe = venv / "bin" / "eagle3d"
    if not os.access(exe, os.X_OK):
        pytest.fail(f"{exe} is missing: run scripts/bootstrap first")
    r = subprocess.run([str(exe), *args], env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    return dict(json.loads(r.stdout)) if r.stdout.startswith("{") else {}


@pytest.fixture(scope="module")
def extracted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny model, 40 demo conversations extracted in fp8, and the three exports."""
    root = tmp_path_factory.mktemp("readers")
    model = root / "model"
    eagle3d("tiny-model", "--layers", "6", "--hidden", "128", str(model))
    data = root / "d.jsonl"
    data.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[:40]))
    out = root / "out"
    run = ("run", "--model", str(model), "--dataset", str(data), "--output", str(out))
    subprocess.run(
        [str(ROOT / ".venv" / "bin" / "eagle3d"), *run, "--store-dtype", "fp8"],
        env=ENV,
        check=True,
        capture_output=True,
        timeout=600,
    )
    paths = {"model": model, "out": out}
    for fmt in ("specforge", "speculators", "modelopt"):
        rep = eagle3d("export", "-o", str(out), "--to", str(root / fmt), "--format", fmt, "--json")
        assert rep["exported"] == rep["committed"] == 40, rep
        paths[fmt] = root / fmt
    return paths


def test_specforge_reads_the_specforge_export(extracted: dict[str, Path]) -> None:
    from specforge.algorithms.eagle3.data import build_offline_normalizer, build_offline_reader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    refs = build_offline_reader(
        str(extracted["specforge"]), run_id="t", ttt_length=7, max_len=4096
    ).read()
    assert len(refs) == 40
    store, normalize = LocalFeatureStore(), build_offline_normalizer(4096)
    ours = {item["idx"]: item for item in HiddenStates(extracted["out"])}
    for ref in refs:
        raw, handle = store.get(ref)
        s = normalize(raw)
        idx = int(Path(ref.feature_store_uri).stem.removeprefix("data_"))
        assert s["hidden_state"].dtype == s["target"].dtype == torch.bfloat16
        assert torch.equal(s["hidden_state"][0], ours[idx]["aux_hidden_state"][0])
        assert torch.equal(s["target"][0], ours[idx]["hidden_state"][0])
        store.release(handle)


def test_speculators_reads_the_speculators_export(extracted: dict[str, Path]) -> None:
    from hs_connectors import FileTransfer
    from safetensors.torch import load_file
    from speculators.train.data import ArrowDataset, CollateFn
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    to = extracted["speculators"]
    ds = ArrowDataset(
        max_len=4096,
        datapath=str(to),
        transfer=FileTransfer(to / "hidden_states"),
        on_missing="raise",
        train_ratio=1.0,
    )
    assert len(ds) == 40
    cfg = json.loads((extracted["model"] / "config.json").read_text())
    h = cfg["hidden_size"]
    norm = LlamaRMSNorm(h, eps=cfg["rms_norm_eps"])  # the verifier's final norm, as it applies it
    norm.weight.data = load_file(str(extracted["model"] / "model.safetensors"))["model.norm.weight"]
    ours = list(HiddenStates(extracted["out"]))
    # The export's rows go in the journal's order: each row is matched to our sample by its
    # ids, and every sample is some row's.
    by_ids = {tuple(item["input_ids"].tolist()): item for item in ours}
    seen = set()
    for k in range(len(ds)):
        got = ds[k]
        item = by_ids[tuple(got["input_ids"].tolist())]
        seen.add(id(item))
        assert torch.equal(got["input_ids"], item["input_ids"])
        assert torch.equal(got["loss_mask"], item["loss_mask"])
        assert torch.equal(got["hidden_states"], item["aux_hidden_state"][0])
        with torch.no_grad():
            y = norm(got["verifier_last_hidden_states"].float())
        want = item["hidden_state"][0].float()
        assert float((y - want).norm() / want.norm()) < 0.01, k
    assert len(seen) == len(ours) == len(by_ids)
    batch = CollateFn(max_len=512, hidden_size=h)([ds[0], ds[1]])
    assert batch["hidden_states"].shape == (1, 512, 3 * h)
    assert batch["verifier_last_hidden_states"].shape == (1, 512, h)
    freq = torch.load(to / "token_freq.pt", weights_only=True)
    assert sum(freq.values()) == sum(int(i["loss_mask"].sum()) for i in ours)


def test_modelopt_reads_the_modelopt_export(extracted: dict[str, Path]) -> None:
    from modelopt.torch.speculative.eagle.utils import (
        EagleOfflineDataCollator,
        OfflineSupervisedDataset,
    )

    files = sorted(str(p) for p in extracted["modelopt"].rglob("*.pt"))  # as its main lists them
    assert len(files) == 40
    ds = OfflineSupervisedDataset(files, answer_only_loss=True)
    ours = list(HiddenStates(extracted["out"]))
    for got, item in zip((ds[i] for i in range(len(ds))), ours, strict=True):
        assert torch.equal(got["input_ids"], item["input_ids"])
        assert torch.equal(got["loss_mask"], item["loss_mask"])
        assert torch.equal(got["base_model_hidden_states"], item["hidden_state"][0])
        assert torch.equal(got["aux_hidden_states"], item["aux_hidden_state"][0])
        assert got["base_hidden_prenorm"] is False
    batch = EagleOfflineDataCollator(train_len=256)([ds[0], ds[1]])
    assert batch["base_model_outputs"]["aux_hidden_states"].shape[:2] == (2, 256)
    assert batch["loss_mask"].shape == (2, 256)


def test_modelopt_reads_an_export_of_several_row_folders(
    extracted: dict[str, Path], tmp_path: Path
) -> None:
    """Samples beyond a folder's 2,000 (shard 0 of 41 of 4,100 rows: ids up to 4,059) go
    to ``rows_*`` subfolders, which ModelOpt's listing (``rglob``) and reader take whole."""
    import random

    from modelopt.torch.speculative.eagle.utils import OfflineSupervisedDataset

    r = random.Random(5)
    data = tmp_path / "d.jsonl"
    rows = [[r.randrange(1, 900) for _ in range(16)] for _ in range(4100)]
    data.write_text(
        "".join(json.dumps({"input_ids": i, "loss_mask": [0] * 4 + [1] * 12}) + "\n" for i in rows)
    )
    out, to = tmp_path / "out", tmp_path / "mo"
    run = ("run", "--model", str(extracted["model"]), "--dataset", str(data), "--output", str(out))
    eagle3d(*run, "--backend", "synthetic", "--shard", "0/41", "--socket", f"{out}.sock")
    rep = eagle3d("export", "-o", str(out), "--to", str(to), "--format", "modelopt", "--json")
    assert rep["exported"] == 100, rep
    assert len({p.parent for p in to.rglob("*.pt")}) == 3
    files = sorted(str(p) for p in to.rglob("*.pt"))  # as its main lists them
    ds = OfflineSupervisedDataset(files, answer_only_loss=True)
    assert len(ds) == 100
    ids = sorted(int(Path(f).stem) for f in files)
    assert ids == list(range(0, 4100, 41))
    for k, f in enumerate(files):
        assert ds[k]["input_ids"].tolist() == rows[int(Path(f).stem)]
