"""At scale, with the real daemon and the synthetic producer: a resume after kill -9 starts
from the state checkpoint and lists no row folder (strace: no getdents64 on a ``rows_*``
folder); a fault-free run of 20,000 samples records no orphan dump."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import runkit
from eagle3proto import checkpoint, paths, reducer
from eagle3proto import events as ev
from eagle3proto.journalread import iter_events
from eagle3top.sources import fold_journal


def tokens_dataset(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` pre-tokenized rows of 16 tokens (tiny states: the job's size is its count)."""
    r = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            ids = [r.randrange(1, 900) for _ in range(16)]
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 4 + [1] * 12}) + "\n")
    return path


def synthetic_args(model: Path, data: Path, out: Path) -> list[str]:
    return runkit.run_args(model, data, out, "--backend", "synthetic")


def saved_in(out: Path) -> int:
    jdir = paths.journal_dir(str(out), paths.Shard())
    if not os.path.isdir(jdir):
        return 0
    evs, _ = iter_events(jdir)
    return sum(isinstance(e, ev.SampleSaved) for e in evs)


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_resume_after_kill_starts_from_the_checkpoint_and_lists_no_row_folder(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    n = 4500  # three row folders
    data = tokens_dataset(tmp_path / "d.jsonl", n)
    out = tmp_path / "out"
    env = runkit.env_without_faults(EAGLE3D_CHECKPOINT_EVERY="600")
    log = tmp_path / "first.log"
    with open(log, "wb") as logf:
        proc = subprocess.Popen(
            synthetic_args(tiny_model_dir, data, out),
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    with runkit.reaped(proc):  # type: ignore[arg-type]
        jdir = paths.journal_dir(str(out), paths.Shard())
        runkit.wait_for(
            lambda: (
                proc.poll() is not None
                or (checkpoint.load(jdir).checkpoint is not None and saved_in(out) >= 2100)
            ),
            120,
            "a checkpoint and 2,100 saved samples",
        )
        assert proc.poll() is None, log.read_text()[-3000:]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    ck = checkpoint.load(jdir).checkpoint
    assert ck is not None
    trace = tmp_path / "strace.txt"
    second = subprocess.run(
        [
            *("strace", "-f", "-qq", "-y", "-e", "trace=getdents64", "-o", str(trace)),
            *synthetic_args(tiny_model_dir, data, out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from the checkpoint at record" in second.stderr
    listed = [ln for ln in trace.read_text().splitlines() if "getdents64(" in ln]
    assert listed  # the trace works: the staging folder, the dump area, the model are listed
    rows = [ln for ln in listed if re.search(r"<[^>]*/rows_\d+-\d+>", ln)]
    assert rows == [], rows[:5]
    assert any("/staging/" in ln for ln in listed)
    # Where it ended: the checkpoint (written at the clean end) plus nothing equals the
    # whole journal, and every sample is saved once.
    got, _rep, refused = fold_journal(jdir)
    assert refused == ""
    full = reducer.new_state()
    evs, _ = iter_events(jdir)
    reducer.apply_all(full, evs)
    assert reducer.encode_state(got) == reducer.encode_state(full)
    assert full.saved == n and full.state == "finished"
    saved = [e.idx for e in evs if isinstance(e, ev.SampleSaved)]
    assert sorted(set(saved)) == list(range(n))
    rep = runkit.verify(out)
    assert rep["_rc"] == 0 and rep["ok"] and rep["checked"] == n, rep


def test_no_orphan_dump_in_a_fault_free_run_of_20k_samples(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    n = 20_000
    data = tokens_dataset(tmp_path / "d.jsonl", n)
    out = tmp_path / "out"
    r = subprocess.run(
        synthetic_args(tiny_model_dir, data, out),
        env=runkit.env_without_faults(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    evs, _ = iter_events(paths.journal_dir(str(out), paths.Shard()))
    assert sum(isinstance(e, ev.SampleSaved) for e in evs) == n
    orphans = [e for e in evs if isinstance(e, ev.DumpOrphan)]
    assert orphans == []
    stats = [e for e in evs if isinstance(e, ev.Stats)]
    assert stats and stats[-1].orphans == 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
