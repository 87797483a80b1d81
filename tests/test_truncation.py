"""Truncation is a first-class fact (issue 27, point 1): a sample cut to ``--max-length`` is
counted in the journal (kept and original length) and said by every surface: the run's
progress and last lines, ``eagle3-top --once`` (text, ``--json`` key ``truncated``),
Prometheus, the TUI and ``eagle3d plan``; ``--on-overflow`` is documented in ``--help``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from eagle3proto import events as ev
from eagle3proto import reducer
from monitor_helpers import EAGLE3_TOP
from runkit import ENV, conversations, events, run, write_jsonl

MAX_LENGTH = "160"


@pytest.fixture(scope="module")
def cut(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One real run whose longer conversations exceed --max-length 160."""
    root = tmp_path_factory.mktemp("trunc")
    data = write_jsonl(root / "data.jsonl", conversations(30))
    out = root / "out"
    r = run(tiny_model_dir, data, out, "--max-length", MAX_LENGTH)
    assert r.returncode == 0, r.stderr[-3000:]
    saved = [e for e in events(out) if isinstance(e, ev.SampleSaved)]
    return {"out": out, "data": data, "run": r, "saved": saved}


def _once(out: Path, *args: str) -> str:
    p = subprocess.run(
        [EAGLE3_TOP, "--once", "--output", str(out), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    return p.stdout


def test_the_journal_keeps_each_truncated_sample_s_lengths(cut: dict[str, Any]) -> None:
    saved: list[ev.SampleSaved] = cut["saved"]
    truncated = [e for e in saved if e.truncated]
    assert truncated and len(truncated) < len(saved)  # the dataset has both kinds
    for e in truncated:
        assert e.tokens == int(MAX_LENGTH) and e.original_tokens > e.tokens, e
    for e in saved:
        if not e.truncated:
            assert e.tokens <= int(MAX_LENGTH) and e.original_tokens == 0


def test_old_journals_without_the_original_length_still_read() -> None:
    # A sample_saved record as eagle3d wrote it before original_tokens existed.
    old = msgspec.msgpack.encode(
        {
            "kind": "sample_saved",
            "seq": 1,
            "ts": 2.0,
            "run": "r",
            "idx": 3,
            "path": "p",
            "bytes": 10,
            "tokens": 160,
            "checksum": "c",
            "truncated": True,
        }
    )
    e = ev.decode(old)
    assert isinstance(e, ev.SampleSaved) and e.truncated and e.original_tokens == 0
    s = reducer.new_state()
    reducer.apply(s, e)
    assert s.truncated == 1 and s.tokens_dropped == 0


def test_the_run_ends_saying_how_many_were_truncated(cut: dict[str, Any]) -> None:
    saved: list[ev.SampleSaved] = cut["saved"]
    n = sum(e.truncated for e in saved)
    dropped = sum(e.original_tokens - e.tokens for e in saved if e.truncated)
    err = cut["run"].stderr
    summary = next(line for line in err.splitlines() if "summary:" in line)
    assert f"{n} truncated to max_length ({dropped:,} tokens dropped)" in summary, summary


def test_the_progress_line_counts_them(cut: dict[str, Any]) -> None:
    from eagle3d.serve.progress import describe

    s = reducer.new_state()
    evs = [ev.RunStarted(ts=1.0, total=60), ev.RunState(ts=2.0, state="running")]
    reducer.apply_all(s, [*evs, *cut["saved"]])  # half the job: still running
    n = sum(e.truncated for e in cut["saved"])
    assert n and f" · {n} truncated · in flight" in describe(s, s.newest_ts + 1)


def test_once_text_json_and_prometheus_count_them(cut: dict[str, Any]) -> None:
    saved: list[ev.SampleSaved] = cut["saved"]
    n = sum(e.truncated for e in saved)
    dropped = sum(e.original_tokens - e.tokens for e in saved if e.truncated)
    text = _once(cut["out"])
    assert f"{n} of {len(saved)} saved samples truncated to max_length ({dropped:,} tokens" in text
    assert f" truncated={n};" in text.splitlines()[0]  # perfdata
    doc = json.loads(_once(cut["out"], "--json"))
    assert doc["truncated"] == n and doc["tokens_dropped"] == dropped
    assert doc["shards"][0]["truncated"] == n
    prom = _once(cut["out"], "--format", "prometheus")
    line = next(ln for ln in prom.splitlines() if ln.startswith("eagle3d_samples_truncated_total{"))
    assert line.endswith(f" {n}")


def test_the_tui_shows_them(cut: dict[str, Any]) -> None:
    from test_tmux import Tmux

    saved: list[ev.SampleSaved] = cut["saved"]
    n = sum(e.truncated for e in saved)
    t = Tmux([EAGLE3_TOP, "--output", str(cut["out"])])
    try:
        t.wait_screen(lambda s: f"{n} of {len(saved)} saved samples truncated" in s)
    finally:
        t.kill()


def test_on_overflow_is_documented() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "eagle3d", "run", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    text = " ".join(p.stdout.split())
    assert "--on-overflow {truncate,skip}" in text
    assert "truncate keeps its first max-length tokens" in text and "(default truncate)" in text
