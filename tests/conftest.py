"""Shared pytest fixtures: a real tiny model (built once per session) and its tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real tiny Llama + tokenizer + chat template (defaults of ``eagle3d tiny-model``)."""
    from eagle3d.tools.tinymodel import build_tiny_model

    return Path(build_tiny_model(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> Any:
    """The tiny model's tokenizer, loaded the way the daemon loads it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)


@pytest.fixture(scope="session")
def stored_outputs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Any:
    """One dataset (40 conversations and a malformed line) extracted by the real daemon
    twice, with ``--store-dtype bfloat16`` and ``fp8``: ``{"dataset", "bfloat16", "fp8"}``."""
    from runkit import conversations, run, write_jsonl

    root = tmp_path_factory.mktemp("stored")
    data = write_jsonl(root / "data.jsonl", [*conversations(40), "{not json"])
    out: dict[str, Path] = {"dataset": data}
    for dtype in ("bfloat16", "fp8"):
        out[dtype] = root / f"out-{dtype}"
        r = run(tiny_model_dir, data, out[dtype], "--store-dtype", dtype)
        assert r.returncode == 0, r.stderr[-3000:]
    return out
