"""Scratch folders for a benchmark: made under the given parents, removed whatever happens."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def scratch(prefix: str, *parents: str) -> Iterator[list[str]]:
    """One new folder under each of ``parents`` (named ``prefix...``), removed on exit."""
    made: list[str] = []
    try:
        for parent in parents:
            made.append(tempfile.mkdtemp(prefix=prefix, dir=parent))
        yield made
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)
