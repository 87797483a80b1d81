"""The dataset's pin kept beside the journal (:mod:`eagle3d.ingest.pincache`): used by a
resume only while the file is provably the one it describes; on real files, and through the
daemon."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import runkit
from eagle3d.ingest import dataformats, pin, pincache
from eagle3d.ingest.lineindex import Lines


def _jsonl(n: int) -> bytes:
    rows = [
        b'{"messages": [{"role": "user", "content": "q%d"}, {"role": "assistant", "content": "%s"}]}\n'
        % (i, b"a" * (i % 50))
        for i in range(n)
    ]
    rows[7] = b"  \n"  # a blank row: kept among the rows found
    return b"".join(rows)


def _kept(
    tmp_path: Path, n: int = 30000, age: int = 10 * pincache.RACY_NS
) -> tuple[Path, Path, pin.Pin]:
    """A dataset of ``n`` rows pinned, as if read ``age`` ns after it was written (the
    clock seam: a dataset a while old), and kept."""
    data, jdir = tmp_path / "d.jsonl", tmp_path / "j"
    data.write_bytes(_jsonl(n))
    jdir.mkdir()
    at = data.stat().st_ctime_ns + age
    p = pin.take(str(data), clock=lambda: at)
    found = dataformats.index(str(data), dataformats.detect(str(data)), p)
    pincache.save(str(jdir), p, "jsonl", dataformats.MAX_LINE_BYTES, found)
    return data, jdir, p


def _load(data: Path, jdir: Path) -> tuple[pin.Pin, Lines] | str:
    return pincache.load(str(jdir), str(data), "jsonl", dataformats.MAX_LINE_BYTES)


def test_a_kept_pin_gives_what_reading_the_file_gives(tmp_path: Path) -> None:
    data, jdir, p = _kept(tmp_path)
    got = _load(data, jdir)
    assert isinstance(got, tuple), got
    cached, lines = got
    assert cached == p
    fresh = dataformats.index(str(data), dataformats.detect(str(data)), p)
    assert (lines.rows, lines.blank) == (fresh.rows, fresh.blank) == (30000, [7])
    assert np.array_equal(lines.starts, fresh.starts)
    # The cached pin still checks every block it reads.
    fmt = dataformats.detect(str(data))
    rows = list(dataformats.iter_rows(str(data), fmt, pin=cached))
    assert rows == list(dataformats.iter_rows(str(data), fmt)) and len(rows) == 30000


def _rewritten_times_kept(data: Path) -> None:
    st = data.stat()
    with open(data, "r+b") as f:  # one byte changed, the size kept
        f.seek(pin.BLOCK + 10)
        f.write(b"Z")
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))


def _replaced(data: Path) -> None:
    other = data.with_name("o.jsonl")
    other.write_bytes(data.read_bytes())
    os.replace(other, data)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (_rewritten_times_kept, "the dataset changed since"),
        (lambda d: d.open("ab").write(b"{}\n"), "the dataset changed since"),
        (lambda d: os.truncate(d, 1000), "the dataset changed since"),
        (_replaced, "another file is at the dataset's path"),
        (lambda d: os.utime(d), "the dataset changed since"),
    ],
    ids=["rewritten-times-put-back", "appended", "truncated", "replaced", "touched"],
)
def test_a_changed_dataset_is_read_again(tmp_path: Path, change: object, why: str) -> None:
    data, jdir, _ = _kept(tmp_path)
    change(data)  # type: ignore[operator]
    got = _load(data, jdir)
    assert isinstance(got, str) and why in got and str(jdir) in got, got


def test_a_dataset_changed_just_before_its_read_is_not_trusted(tmp_path: Path) -> None:
    """git's racily-clean rule: the kernel's coarse timestamps could hide a write in the same
    tick as the read, so a file changed less than RACY_NS before it is read again."""
    data, jdir, _ = _kept(tmp_path, 10, age=pincache.RACY_NS // 2)
    got = _load(data, jdir)
    assert isinstance(got, str) and "had changed just before it was read" in got, got


@pytest.mark.parametrize("damage", ["flipped", "cut", "empty", "foreign"])
def test_a_damaged_cache_is_ignored_with_a_message(tmp_path: Path, damage: str) -> None:
    data, jdir, _ = _kept(tmp_path, 3000)
    f = Path(pincache.path_in(str(jdir)))
    b = bytearray(f.read_bytes())
    if damage == "flipped":
        b[len(b) // 2] ^= 1
    elif damage == "cut":
        del b[len(b) // 2 :]
    elif damage == "empty":
        b = bytearray()
    else:
        b[:8] = b"NOTAPIN!"
    f.write_bytes(bytes(b))
    got = _load(data, jdir)
    assert isinstance(got, str) and f"{f} was not used: " in got, got


def test_another_line_limit_or_path_is_not_this_cache(tmp_path: Path) -> None:
    data, jdir, _ = _kept(tmp_path, 3000)
    got = pincache.load(str(jdir), str(data), "jsonl", 1000)
    assert isinstance(got, str) and "another format or line limit" in got, got
    link = tmp_path / "elsewhere.jsonl"
    os.link(data, link)
    got = pincache.load(str(jdir), str(link), "jsonl", dataformats.MAX_LINE_BYTES)
    assert isinstance(got, str) and f"it is of {data}" in got, got
    assert pincache.load(str(tmp_path / "none"), str(data), "jsonl", 1) == ""


def test_a_resume_reads_the_dataset_only_when_it_may_have_changed(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Through the daemon: a start keeps the pin once accepted; the next takes it (and says
    so); a dataset rewritten with its modification time put back is read whole and refused
    as another job, and that refused start leaves the kept pin as it was."""
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    valid, _ = runkit.dataset(data, 12, malformed=False)
    offset = tmp_path / "wall-offset"  # the daemon's clock a minute on: the dataset is "old"
    offset.write_text("60\n")
    fault = f"wall_offset:{offset}"
    r = runkit.run(tiny_model_dir, data, out, fault=fault)
    assert r.returncode == 0, r.stderr[-3000:]
    kept = out / ".eagle3d" / "journal" / "shard-0-of-1" / pincache.NAME
    assert kept.is_file() and "its hash and rows from" not in r.stderr
    before = kept.read_bytes()
    r = runkit.run(tiny_model_dir, data, out, fault=fault)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"dataset: its hash and rows from {kept} (unchanged since)" in r.stderr, r.stderr
    runkit.assert_complete(out, valid, set())
    text = data.read_bytes()
    st = data.stat()
    i = text.index(b'"content": "') + len(b'"content": "')
    data.write_bytes(text[:i] + bytes([text[i] ^ 1]) + text[i + 1 :])
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = runkit.run(tiny_model_dir, data, out, fault=fault)
    assert r.returncode == 6, r.stderr[-3000:]
    assert f"{kept} was not used: the dataset changed since" in r.stderr, r.stderr
    assert "fingerprint" in r.stderr and "dataset_sha" in r.stderr, r.stderr[-3000:]
    assert kept.read_bytes() == before
