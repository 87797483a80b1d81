"""Dataset formats (:mod:`eagle3d.ingest.dataformats`): detection by content, row ids, blank lines,
and refusals that name what the file is. The daemon reading each format end to end is in
``tests/test_integrity.py``."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from eagle3d.ingest import dataformats
from eagle3d.ingest.dataformats import DatasetError
from eagle3d.ingest.dataset import Conversation, PreTokenized

CHAT = json.dumps(
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
)
IDS = json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]})


def _rows(path: Path) -> list[tuple[int, object]]:
    fmt = dataformats.detect(str(path))
    return [(i, dataformats.parse_row(i, r)) for i, r in dataformats.iter_rows(str(path), fmt)]


def test_jsonl_blank_lines_keep_their_ids(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text(f"{CHAT}\n\n  \n{IDS}\r\n")
    fmt = dataformats.detect(str(p))
    assert fmt.name == "jsonl"
    assert dataformats.count(str(p), fmt) == (4, [1, 2])
    ids = [i for i, _ in dataformats.iter_rows(str(p), fmt)]
    assert ids == [0, 1, 2, 3]
    assert isinstance(
        dataformats.parse_row(3, next(r for i, r in dataformats.iter_rows(str(p), fmt) if i == 3)),
        PreTokenized,
    )


def test_gzip_and_sharding(tmp_path: Path) -> None:
    p = tmp_path / "d.gz"  # the name says nothing: the content decides
    p.write_bytes(gzip.compress(("\n".join([CHAT, IDS, CHAT]) + "\n").encode()))
    fmt = dataformats.detect(str(p))
    assert fmt.name == "jsonl.gz" and dataformats.count(str(p), fmt) == (3, [])
    assert [i for i, _ in dataformats.iter_rows(str(p), fmt, 1, 2)] == [1]


def test_json_array_ids_are_element_numbers(tmp_path: Path) -> None:
    p = tmp_path / "d.json"
    p.write_text(f"[{CHAT},\n {IDS}, {CHAT}]")
    rows = _rows(p)
    assert [i for i, _ in rows] == [0, 1, 2]
    assert isinstance(rows[0][1], Conversation) and isinstance(rows[1][1], PreTokenized)


def test_jsonl_whose_first_line_is_an_array_stays_jsonl(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text(f'["not", "an", "object"]\n{CHAT}\n')
    assert dataformats.detect(str(p)).name == "jsonl"


def test_parquet_struct_turns_drop_nulls(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    turns = [
        [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    ]
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"conversations": turns, "id": ["x", "y"]}), p)
    fmt = dataformats.detect(str(p))
    assert fmt.columns == ("conversations",) and dataformats.count(str(p), fmt) == (2, [])
    rows = _rows(p)
    assert all(isinstance(s, Conversation) for _, s in rows)
    assert [t.role for t in rows[0][1].turns] == ["user", "assistant"]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"\x00\x01\x02binary", "binary"),
        (b"a,b,c\n1,2,3\n", "no line starts a JSON object"),
        (b'[{"messages": [', "not valid JSON"),
        (b"\x1f\x8b\x08\x00garbage", "gzip file that does not decompress"),
        (b"PAR1 not really", "parquet"),
    ],
)
def test_refusals_name_what_the_file_is(tmp_path: Path, content: bytes, needle: str) -> None:
    p = tmp_path / "d"
    p.write_bytes(content)
    with pytest.raises(DatasetError, match=needle):
        dataformats.detect(str(p))
