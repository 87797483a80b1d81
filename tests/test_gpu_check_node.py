"""``scripts/gpu_check_node.py --dry-run``: the node check's every step (model built and saved,
bare loop, dd, ``eagle3d run`` in bfloat16 and fp8) on a tiny shape on the CPU, so that the
prepared device check is known to run before a GPU is lent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from runkit import ENV

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_node_check_runs_every_step_on_a_tiny_cpu_shape(tmp_path: Path) -> None:
    script = ROOT / "scripts" / "gpu_check_node.py"
    cmd = [sys.executable, str(script), "--dry-run", "--samples", "8", "--tokens", "48"]
    cmd += ["--work", str(tmp_path / "work"), "--results", str(tmp_path / "res")]
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got = json.loads((tmp_path / "res" / "results.json").read_text())
    assert got["shape"]["hidden"] == 256 and got["bare_tokens_s"] > 0
    assert set(got["formats"]) == {"bfloat16", "fp8"}
    bf16, fp8 = got["formats"]["bfloat16"], got["formats"]["fp8"]
    for f in (bf16, fp8):
        assert f["samples"] == 8 and f["ratio"] > 0 and f["disk_tokens_s"] > 0
        assert f["bound_by"] in ("disk", "forward")
    # fp8 stores about half of bfloat16's bytes per token (the states' 4H against 8H).
    assert fp8["bytes_per_token"] < 0.6 * bf16["bytes_per_token"]
    assert "e2e / min(bare, disk)" in p.stdout
    assert not (tmp_path / "work" / "out-bfloat16").exists()  # outputs removed as it goes
