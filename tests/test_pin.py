"""The dataset pin (:mod:`eagle3d.ingest.pin`): on real files, in-process."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import pytest
from eagle3d.ingest import dataformats, pin


def _jsonl(n: int) -> bytes:
    return b"".join(
        b'{"messages": [{"role": "user", "content": "q%d"}, {"role": "assistant", "content": "%s"}]}\n'
        % (i, b"a" * (i % 50))
        for i in range(n)
    )


def _rows(path: Path, p: pin.Pin | None) -> list[tuple[int, object]]:
    fmt = dataformats.detect(str(path))
    return list(dataformats.iter_rows(str(path), fmt, pin=p))


def test_an_unchanged_file_reads_as_without_a_pin(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_bytes(_jsonl(30000))  # > 2 blocks
    assert data.stat().st_size > 2 * pin.BLOCK
    p = pin.take(str(data))
    assert len(p.blocks) == -(-p.size // pin.BLOCK)
    assert p.changed() == ""
    assert _rows(data, p) == _rows(data, None)
    fmt = dataformats.detect(str(data))
    assert dataformats.count(str(data), fmt, p) == (30000, [])


def test_a_block_rewritten_with_size_and_mtime_kept_is_caught_before_it_is_read(
    tmp_path: Path,
) -> None:
    data = tmp_path / "d.jsonl"
    data.write_bytes(_jsonl(30000))
    p = pin.take(str(data))
    st = data.stat()
    with open(data, "r+b") as f:  # one byte of the second block, size unchanged
        f.seek(pin.BLOCK + 10)
        b = f.read(1)
        f.seek(pin.BLOCK + 10)
        f.write(b"Z" if b != b"Z" else b"Y")
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert p.changed() == ""  # what a stat sees: nothing
    rows = dataformats.iter_rows(str(data), dataformats.detect(str(data)), pin=p)
    got = 0
    with pytest.raises(pin.DatasetChanged, match=r"changed during the run: bytes 1048576-"):
        for _ in rows:
            got += 1
    assert 0 < got < 30000  # the first block's rows came out; nothing of the second


@pytest.mark.parametrize("how", ["truncated", "appended", "replaced", "touched"])
def test_a_changed_file_is_seen_by_stat(tmp_path: Path, how: str) -> None:
    data = tmp_path / "d.jsonl"
    data.write_bytes(_jsonl(100))
    p = pin.take(str(data))
    if how == "truncated":
        os.truncate(data, 1000)
    elif how == "appended":
        with open(data, "ab") as f:
            f.write(_jsonl(1))
    elif how == "replaced":
        other = tmp_path / "o.jsonl"
        other.write_bytes(_jsonl(100))
        os.replace(other, data)
    else:
        os.utime(data, ns=(0, 0))
    assert p.changed().startswith(f"dataset {data} changed during the run: ")


def test_a_truncated_file_ends_no_line_early(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_bytes(_jsonl(100))
    p = pin.take(str(data))
    rows = dataformats.iter_rows(str(data), dataformats.detect(str(data)), pin=p)
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(pin.DatasetChanged, match=r"bytes at the start"):  # seen at open
        list(rows)


def test_a_file_cut_after_it_was_opened_ends_no_line_early(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_bytes(_jsonl(100))
    p = pin.take(str(data))
    with pin.open_pinned(p) as f:
        os.truncate(data, data.stat().st_size // 2)
        with pytest.raises(pin.DatasetChanged, match=r"it ends at byte \d+, not \d+"):
            f.read()


def test_bytes_appended_after_the_pin_are_not_read(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_bytes(_jsonl(10))
    p = pin.take(str(data))
    with pin.open_pinned(p) as f:
        with open(data, "ab") as more:
            more.write(_jsonl(5))
        assert f.read() == _jsonl(10)
    assert "bytes at the start" in p.changed()


def test_a_compressed_file_is_checked_as_stored(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl.gz"
    data.write_bytes(gzip.compress(_jsonl(200)))
    p = pin.take(str(data))
    fmt = dataformats.detect(str(data))
    assert len(list(dataformats.iter_rows(str(data), fmt, pin=p))) == 200
    os.truncate(data, data.stat().st_size - 30)
    with pytest.raises(pin.DatasetChanged):
        list(dataformats.iter_rows(str(data), fmt, pin=p))
