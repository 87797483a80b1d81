"""The commit rate a machine can hold (eagle3d.store.pace) and ``eagle3d plan``'s line for it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from eagle3d.store import pace
from runkit import ENV, conversations, write_jsonl


def test_the_rate_is_the_cores_the_threads_can_use_over_the_cost_per_file_and_byte() -> None:
    mb = 6_700_000  # a 400-token h2048 bf16 sample
    per_sample = pace.CPU_S_PER_FILE + pace.CPU_S_PER_GB * mb / 1e9
    p = pace.estimate(cpus=16, threads=8, bytes_per_token=32_000, bytes_per_sample=mb)
    assert p.bytes_per_s == pytest.approx(8 * mb / per_sample)  # 8 threads: 8 cores at most
    assert p.tokens_per_s == p.bytes_per_s / 32_000
    few = pace.estimate(cpus=2, threads=8, bytes_per_token=32_000, bytes_per_sample=mb)
    assert few.bytes_per_s == pytest.approx(2 * mb / per_sample)  # 2 cores: 2 at most
    # Half the bytes per file (fp8) is not half the cost: the per-file part stays.
    half = pace.estimate(cpus=16, threads=8, bytes_per_token=16_000, bytes_per_sample=mb / 2)
    assert p.cpu_s_per_gb < half.cpu_s_per_gb and half.bytes_per_s > p.bytes_per_s / 2
    big = pace.estimate(cpus=16, threads=8, bytes_per_token=16_000, bytes_per_sample=100 * mb)
    assert big.cpu_s_per_gb == pytest.approx(pace.CPU_S_PER_GB, rel=0.03)  # per byte at last
    assert "8 thread(s) on 16 CPU(s)" in p.describe() and "GB/s" in p.describe()
    assert "ms per sample file" in p.describe() and "samples of 6.7 MB" in p.describe()


def test_plan_states_the_commit_rate_beside_the_bytes(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", conversations(6, seed=2))
    cmd = [sys.executable, "-m", "eagle3d", "plan", "--model", str(tiny_model_dir)]
    cmd += ["--dataset", str(data), "--output", str(tmp_path / "out"), "--commit-threads", "3"]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if "commits:" in x)
    assert "3 thread(s)" in line and "tokens/s" in line and "CPU-s per GB" in line
    assert "per sample file" in line and "samples of" in line
