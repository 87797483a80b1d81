"""speculators 0.9.0's real trainer on eagle3d's DFlash and DSpark exports, a few steps on a
CPU (issue #30), and speculators' own layer resolvers against eagle3d's ``--draft-config``.

Runs only inside ``.venv-specforge`` (CI stage 4; ``scripts/specforge_env`` installs
speculators 0.9.0)::

    .venv-specforge/bin/python -m pytest -q tests/test_speculators_train.py

A tiny 10-layer target, 40 demo conversations extracted with ``--recipe dflash|dspark
--layers 1,3,5,7,9``, ``eagle3d export --format speculators``, then speculators' own
``speculators.train.cli.main`` (its TrainConfig, dataloader, DFlash/DSpark model, loss and
Trainer). One shim: its Trainer takes ``torch.accelerator.current_accelerator()`` and falls
back to ``"cuda"`` when there is none, so on a CPU-only machine the test makes the CPU the
accelerator (``torch.accelerator``'s device and synchronize); nothing else is patched.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("speculators", reason="needs scripts/specforge_env (.venv-specforge)")

import torch

pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parents[1]
DEMO_DATA = ROOT / "daemon" / "eagle3d" / "data" / "demo.jsonl"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
LAYERS = [1, 3, 5, 7, 9]


def eagle3d(*args: str) -> None:
    venv = Path(os.environ.get("EAGLE3D_VENV", ROOT / ".venv"))
    exe = venv / "bin" / "eagle3d"
    if not os.access(exe, os.X_OK):
        pytest.fail(f"{exe} is missing: run scripts/bootstrap first")
    r = subprocess.run([str(exe), *args], env=ENV, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec-train")
    model = root / "model"
    eagle3d("tiny-model", "--layers", "10", "--hidden", "128", str(model))
    data = root / "d.jsonl"
    data.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[:40]))
    paths = {"model": model, "root": root}
    layers = ",".join(map(str, LAYERS))
    for recipe in ("dflash", "dspark"):
        out = root / recipe
        eagle3d(
            "run",
            "--model",
            str(model),
            "--dataset",
            str(data),
            "--output",
            str(out),
            "--recipe",
            recipe,
            "--layers",
            layers,
            "--max-failed-fraction",
            "0.5",
        )
        eagle3d(
            "export", "-o", str(out), "--to", str(root / f"{recipe}-sp"), "--format", "speculators"
        )
        paths[recipe] = root / f"{recipe}-sp"
    return paths


@pytest.fixture
def cpu_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its Trainer moves the model to ``get_local_rank()`` (an accelerator index) and syncs
    the accelerator; on a CPU-only machine that is the CPU. The end's cache release asks with
    ``check_available=True`` and is told there is none."""
    if torch.accelerator.current_accelerator() is not None:
        return
    from speculators.train import trainer

    def current(check_available: bool = False) -> torch.device | None:
        return None if check_available else torch.device("cpu")

    monkeypatch.setattr(torch.accelerator, "current_accelerator", current)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    monkeypatch.setattr(trainer, "get_local_rank", lambda: "cpu")


def train(exports: dict[str, Path], recipe: str, steps: int) -> Path:
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    save = exports["root"] / f"{recipe}-ckpt"
    argv = [
        "--speculator-type",
        recipe,
        "--verifier-name-or-path",
        str(exports["model"]),
        "--data-path",
        str(exports[recipe]),
        "--save-path",
        str(save),
        "--log-dir",
        str(exports["root"] / f"{recipe}-logs"),
        "--target-layer-ids",
        *map(str, LAYERS),
        "--num-layers",
        "1",
        "--block-size",
        "4",
        "--draft-attn-impl",
        "sdpa",
        "--loss-implementation",
        "eager",
        "--hidden-states-dtype",
        "float32",
        "--total-seq-len",
        "512",
        "--num-workers",
        "0",
        "--epochs",
        "1",
        "--max-steps",
        str(steps),
        "--lr",
        "1e-3",
        "--mask-token-id",
        "3",
        "--draft-vocab-size",
        "128",
    ]
    main(TrainConfig.resolve(argv))
    return save


@pytest.mark.parametrize("recipe", ["dflash", "dspark"])
def test_speculators_trains_on_the_export(
    exports: dict[str, Path], recipe: str, cpu_accelerator: None
) -> None:
    save = train(exports, recipe, steps=3)
    # Its checkpoint of epoch 0: a draft of this recipe over the captured layers.
    cfg: dict[str, Any] = json.loads((save / "0" / "config.json").read_text())
    assert cfg["speculators_model_type"] == recipe
    assert cfg["aux_hidden_state_layer_ids"] == LAYERS
    weights = list((save / "0").glob("*.safetensors"))
    assert weights, sorted(str(p) for p in save.rglob("*"))


def test_draft_configs_resolve_as_speculators_resolves_them(exports: dict[str, Path]) -> None:
    from eagle3d.remote.recipes import parse_draft_config
    from speculators.convert.dflash.converter import DFlashConverter
    from speculators.models.utils import resolve_target_layer_ids

    model, n = str(exports["model"]), 10
    # Its default when a config names no layers.
    assert parse_draft_config({"speculators_model_type": "eagle3"}, n).layers == (
        resolve_target_layer_ids(None, model)
    )
    # A z-lab/SpecForge DFlash draft config: its converter's ids are eagle3d's.
    src = {
        "architectures": ["DFlashDraftModel"],
        "block_size": 4,
        "dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 2, 4, 6, 8]},
        "hidden_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 256,
        "vocab_size": 1000,
        "model_type": "qwen3",
    }
    converted = DFlashConverter()._build_config(src, model, None)
    ours = parse_draft_config(src, n)
    assert ours.recipe == "dflash"
    assert ours.layers == list(converted.aux_hidden_state_layer_ids) == [1, 3, 5, 7, 9]
