"""The model folder is checked before anything is written (issue 27, point 5): a folder with
only ``config.json`` is refused at once with exit 3 naming what is missing, no traceback, and
the output is never created."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from runkit import conversations, run, write_jsonl

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("keep", "missing"),
    [
        (["config.json"], "missing the weights"),
        (
            ["config.json", "model.safetensors", "model.safetensors.index.json"],
            "missing the tokenizer",
        ),
    ],
)
def test_a_broken_model_folder_is_refused_before_anything_is_written(
    tiny_model_dir: Path, tmp_path: Path, keep: list[str], missing: str
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for name in keep:
        shutil.copy(tiny_model_dir / name, model / name)
    data = write_jsonl(tmp_path / "data.jsonl", conversations(3))
    out = tmp_path / "out"
    r = run(model, data, out, timeout=60)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and missing in r.stderr, r.stderr[-2000:]
    assert "sentencepiece" not in r.stderr
    assert not out.exists()


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_an_empty_dataset_is_refused_the_same_way(
    tiny_model_dir: Path, tmp_path: Path, content: str
) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    out = tmp_path / "out"
    r = run(tiny_model_dir, data, out, timeout=60)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "empty (no rows, only blank lines)" in r.stderr and "Traceback" not in r.stderr
    assert "already finished" not in r.stderr
    assert not out.exists()
