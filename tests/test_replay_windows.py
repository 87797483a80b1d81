"""A replay reads each journal segment a window at a time (issue #29: ``verify``'s memory
must not grow with a segment's size or the job's): whatever the window, a replay finds the
same records and the same problems as one that reads a segment whole, and ``verify`` over a
segment many windows long reads no more than a window (and a carried frame) at once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from eagle3d.store.crc import file_checksum
from eagle3d.tools.verify import Options, verify
from eagle3proto import events as ev
from eagle3proto import journalread, paths
from eagle3proto.codec import HEADER_SIZE, MAX_RECORD
from eagle3proto.journal import JournalWriter
from eagle3proto.journalread import Replay, iter_events, list_segments

#: Windows that cut frames everywhere: inside a frame's header, its payload, at its end.
WINDOWS = (1, 7, 8, 9, 64, 333, 4096)


def _journal(d: str, n: int, big: int = 0) -> str:
    w = JournalWriter(d, background=False)
    w.open()
    for i in range(n):
        if big and i == n // 2:  # a record larger than the small windows, mid-segment
            w.append(ev.SampleFailed(idx=i, error="X", message="m" * big))
        elif i % 2:
            w.append(ev.SampleSent(idx=i, rid=f"r{i}", tokens=i))
        else:
            w.append(ev.SampleFailed(idx=i, error="X", message="m" * (i % 700)))
    w.close()
    (seg,) = list_segments(d)
    return seg


def _summary(rep: Replay, events: list[ev.AnyEvent]) -> tuple[object, ...]:
    ends = {os.path.basename(k): v for k, v in rep.good_ends.items()}
    return ([e.seq for e in events], rep.problems, rep.next_seq, rep.count, ends)


def _same_at_every_window(d: str, monkeypatch: pytest.MonkeyPatch) -> tuple[object, ...]:
    monkeypatch.setattr(journalread, "WINDOW", 1 << 30)
    whole = _summary(*reversed(iter_events(d)))
    for window in WINDOWS:
        monkeypatch.setattr(journalread, "WINDOW", window)
        assert _summary(*reversed(iter_events(d))) == whole, window
    return whole


def _damage(seg: str, at: int, data: bytes) -> None:
    with open(seg, "r+b") as f:
        f.seek(at)
        f.write(data)


def test_clean_journal_same_records_at_every_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = str(tmp_path / "j")
    _journal(d, 60, big=5000)
    seqs, problems, *_ = _same_at_every_window(d, monkeypatch)
    assert seqs == list(range(60)) and problems == []


@pytest.mark.parametrize(
    "damage",
    ["torn_tail", "zero_tail", "zeros_then_bytes", "bit_flip", "zero_sector", "bad_length"],
)
def test_damaged_journal_same_problems_at_every_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    d = str(tmp_path / "j")
    seg = _journal(d, 40, big=3000)
    size = os.path.getsize(seg)
    mid = HEADER_SIZE + (size - HEADER_SIZE) // 2
    if damage == "torn_tail":
        os.truncate(seg, size - 5)
    elif damage == "zero_tail":
        with open(seg, "ab") as f:
            f.write(bytes(3000))
    elif damage == "zeros_then_bytes":  # a zero length with data after it: corruption
        with open(seg, "ab") as f:
            f.write(bytes(3000) + b"\x01")
    elif damage == "bit_flip":
        _damage(seg, mid, bytes([Path(seg).read_bytes()[mid] ^ 0x10]))
    elif damage == "zero_sector":
        _damage(seg, mid - 700, bytes(1024))
    else:
        _damage(seg, HEADER_SIZE + 4, (MAX_RECORD + 1).to_bytes(4, "little"))
    _seqs, problems, *_ = _same_at_every_window(d, monkeypatch)
    assert problems, damage


def _saved_samples(out: Path, n: int) -> str:
    """A journal of ``n`` small samples saved under ``out`` (their files written); its
    directory."""
    jdir = paths.journal_dir(str(out), paths.Shard())
    w = JournalWriter(jdir, background=False)
    w.open()
    for i in range(n):
        rel = paths.sample_relpath(i)
        f = out / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(bytes([i % 251]) * (64 + i % 50))
        size, crc = file_checksum(str(f))
        w.append(ev.SampleSent(idx=i, rid=f"r{i}", tokens=16))
        w.append(ev.SampleSaved(idx=i, path=rel, bytes=size, tokens=16, checksum=crc))
    w.close()
    return jdir


def test_verify_in_batches_reports_what_one_file_a_task_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verify hands its pool batches of files (:data:`verify.BATCH_FILES`, ``BATCH_BYTES``):
    whatever the batch, the same counts and the same problems, in journal order."""
    from eagle3d.tools import verify as verify_mod

    out = tmp_path / "out"
    _saved_samples(out, 500)
    os.remove(out / paths.sample_relpath(3))
    with open(out / paths.sample_relpath(130), "ab") as f:
        f.write(b"x")  # a size that differs
    flip = out / paths.sample_relpath(499)
    data = bytearray(flip.read_bytes())
    data[0] ^= 1  # the last sample's bytes: the last, partial batch
    flip.write_bytes(bytes(data))
    monkeypatch.setattr(verify_mod, "BATCH_FILES", 1)
    one = verify(str(out), options=Options(jobs=3)).to_dict()
    assert one["checked"] == 500 and len(one["problems"]) == 3
    assert [p.split(":")[0] for p in one["problems"]] == ["sample 3", "sample 130", "sample 499"]
    for files, nbytes in ((7, 1 << 30), (64, 1 << 30), (1000, 1000), (64, 1)):
        monkeypatch.setattr(verify_mod, "BATCH_FILES", files)
        monkeypatch.setattr(verify_mod, "BATCH_BYTES", nbytes)
        assert verify(str(out), options=Options(jobs=3)).to_dict() == one, (files, nbytes)


def test_verify_reads_a_long_segment_in_bounded_windows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An instrumented read seam: with a 4 KiB window, a verify of a ~300 KiB segment never
    asks for more than a window at once, and finds what it finds with whole reads."""
    out = tmp_path / "out"
    n = 1500
    jdir = _saved_samples(out, n)
    os.remove(out / paths.sample_relpath(777))  # one problem, for the report to name
    (seg,) = list_segments(jdir)
    window = 4096
    assert os.path.getsize(seg) > 50 * window

    monkeypatch.setattr(journalread, "WINDOW", 1 << 30)
    whole = verify(str(out), options=Options(jobs=2)).to_dict()

    reads: list[int] = []
    real = journalread._read_window

    def counted(fd: int, k: int, offset: int) -> bytes:
        reads.append(k)
        return real(fd, k, offset)

    monkeypatch.setattr(journalread, "WINDOW", window)
    monkeypatch.setattr(journalread, "_read_window", counted)
    windowed = verify(str(out), options=Options(jobs=2)).to_dict()
    assert windowed == whole
    assert windowed["checked"] == n and windowed["problems"] == [
        f"sample 777: {paths.sample_relpath(777)} is missing"
    ]
    assert max(reads) <= window
    assert sum(reads) >= 2 * (os.path.getsize(seg) - HEADER_SIZE)  # both passes, windowed
