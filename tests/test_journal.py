"""Journal tests, modelled on LevelDB's log_test and etcd's repair tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from eagle3proto import events as ev
from eagle3proto.codec import HEADER_SIZE, MAX_RECORD, SegmentHeader, Stop, encode_frame, scan
from eagle3proto.journal import JournalError, JournalWriter
from eagle3proto.journalread import Follower, iter_events, list_segments


def saved(i: int) -> ev.SampleSaved:
    return ev.SampleSaved(
        idx=i, path=f"rows_0-2000/data_{i}.ckpt", bytes=1000 + i, tokens=10 + i, checksum="crc32:0"
    )


def write_journal(d: str, n: int, **kw: object) -> JournalWriter:
    w = JournalWriter(d, background=False, **kw)  # type: ignore[arg-type]
    w.open()
    for i in range(n):
        w.append(saved(i) if i % 2 else ev.SampleSent(idx=i, rid=f"r{i}", tokens=i))
    w.close()
    return w


def only_segment(d: str) -> str:
    (seg,) = list_segments(d)
    return seg


def frame_ends(data: bytes) -> list[int]:
    res = scan(data, HEADER_SIZE)
    ends, pos = [], HEADER_SIZE
    for p in res.payloads:
        pos += len(p) + 8
        ends.append(pos)
    return ends


def test_roundtrip_and_seq(tmp_path):
    d = str(tmp_path / "j")
    write_journal(d, 50)
    events, rep = iter_events(d)
    assert [e.seq for e in events] == list(range(50))
    assert rep.problems == [] and rep.next_seq == 50
    assert isinstance(events[1], ev.SampleSaved) and events[1].idx == 1
    assert all(e.run == rep.run_id for e in events)


def test_truncation_at_every_byte_returns_whole_record_prefix(tmp_path):
    d = str(tmp_path / "j")
    write_journal(d, 12)
    seg = only_segment(d)
    data = Path(seg).read_bytes()
    ends = frame_ends(data)
    assert len(ends) == 12
    for cut in range(HEADER_SIZE, len(data) + 1):
        with open(seg, "wb") as f:
            f.write(data[:cut])
        events, rep = iter_events(d)
        whole = sum(1 for e in ends if e <= cut)
        assert [e.seq for e in events] == list(range(whole)), cut
        if cut in ends or cut == HEADER_SIZE:
            assert rep.problems == []
        else:
            (p,) = rep.problems
            assert p.reason == "torn" and not p.fatal
            assert p.offset == (ends[whole - 1] if whole else HEADER_SIZE)


def test_zero_filled_tail_is_torn_not_records(tmp_path):
    d = str(tmp_path / "j")
    write_journal(d, 5)
    seg = only_segment(d)
    with open(seg, "ab") as f:
        f.write(bytes(4096))  # a preallocated / zeroed tail
    events, rep = iter_events(d)
    assert len(events) == 5
    (p,) = rep.problems
    assert p.reason == "torn" and "zeros" in p.detail and p.dropped_bytes == 4096


def test_zeroed_512_byte_block_in_the_middle_is_corruption(tmp_path):
    d = str(tmp_path / "j")
    w = JournalWriter(d, background=False)
    w.open()
    for i in range(40):
        w.append(ev.SampleFailed(idx=i, error="X", message="m" * 300))
    w.close()
    seg = only_segment(d)
    data = bytearray(Path(seg).read_bytes())
    start = 4096
    data[start : start + 512] = bytes(512)
    Path(seg).write_bytes(bytes(data))
    events, rep = iter_events(d)
    ends = frame_ends(bytes(data))
    assert 0 < len(events) < 40 and ends[len(events) - 1] <= start
    (p,) = rep.problems
    assert p.fatal and p.reason == "corrupt"
    assert [e.seq for e in events] == list(range(len(events)))


def test_zeroed_sector_in_last_frame_is_torn(tmp_path):
    d = str(tmp_path / "j")
    w = JournalWriter(d, background=False)
    w.open()
    w.append(ev.SampleSent(idx=0))
    w.append(ev.SampleFailed(idx=1, error="X", message="m" * 2000))
    w.close()
    seg = only_segment(d)
    data = bytearray(Path(seg).read_bytes())
    last_start = frame_ends(bytes(data))[0]
    data[last_start + 600 : last_start + 1600] = bytes(1000)  # covers a whole 512-byte sector
    Path(seg).write_bytes(bytes(data))
    events, rep = iter_events(d)
    assert len(events) == 1
    assert rep.problems[0].reason == "torn" and not rep.problems[0].fatal


def test_every_single_bit_flip_is_detected(tmp_path):
    d = str(tmp_path / "j")
    write_journal(d, 3)
    seg = only_segment(d)
    data = Path(seg).read_bytes()
    ends = frame_ends(data)
    original, _ = iter_events(d)
    lo, hi = ends[0], ends[1]  # the second frame, header and payload
    for byte in range(lo, hi):
        for bit in range(8):
            bad = bytearray(data)
            bad[byte] ^= 1 << bit
            Path(seg).write_bytes(bytes(bad))
            events, rep = iter_events(d)
            # Replay stops before the damaged frame and never yields a different record.
            assert len(events) == 1, (byte, bit)
            assert events[0] == original[0]
            assert rep.problems, (byte, bit)


def test_oversize_length_rejected_without_allocation(tmp_path):
    d = str(tmp_path / "j")
    write_journal(d, 2)
    seg = only_segment(d)
    with open(seg, "ab") as f:
        f.write((0).to_bytes(4, "little") + (0xFFFFFFF0).to_bytes(4, "little") + b"junk" * 10)
    events, rep = iter_events(d)
    assert len(events) == 2
    (p,) = rep.problems
    assert p.fatal and "bad_length" in p.detail
    # The codec itself refuses to frame (or accept) anything above the cap.
    with pytest.raises(ValueError):
        encode_frame(b"x" * (MAX_RECORD + 1))
    huge = (0).to_bytes(4, "little") + (MAX_RECORD + 1).to_bytes(4, "little") + b"x"
    assert scan(huge).stop is Stop.BAD_LENGTH


def test_seq_gap_detected(tmp_path):
    d = str(tmp_path / "j")
    w = JournalWriter(d, background=False)
    w.open()
    w.append(ev.SampleSent(idx=0))
    w.append(ev.SampleSent(idx=1))
    w.flush()
    # Forge a well-framed record that skips a seq.
    with open(w._segment, "ab") as f:
        f.write(encode_frame(ev.encode(ev.SampleSent(idx=2, seq=5, run=w.run_id, ts=1.0))))
    w.close()
    events, rep = iter_events(d)
    assert [e.seq for e in events] == [0, 1]
    assert rep.problems[0].reason == "seq_gap" and rep.problems[0].fatal


def test_frame_from_another_run_detected(tmp_path):
    d = str(tmp_path / "j")
    w = JournalWriter(d, background=False)
    w.open()
    w.append(ev.SampleSent(idx=0))
    w.flush()
    with open(w._segment, "ab") as f:
        f.write(encode_frame(ev.encode(ev.SampleSent(idx=1, seq=1, run="f" * 32, ts=1.0))))
    w.close()
    events, rep = iter_events(d)
    assert len(events) == 1
    assert rep.problems[0].reason == "foreign_run"


def test_segment_of_another_run_detected(tmp_path):
    d = str(tmp_path / "j")
    write_journal(d, 3)
    other = SegmentHeader("ab" * 16, 3).pack()
    with open(os.path.join(d, "0000000000000003.e3j"), "wb") as f:
        f.write(other)
    events, rep = iter_events(d)
    assert len(events) == 3
    assert rep.problems[0].reason == "foreign_run"


def test_append_after_recovery_is_reachable(tmp_path):
    d = str(tmp_path / "j")
    write_journal(d, 6)
    seg = only_segment(d)
    torn = encode_frame(ev.encode(saved(6)))[:16]  # a writer died mid-append
    with open(seg, "ab") as f:
        f.write(torn)
    w = JournalWriter(d, background=False)
    rep = w.open()
    assert rep.next_seq == 6
    w.append(ev.SampleSent(idx=99))
    w.close()
    events, rep2 = iter_events(d)
    assert rep2.problems == []
    kinds = [e.kind for e in events]
    assert kinds[-2:] == ["recovered", "sample_sent"]
    assert [e.seq for e in events] == list(range(8))
    rec = events[6]
    assert isinstance(rec, ev.Recovered) and rec.reason == "torn" and rec.dropped_bytes == 16
    assert os.path.exists(rec.kept) and Path(rec.kept).read_bytes() == torn
    assert len(list_segments(d)) == 2  # a new segment at every open


def test_corruption_in_the_middle_repaired_and_reported(tmp_path):
    d = str(tmp_path / "j")
    write_journal(d, 10)
    seg = only_segment(d)
    data = bytearray(Path(seg).read_bytes())
    ends = frame_ends(bytes(data))
    data[ends[3] + 10] ^= 0xFF
    Path(seg).write_bytes(bytes(data))
    w = JournalWriter(d, background=False)
    rep = w.open()
    assert rep.next_seq == 4 and rep.stopped_early
    w.close()
    events, rep2 = iter_events(d)
    assert rep2.problems == []
    assert [e.kind for e in events][-1] == "recovered"
    assert events[-1].reason == "corrupt"  # type: ignore[union-attr]


@pytest.mark.parametrize("many", [False, True], ids=["append", "append_many"])
def test_short_write_truncates_back_and_reports(tmp_path, many):
    from eagle3proto.fileops import OsFileOps

    class FullDisk(OsFileOps):
        armed = False

        def write(self, fd, data):
            if self.armed:
                return super().write(fd, bytes(data)[:5])  # a short write, as ENOSPC gives
            return super().write(fd, data)

    fs = FullDisk()
    d = str(tmp_path / "j")
    w = JournalWriter(d, background=False, fileops=fs)
    w.open()
    w.append(saved(0))
    fs.armed = True
    with pytest.raises(JournalError):
        if many:  # none of a failed batch is recorded
            w.append_many([saved(1), saved(3), saved(4)])
        else:
            w.append(saved(1))
    fs.armed = False
    w.append(saved(2))
    w.close()
    events, rep = iter_events(d)
    assert rep.problems == []
    assert [(e.seq, e.idx) for e in events] == [(0, 0), (1, 2)]  # type: ignore[union-attr]


def test_durable_records_are_synced_before_append_returns(tmp_path):
    from eagle3proto.fileops import OsFileOps

    class Counting(OsFileOps):
        syncs = 0

        def fdatasync(self, fd):
            Counting.syncs += 1
            super().fdatasync(fd)

    d = str(tmp_path / "j")
    w = JournalWriter(d, background=False, fileops=Counting())
    w.open()
    base = Counting.syncs
    for i in range(10):
        w.append(ev.SampleSent(idx=i))
    assert Counting.syncs == base  # chatty: no fsync
    w.append(saved(1))
    assert Counting.syncs == base + 1
    w.close()


def test_append_many_is_one_write_and_one_sync_published_after_it(tmp_path):
    from eagle3proto.fileops import OsFileOps

    class Counting(OsFileOps):
        writes = syncs = 0
        published_at_sync: list[int] = []

        def write(self, fd, data):
            Counting.writes += 1
            return super().write(fd, data)

        def fdatasync(self, fd):
            Counting.syncs += 1
            Counting.published_at_sync.append(len(got))
            super().fdatasync(fd)

    got: list[int] = []
    d = str(tmp_path / "j")
    w = JournalWriter(d, background=False, fileops=Counting(), listener=lambda e: got.append(e.seq))
    w.open()
    w.append(ev.SampleSent(idx=0))  # chatty, buffered: goes out with the batch
    writes, syncs = Counting.writes, Counting.syncs
    batch = [saved(i) for i in range(1, 6)]
    w.append_many(list(batch))
    assert (Counting.writes - writes, Counting.syncs - syncs) == (1, 1)
    assert Counting.published_at_sync[-1] == 0  # nothing was published before the sync
    assert got == [0, 1, 2, 3, 4, 5]
    assert [e.seq for e in batch] == [1, 2, 3, 4, 5]
    w.append_many([])
    assert Counting.syncs - syncs == 1
    w.close()
    events, rep = iter_events(d)
    assert rep.problems == []
    assert [e.seq for e in events][-6:] == [0, 1, 2, 3, 4, 5]


def test_listener_sees_records_in_seq_order_from_threads(tmp_path):
    import threading

    got: list[int] = []
    d = str(tmp_path / "j")
    w = JournalWriter(d, listener=lambda e: got.append(e.seq))
    w.open()

    def work(k: int) -> None:
        for i in range(200):
            w.append(saved(i) if (i + k) % 7 == 0 else ev.SampleSent(idx=i))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.close()
    assert got == list(range(800))


def test_rotation_at_size_cap(tmp_path):
    d = str(tmp_path / "j")
    write_journal(d, 400, segment_bytes=4096)
    assert len(list_segments(d)) > 3
    events, rep = iter_events(d)
    assert rep.problems == [] and [e.seq for e in events] == list(range(400))


def test_unknown_kinds_and_fields_are_tolerated(tmp_path):
    import msgspec

    d = str(tmp_path / "j")
    w = JournalWriter(d, background=False)
    w.open()
    w.append(ev.SampleSent(idx=0))
    future = {"kind": "from_the_future", "seq": 1, "ts": 1.0, "run": w.run_id, "x": [1, 2]}
    newer = {"kind": "sample_sent", "seq": 2, "ts": 1.0, "run": w.run_id, "idx": 3, "new": 7}
    w.flush()
    with open(w._segment, "ab") as f:
        for m in (future, newer):
            f.write(encode_frame(msgspec.msgpack.encode(m)))
    w._next_seq = 3
    w.close()
    events, rep = iter_events(d)
    assert rep.problems == []
    assert isinstance(events[1], ev.Unknown) and events[1].kind == "from_the_future"
    assert isinstance(events[2], ev.SampleSent) and events[2].idx == 3


def test_follower_sees_records_appended_by_another_process(tmp_path):
    d = str(tmp_path / "j")
    f = Follower(d)
    assert f.poll() == []
    code = textwrap.dedent(
        f"""
        import time
        from eagle3proto import events as ev
        from eagle3proto.journal import JournalWriter
        for session in range(2):
            w = JournalWriter({d!r}, flush_interval=0.01)
            w.open()
            for i in range(50):
                w.append(ev.SampleSent(idx=i))
                if i % 10 == 0:
                    time.sleep(0.02)
            w.close()
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    seen: list[int] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        seen += [e.seq for e in f.poll()]
        if proc.poll() is not None and len(seen) >= 100:
            break
        time.sleep(0.01)
    seen += [e.seq for e in f.poll()]
    assert proc.wait() == 0
    assert seen == list(range(100))  # both segments, nothing twice, nothing skipped
    assert f.stuck is None
