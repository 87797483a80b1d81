"""The daemon's start order (:mod:`eagle3d.run.daemon`): every check that can refuse a new
job first (nothing written before), then the producer's worker processes, started before
the daemon imports torch, so that on a CPU their
model load shares the cores with the daemon's own start instead of following it; the journal
still says ``run_started`` before any word of the producer, and nothing is sent before the
producer is up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import runkit
from eagle3d.produce.hf_layout import GPU_DEVICE_NODES
from eagle3proto import events as ev

# The daemon's own command, with the two seams it crosses at start recorded: each worker
# process it starts, forked or exec'd (and whether torch was in the daemon by then),
# the space check's entry.
_SCRIPT = """
import json, sys
import eagle3d.produce.hf_workers as hw
import eagle3d.run.spacecheck as spacecheck
from eagle3d.cli import main

seen = []
start, check_space = hw.Launcher.start, spacecheck.check_space

async def recorded_start(self, args, gpus):
    seen.append(["launch", "torch" in sys.modules, "transformers" in sys.modules])
    return await start(self, args, gpus)

def recorded_check_space(*a, **k):
    seen.append(["space check", "torch" in sys.modules, "transformers" in sys.modules])
    return check_space(*a, **k)

hw.Launcher.start, spacecheck.check_space = recorded_start, recorded_check_space
code = main(sys.argv[2:])
open(sys.argv[1], "w").write(json.dumps(seen))
sys.exit(code)
"""


def _run(tiny_model_dir: Path, tmp_path: Path, *extra: str) -> tuple[list[list[object]], Path]:
    data = tmp_path / "data.jsonl"
    valid, malformed = runkit.dataset(data, 12)
    out = tmp_path / "out"
    seen, _ = _recorded(_SCRIPT, runkit.run_args(tiny_model_dir, data, out, *extra), tmp_path)
    runkit.assert_complete(out, valid, malformed)
    return seen, out


def _recorded(script: str, cmd: list[str], tmp_path: Path) -> tuple[Any, str]:
    """Run the daemon's command ``cmd`` under ``script`` (which records what it saw to the
    file its first argument names); what it recorded, and the daemon's stderr."""
    seen = tmp_path / "seen.json"
    r = subprocess.run(
        [sys.executable, "-c", script, str(seen), *cmd[3:]],  # after "python -m eagle3d"
        capture_output=True,
        text=True,
        timeout=300,
        env=runkit.env_without_faults(),
    )
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    return json.loads(seen.read_text()), r.stderr


@pytest.mark.skipif(
    any(os.path.exists(p) for p in GPU_DEVICE_NODES), reason="a GPU host counts its GPUs with torch"
)
def test_a_new_jobs_space_check_comes_first_and_the_workers_before_the_daemon_imports_torch(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A new job's space check runs before anything is written (a refused start writes
    nothing; at ``max_length`` it is a statvfs, no tokenizer); the workers start next,
    before the daemon imports torch."""
    seen, out = _run(tiny_model_dir, tmp_path)
    launches = [s for s in seen if s[0] == "launch"]
    assert launches, seen
    assert seen[0] == ["space check", False, False] and len(seen) == 1 + len(launches), seen
    assert all(s == ["launch", False, False] for s in launches), seen
    # The journal's story is unchanged: the job, then the load, then the producer's word.
    evs = runkit.events(out)
    kinds = [type(e).__name__ for e in evs]
    started = kinds.index("RunStarted")
    assert started < kinds.index("ProducerEvent")
    assert started < kinds.index("RunState") < kinds.index("SampleSent")
    up = next(i for i, e in enumerate(evs) if isinstance(e, ev.RunState) and e.state == "running")
    assert up < kinds.index("SampleSent")


@pytest.mark.skipif(
    any(os.path.exists(p) for p in GPU_DEVICE_NODES), reason="a GPU host counts its GPUs with torch"
)
def test_without_the_space_check_the_workers_still_start_before_torch_is_imported(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    seen, _ = _run(tiny_model_dir, tmp_path, "--no-space-check")
    assert seen and all(s == ["launch", False, False] for s in seen), seen


# The daemon's own command, with what it imported by its end recorded.
_IMPORTED = """
import json, sys
from eagle3d.cli import main
code = main(sys.argv[2:])
heavy = [m for m in ("torch", "transformers", "safetensors") if m in sys.modules]
open(sys.argv[1], "w").write(json.dumps(heavy))
sys.exit(code)
"""


@pytest.mark.skipif(
    any(os.path.exists(p) for p in GPU_DEVICE_NODES), reason="a GPU host counts its GPUs with torch"
)
def test_a_resume_commits_without_importing_torch(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A resume (the tokenizer kept beside the journal, the dumps in the stored format, as
    the HF workers write them) commits every sample without the daemon importing torch,
    transformers or safetensors: a second of CPU each resume no longer pays (issue #32)."""
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    runkit.dataset(data, 6, malformed=False)
    assert runkit.run(tiny_model_dir, data, out).returncode == 0
    runkit.dataset(data, 14, malformed=False)  # more rows: the job resumed as forced
    cmd = runkit.run_args(tiny_model_dir, data, out, "--force-resume")
    heavy, stderr = _recorded(_IMPORTED, cmd, tmp_path)
    runkit.assert_complete(out, set(range(14)), set())
    assert "tokenizer: as kept" in stderr
    assert heavy == []


def test_a_synthetic_resume_imports_no_torch_at_all(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The synthetic producer (the benchmarks' GPU-node stand-in, in the daemon's process)
    writes its v2 dumps without torch: a resume on it is the daemon as on a GPU node, whose
    producer is another process, with no torch in the daemon's process at all."""
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    runkit.dataset(data, 6, malformed=False)
    assert runkit.run(tiny_model_dir, data, out, "--backend", "synthetic").returncode == 0
    runkit.dataset(data, 14, malformed=False)
    cmd = runkit.run_args(tiny_model_dir, data, out, "--backend", "synthetic", "--force-resume")
    heavy, _ = _recorded(_IMPORTED, cmd, tmp_path)
    runkit.assert_complete(out, set(range(14)), set())
    assert heavy == []


def test_a_start_refused_while_the_workers_load_ends_at_once_and_leaves_none(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The space check refuses (exit 10) while the workers still load (a 10-minute load, by
    the fault): they are killed, not asked to stop (a "stop" is read only after the load),
    and nothing of the job is left running or written."""
    import psutil

    data = tmp_path / "data.jsonl"
    runkit.dataset(data, 5)
    out = tmp_path / "out"
    cmd = runkit.run_args(tiny_model_dir, data, out, "--space-reserve", "100%")
    env = {**runkit.env_without_faults(), "EAGLE3D_FAULT": "worker_slow_load:600000"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 10, r.stderr[-3000:]
    assert "the job does not fit" in r.stderr and "never retrieved" not in r.stderr
    assert not list(out.glob("rows_*"))
    left = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if "eagle3d.remote.hf_worker" in " ".join(p.info["cmdline"] or ())
        and str(out) in " ".join(p.info["cmdline"] or ())
    ]
    assert not left, left
