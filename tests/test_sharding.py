"""Sharding without a cluster: the documented sbatch script, the shard from the environment
(Slurm, torchrun, Kubernetes), and a change of the shard count between runs."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_slurm_doc_shows_the_tested_script() -> None:
    """docs/slurm.md's script is docs/eagle3d-array.sbatch, byte for byte: the file that
    tests/test_slurm.py submits to a real Slurm."""
    doc = (REPO / "docs" / "slurm.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```\n", doc, flags=re.S)
    assert blocks, "no sh block in docs/slurm.md"
    assert blocks[0] == (REPO / "docs" / "eagle3d-array.sbatch").read_text()
