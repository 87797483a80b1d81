"""Words that fit the input (issue 27, point 8): a bad row is "line N" in JSONL, "row N" in
parquet and "item N" in a JSON array, with the sample id beside it; a null content is
"content is null", not "missing"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from runkit import conversations, records, run

pytestmark = pytest.mark.timeout(240)


def _rows() -> list[dict[str, Any]]:
    good = [{"messages": c.get("messages") or c["conversations"]} for c in conversations(6)]
    good = [g for g in good if all("role" in m for m in g["messages"])][:3]
    bad_role = {
        "messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]
    }
    null = {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "y"}]}
    return [good[0], bad_role, good[1], null, good[2]]  # bad ones at ids 1 and 3


def _failures(model: Path, data: Path, out: Path) -> dict[int, str]:
    r = run(model, data, out)
    assert r.returncode == 0, r.stderr[-3000:]
    return {x["idx"]: x["message"] for x in records(out, "sample_failed") if not x.get("retry")}


def test_jsonl_says_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    got = _failures(tiny_model_dir, data, tmp_path / "out")
    assert got[1].startswith("line 2 (sample 1): turn 0: unknown role 'robot'"), got
    assert got[3] == "line 4 (sample 3): turn 0: content is null", got


def test_a_json_array_says_item(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.json"
    data.write_text(json.dumps(_rows()))
    got = _failures(tiny_model_dir, data, tmp_path / "out")
    assert got[1].startswith("item 2 (sample 1): turn 0: unknown role 'robot'"), got
    assert got[3] == "item 4 (sample 3): turn 0: content is null", got


def test_parquet_says_row(tiny_model_dir: Path, tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = _rows()
    data = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    got = _failures(tiny_model_dir, data, tmp_path / "out")
    assert got[1].startswith("row 2 (sample 1): turn 0: unknown role 'robot'"), got
    assert got[3].startswith("row 4 (sample 3): "), got
