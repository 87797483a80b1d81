"""Journal benchmarks: append throughput with group commit, and replay of a 1M-record journal.

Each figure is reported with a baseline measured in the same run on the same disk:

* appends are compared with writing pre-encoded frames with plain ``os.write`` in 64 KiB
  chunks (no encoding, no locking, no seq bookkeeping) and one final fdatasync;
* replay is compared with a bare loop that only reads the file and unpacks frame headers.

    .venv/bin/python bench/bench_journal.py [--records 1000000] [--dir DIR] [--markdown]
"""

from __future__ import annotations

import argparse
import os
import shutil
import struct
import sys
import tempfile
import threading
import time

from eagle3proto import events as ev
from eagle3proto import reducer
from eagle3proto.codec import HEADER_SIZE, encode_frame
from eagle3proto.journal import JournalWriter
from eagle3proto.journalread import list_segments, replay


def sample_events(n: int) -> list[ev.Event]:
    """A realistic mix: per sample sent, dumped and saved; a stats record every 100."""
    out: list[ev.Event] = []
    i = 0
    while len(out) < n:
        out.append(ev.SampleSent(idx=i, rid=f"0123abcd-0-1-{i}-1", attempt=1, tokens=2300))
        out.append(ev.SampleDumped(idx=i, rid=f"0123abcd-0-1-{i}-1", bytes=101_000_000))
        out.append(
            ev.SampleSaved(
                idx=i,
                path=f"rows_{i // 2000 * 2000}-{i // 2000 * 2000 + 2000}/data_{i}.ckpt",
                bytes=101_000_000,
                tokens=2300,
                checksum="crc32:1234abcd",
            )
        )
        if i % 100 == 0:
            out.append(ev.Stats(cpu_percent=12.5, rss_bytes=300 << 20, inflight=64))
        i += 1
    return out[:n]


def bench_baseline_write(d: str, frames: list[bytes]) -> float:
    path = os.path.join(d, "baseline.bin")
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    buf: list[bytes] = []
    size = 0
    for f in frames:
        buf.append(f)
        size += len(f)
        if size >= 1 << 16:
            os.write(fd, b"".join(buf))
            buf, size = [], 0
    os.write(fd, b"".join(buf))
    os.fdatasync(fd)
    os.close(fd)
    return len(frames) / (time.perf_counter() - t)


def bench_chatty(d: str, events: list[ev.Event]) -> tuple[float, int]:
    """All records appended as chatty (flushed every 0.1 s, fdatasync'ed every 1 s)."""
    w = JournalWriter(os.path.join(d, "chatty"))
    w.open()
    t = time.perf_counter()
    for e in events:
        w.append(e, durable=False)
    w.close()
    return len(events) / (time.perf_counter() - t), w.sync_count


def bench_group_commit(d: str, events: list[ev.Event], threads: int) -> tuple[float, int, int]:
    """The daemon's mix from ``threads`` threads: saved records durable, the rest chatty."""
    w = JournalWriter(os.path.join(d, f"group{threads}"))
    w.open()
    chunks = [events[i::threads] for i in range(threads)]

    def work(chunk: list[ev.Event]) -> None:
        for e in chunk:
            w.append(e)

    t = time.perf_counter()
    ts = [threading.Thread(target=work, args=(c,)) for c in chunks]
    for x in ts:
        x.start()
    for x in ts:
        x.join()
    w.close()
    durable = sum(1 for e in events if type(e).durable)
    return len(events) / (time.perf_counter() - t), durable, w.sync_count


def bench_replay(jdir: str) -> tuple[float, float, float, int]:
    t = time.perf_counter()
    n, unpack = 0, struct.Struct("<II").unpack_from
    for seg in list_segments(jdir):
        with open(seg, "rb") as f:
            data = f.read()
        pos = HEADER_SIZE
        while pos + 8 <= len(data):
            _, length = unpack(data, pos)
            pos += 8 + length
            n += 1
    bare = time.perf_counter() - t
    count = 0

    def sink(batch: list[ev.AnyEvent]) -> None:
        nonlocal count
        count += len(batch)

    t = time.perf_counter()
    replay(jdir, sink)
    decode = time.perf_counter() - t
    state = reducer.new_state()
    t = time.perf_counter()
    replay(jdir, lambda b: reducer.apply_all(state, b))
    full = time.perf_counter() - t
    assert count == n == state.seq + 1, (count, n, state.seq)
    return bare, decode, full, count


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument(
        "--dir", default=None, help="where to write (default: a temp dir on /work's disk)"
    )
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    base = args.dir or tempfile.mkdtemp(
        prefix="bench-journal-", dir=os.path.dirname(os.path.abspath(__file__))
    )
    os.makedirs(base, exist_ok=True)
    try:
        events = sample_events(args.records)
        frames = [encode_frame(ev.encode(e)) for e in sample_events(args.records)]
        base_rate = bench_baseline_write(base, frames)
        chatty_rate, chatty_syncs = bench_chatty(base, events)
        events = sample_events(args.records)
        g1 = bench_group_commit(base, events, 1)
        events = sample_events(args.records // 10)
        g8 = bench_group_commit(base, events, 8)
        bare, decode, full, count = bench_replay(os.path.join(base, "chatty"))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = [
        (
            "plain os.write of pre-encoded frames, 1 fdatasync (baseline)",
            f"{base_rate:,.0f} rec/s",
            "1.00",
        ),
        (
            f"append, chatty (flush 0.1 s, fdatasync 1 s; {chatty_syncs} syncs)",
            f"{chatty_rate:,.0f} rec/s",
            f"{chatty_rate / base_rate:.2f}",
        ),
        (
            f"append, daemon mix, 1 thread ({g1[1]:,} durable, {g1[2]:,} fdatasyncs)",
            f"{g1[0]:,.0f} rec/s",
            f"{g1[0] / base_rate:.2f}",
        ),
        (
            f"append, daemon mix, 8 threads ({g8[1]:,} durable, {g8[2]:,} fdatasyncs: {g8[1] / max(g8[2], 1):.1f} per sync)",
            f"{g8[0]:,.0f} rec/s",
            f"{g8[0] / base_rate:.2f}",
        ),
        (f"replay {count:,} records: read + frame walk only (baseline)", f"{bare:.2f} s", "1.00"),
        (
            f"replay {count:,} records: CRC + decode (eagle3proto.journalread.replay)",
            f"{decode:.2f} s",
            f"{decode / bare:.1f}",
        ),
        (
            f"replay {count:,} records: CRC + decode + reducer fold",
            f"{full:.2f} s",
            f"{full / bare:.1f}",
        ),
    ]
    if args.markdown:
        print("| measurement | result | ratio to baseline |\n|---|---|---|")
        for r in rows:
            print(f"| {r[0]} | {r[1]} | {r[2]} |")
    else:
        for r in rows:
            print(f"{r[1]:>16}  x{r[2]:>5}  {r[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
