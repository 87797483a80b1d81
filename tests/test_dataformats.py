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


def _counted_line_by_line(path: Path, max_line: int) -> tuple[int, list[int], list[bytes]]:
    """The reference: rows, blank ids and each row as :func:`iter_rows` reads them."""
    fmt = dataformats.Format("jsonl")
    rows = [r for _, r in dataformats.iter_rows(str(path), fmt, max_line=max_line)]
    blank = [i for i, r in enumerate(rows) if isinstance(r, bytes) and not r.strip()]
    return len(rows), blank, [r if isinstance(r, bytes) else b"<too long>" for r in rows]


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\n",
        b"\xef\xbb\xbf",
        b"\xef\xbb\xbf\n{}\n",
        b"\xef\xbb\xbf  \r\n{}",
        b"{}\n\n \t\n{}\r\n\r\n  ",
        b'{"a": 1}\n' + b"x" * 40 + b"\n" + b" " * 40 + b"\n{}\n\x0b\x0c\n",
        b"{}\r\n" * 7 + b"   \r\n" + b" " * 9 + b"\r",
        b"\n\n\n{}",
        b" {}\n \n\t{}\n  \r\n" + b" " * 20 + b"{}\n" + b" " * 13 + b"\n",
    ],
)
@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 64])
def test_the_scan_counts_what_iter_rows_reads(tmp_path: Path, body: bytes, chunk: int) -> None:
    """The numpy scan (rows, blank ids, each row's offset) agrees with reading line by line,
    whatever the chunk size (lines cut between chunks, a BOM, CRLF, a line past max_line)."""
    from eagle3d.ingest import lineindex

    p = tmp_path / "d.jsonl"
    p.write_bytes(body)
    max_line = 12
    rows, blank, lines = _counted_line_by_line(p, max_line)
    with open(p, "rb") as f:
        got = lineindex.scan(f, max_line, keep_starts=True, chunk=chunk)
    assert (got.rows, got.blank) == (rows, blank)
    assert len(got.starts) == rows
    fmt = dataformats.Format("jsonl")
    by_offset = dataformats.rows_at(str(p), fmt, list(range(rows)), got.starts, max_line)
    assert [r if isinstance(r, bytes) else b"<too long>" for _, r in by_offset] == lines


def test_rows_at_reads_a_compressed_file_in_order(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write("\n".join(json.dumps({"input_ids": [i], "loss_mask": [1]}) for i in range(9)))
    fmt = dataformats.detect(str(p))
    found = dataformats.index(str(p), fmt)
    assert found.rows == 9 and found.starts is None
    got = [(i, json.loads(r)["input_ids"]) for i, r in dataformats.rows_at(str(p), fmt, [2, 7])]  # type: ignore[arg-type]
    assert got == [(2, [2]), (7, [7])]


def test_iter_rows_from_a_row_offset_reads_the_same_rows_after_it(tmp_path: Path) -> None:
    """A resumed feeder starts at its first pending row's offset (through the pin): the rows
    from there are those a read from the start gives."""
    from eagle3d.ingest import pin

    p = tmp_path / "d.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + b"".join(f"{IDS}\r\n\n".encode() for _ in range(6)))
    fmt = dataformats.detect(str(p))
    pinned = pin.take(str(p))
    found = dataformats.index(str(p), fmt, pinned)
    whole = list(dataformats.iter_rows(str(p), fmt, 1, 3, pinned))
    for row in range(found.rows):
        at = (row, int(found.starts[row]))
        got = list(dataformats.iter_rows(str(p), fmt, 1, 3, pinned, skip_to=at))
        assert got == [(i, r) for i, r in whole if i >= row]
