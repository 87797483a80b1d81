"""``python -m eagle3d.specforge_train train ...``: SpecForge's trainer on eagle3d's fp8
files, under the name docs/training.md gives it (and the workers' command it launches).
The code is :mod:`eagle3d.tools.specforge_train`."""

from __future__ import annotations

from eagle3d.tools.specforge_train import main, registry

__all__ = ["main", "registry"]

if __name__ == "__main__":
    raise SystemExit(main())
