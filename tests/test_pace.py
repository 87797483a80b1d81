"""The commit rate a machine can hold (eagle3d.store.pace) and ``eagle3d plan``'s line for it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from eagle3d.store import pace
from runkit import ENV, conversations, write_jsonl


def test_the_rate_is_the_cores_the_threads_can_use_over_the_cost_per_byte() -> None:
    p = pace.estimate(cpus=16, threads=8, bytes_per_token=32_000)
    assert p.bytes_per_s == 8 * 1e9 / pace.CPU_S_PER_GB_AS_IS  # 8 threads: 8 cores at most
    assert p.tokens_per_s == p.bytes_per_s / 32_000
    few = pace.estimate(cpus=2, threads=8, bytes_per_token=32_000)
    assert few.bytes_per_s == 2 * 1e9 / pace.CPU_S_PER_GB_AS_IS  # 2 cores: 2 at most
    fp8 = pace.estimate(cpus=16, threads=8, bytes_per_token=16_000, fp8=True)
    assert fp8.cpu_s_per_gb == pace.CPU_S_PER_GB_AS_IS_FP8
    slow = pace.estimate(cpus=16, threads=8, bytes_per_token=16_000, quantized_by_commit=True)
    assert slow.bytes_per_s == 8 * 1e9 / pace.CPU_S_PER_GB_QUANTIZED < fp8.bytes_per_s
    assert "8 thread(s) on 16 CPU(s)" in p.describe() and "GB/s" in p.describe()


def test_plan_states_the_commit_rate_beside_the_bytes(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", conversations(6, seed=2))
    cmd = [sys.executable, "-m", "eagle3d", "plan", "--model", str(tiny_model_dir)]
    cmd += ["--dataset", str(data), "--output", str(tmp_path / "out"), "--commit-threads", "3"]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if "commits:" in x)
    assert "3 thread(s)" in line and "tokens/s" in line and "CPU-s per GB" in line
