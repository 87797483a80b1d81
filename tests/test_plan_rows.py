"""``eagle3d plan`` reads the rows as the run will (issue 27, point 3): the same parser, template
and max_length; ``--json`` gains ``rows_invalid``, ``rows_over_max_length``, ``rows_skipped``
and ``tokens_dropped``, its ``problems`` name the first invalid rows and say when the run's
failure rule will make it exit 9; the verdict counts only what will be saved."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from runkit import ENV, conversations, records, run, write_jsonl

pytestmark = pytest.mark.timeout(300)

BAD = ["{not json", '{"messages": []}']


def plan(model: Path, data: Path, out: Path, *extra: str) -> dict[str, Any]:
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle3d",
            "plan",
            "--model",
            str(model),
            "--dataset",
            str(data),
            "--output",
            str(out),
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=ENV,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "plan: read" in p.stderr and "rows as the run will" in p.stderr  # its progress line
    doc: dict[str, Any] = json.loads(p.stdout)
    return doc


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("planrows")
    return write_jsonl(root / "data.jsonl", [*conversations(30), *BAD])


def test_plan_counts_what_the_run_then_does(tiny_model_dir: Path, data: Path) -> None:
    out = data.parent / "out"
    # The same failure rule as runkit's run (0.5): under it, the plan warns of no exit 9.
    doc = plan(tiny_model_dir, data, out, "--max-length", "160", "--max-failed-fraction", "0.5")
    r = run(tiny_model_dir, data, out, "--max-length", "160")
    assert r.returncode == 0, r.stderr[-2000:]
    saved = records(out, "sample_saved")
    failed = [x for x in records(out, "sample_failed") if not x.get("retry")]
    assert doc["rows_invalid"] == len(failed) == len(BAD)
    assert doc["rows_over_max_length"] == sum(bool(x.get("truncated")) for x in saved) > 0
    assert doc["tokens_dropped"] == sum(
        x["original_tokens"] - x["tokens"] for x in saved if x.get("truncated")
    )
    assert doc["rows_skipped"] == 0
    assert doc["samples"] == len(saved)  # only what will be saved
    assert doc["tokens"] == sum(x["tokens"] for x in saved)
    # The problems name the first invalid rows, as the run's failures do.
    named = [p for p in doc["problems"] if p.startswith("invalid: ")]
    assert len(named) == len(BAD)
    for x in failed:
        assert any(x["message"] in p for p in named), (x["message"], named)
    assert not any("exit 9" in p for p in doc["problems"])  # 2 of 32: under 50 %
    # Under the default rule (5 %) the same 2 of 32 (6 %) would make the run exit 9: said.
    strict = plan(tiny_model_dir, data, data.parent / "out-strict", "--max-length", "160")
    assert any("2 of 32 remaining rows will fail" in p for p in strict["problems"])


def test_plan_says_a_skip_job_will_exit_9(tiny_model_dir: Path, data: Path) -> None:
    out = data.parent / "out-skip"
    doc = plan(tiny_model_dir, data, out, "--max-length", "160", "--on-overflow", "skip")
    assert doc["rows_skipped"] == doc["rows_over_max_length"] > 0
    assert doc["samples"] == 30 - doc["rows_skipped"]
    warn = [p for p in doc["problems"] if "the run will exit 9" in p]
    assert warn and f"{doc['rows_skipped'] + len(BAD)} of 32 remaining rows will fail" in warn[0]
