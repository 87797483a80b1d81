"""Nothing mixed, burnt or exposed when files change under a run (issue 26): each situation
with the real daemon on real files and processes.

1. the dataset rewritten in place during a run (same inode);
2. the dataset truncated during a run;
3. a row folder removed during a run;
4. a row folder that is a symlink;
5. the shard lock, the journal and the sample files against another local user;
6. the clock stepped while the daemon is frozen;
7. a worker's allocation failing;
8. a line too long to hold;
9. invalid UTF-8, first line or later;
10. a refused start.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import runkit
from eagle3proto import events as ev
from eagle3proto import paths
from eagle3proto.journal import JournalWriter

#: Slow enough (a 50 ms rest after every batch) that a change lands while the run goes on.
SLOW = "worker_slow:50"


def _lines(n: int, seed: int) -> list[str]:
    return [json.dumps(r) for r in runkit.conversations(n, seed=seed)]


def _write(path: Path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _rewrite_in_place(path: Path, data: bytes) -> None:
    """What ``cat other > data`` does: the same inode, truncated, then written."""
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(data)


def _saved_match(out: Path, model: Path, lines: list[str]) -> list[int]:
    """Saved samples whose token ids are not those of their line in ``lines``."""
    from eagle3d.ingest.chat import ChatEncoder
    from eagle3d.ingest.dataformats import parse_row
    from eagle3d.reader import load_sample
    from transformers import AutoTokenizer

    enc = ChatEncoder(AutoTokenizer.from_pretrained(str(model)), max_length=2048)
    wrong = []
    for r in runkit.records(out, "sample_saved"):
        idx = r["idx"]
        want = list(enc.encode(parse_row(idx, lines[idx].encode())).input_ids)
        got = load_sample(out / r["path"])["input_ids"].tolist()
        if got != want:
            wrong.append(idx)
    return wrong


def _finished(out: Path) -> bool:
    return bool(runkit.records(out, "run_finished"))


# -- 1 and 2. the dataset pinned for the life of a run ------------------------------------------


@pytest.mark.parametrize("change", ["rewritten", "truncated"])
def test_a_dataset_changed_under_a_run_stops_it_unmixed(
    tiny_model_dir: Path, tmp_path: Path, change: str
) -> None:
    data, out, log = tmp_path / "data.jsonl", tmp_path / "out", tmp_path / "log"
    old = _lines(300, seed=0)
    _write(data, old)
    before = data.read_bytes()
    proc = runkit.start(tiny_model_dir, data, out, "--concurrency", "4", fault=SLOW, log=log)
    with runkit.reaped(proc):
        runkit.wait_for(lambda: len(runkit.records(out, "sample_saved")) >= 5, 120, "5 saves")
        if change == "rewritten":  # the new file: a line more at the top, ids shifted
            _rewrite_in_place(data, ("\n".join(_lines(1, seed=7) + old) + "\n").encode())
        else:  # cut in the middle of a line
            cut = before.index(b"\n", len(before) // 2) - 20
            os.truncate(data, cut)
        rc = runkit.exit_code(proc, 120, log)
    text = log.read_text()
    assert rc == 6, text[-3000:]
    assert str(data) in text and "changed during the run" in text, text[-3000:]
    assert not _finished(out)
    stopped = runkit.records(out, "run_stopped")
    assert stopped and stopped[-1]["exit_code"] == 6, stopped
    assert not runkit.records(out, "sample_failed"), runkit.records(out, "sample_failed")
    assert not _saved_match(out, tiny_model_dir, old)
    c = runkit.check(out)
    assert not c.bad and not c.finished and len(c.saved) < len(old), c.bad
    # The changed file is another job: refused. Restored, the same command completes.
    r = runkit.run(tiny_model_dir, data, out)
    assert r.returncode == 6, r.stderr[-2000:]
    data.write_bytes(before)
    r = runkit.run(tiny_model_dir, data, out)
    assert r.returncode == 0, r.stderr[-3000:]
    runkit.assert_complete(out, set(range(len(old))), set())
    assert not _saved_match(out, tiny_model_dir, old)


def test_a_line_an_older_version_failed_on_a_short_file_is_retried(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """What an older eagle3d recorded for a line cut by a truncation: ``bad JSON: Input data
    was truncated``, for good. A version that pins the dataset retries such a record once;
    a line that is really bad fails again and stays failed."""
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    lines = _lines(20, seed=3)
    lines[15] = lines[15][:30]  # really cut: fails again
    _write(data, lines)
    jdir = paths.journal_dir(str(out), paths.Shard())
    r = runkit.run(tiny_model_dir, data, out, "--max-failed-fraction", "0.5")
    assert r.returncode == 0, r.stderr[-3000:]
    assert {x["idx"] for x in runkit.records(out, "sample_failed")} == {15}
    # A session of an older version (its run_started has no pin) that took line 7 as cut
    # short, and line 15 as well.
    last = [e for e in runkit.events(out) if isinstance(e, ev.RunStarted)][-1]
    with JournalWriter(jdir) as j:
        j.open()
        j.append(ev.RunStarted(job=last.job, total=last.total, session=last.session + 1))
        j.append(ev.SampleInvalid(idx=7, reason="test: made pending"))
        for idx in (7, 15):
            cut = "bad JSON: Input data was truncated"
            j.append(ev.SampleFailed(idx=idx, error="bad_json", message=cut, attempt=0))
        j.append(ev.RunFinished(saved=18, failed=2, exit_code=0))
    r = runkit.run(tiny_model_dir, data, out, "--max-failed-fraction", "0.5")
    assert r.returncode == 0, r.stderr[-3000:]
    reopened = [x for x in runkit.records(out, "sample_failed") if "retried" in x["message"]]
    assert {x["idx"] for x in reopened} == {7, 15}
    runkit.assert_complete(out, set(range(20)) - {15}, {15})
    # Recorded again by a version that pins the dataset: a third run retries nothing.
    r = runkit.run(tiny_model_dir, data, out, "--max-failed-fraction", "0.5")
    assert r.returncode == 0 and "nothing to do" in r.stderr, r.stderr[-2000:]
