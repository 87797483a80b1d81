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
