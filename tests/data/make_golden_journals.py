"""Regenerate the golden journals in tests/data/golden/ (run by hand, then review the diff).

Each scenario is a scripted list of events with fixed timestamps, written through the real
JournalWriter into ``golden/<name>/``. The expected snapshots beside them
(``<name>.expected.json``) are written by hand from the scenario, not by the reducer.

    .venv/bin/python tests/data/make_golden_journals.py
"""

from __future__ import annotations

import os
import shutil
import sys

from eagle3proto import events as ev
from eagle3proto.codec import encode_frame
from eagle3proto.journal import JournalWriter

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
RUN = "0123456789abcdef0123456789abcdef"


def saved(idx: int, ts: float, tokens: int = 100, nbytes: int = 4000) -> ev.SampleSaved:
    return ev.SampleSaved(
        idx=idx,
        ts=ts,
        path=f"rows_0-2000/data_{idx}.ckpt",
        bytes=nbytes,
        tokens=tokens,
        checksum="crc32:00000000",
    )


def started(total: int, ts: float, session: int = 1) -> ev.RunStarted:
    return ev.RunStarted(
        ts=ts, total=total, session=session, job=ev.JobInfo(model="m", dataset="d")
    )


SCENARIOS: dict[str, list[ev.Event]] = {
    # 5 samples: 3 saved, one dumped and committing, one whose first attempt failed and was resent.
    "pipeline": [
        started(5, 1.0),
        *[ev.SampleSent(idx=i, ts=2.0, attempt=1, tokens=100) for i in range(5)],
        *[ev.SampleDumped(idx=i, ts=3.0) for i in range(4)],
        saved(0, 10.0),
        saved(1, 11.0),
        saved(2, 12.0),
        ev.SampleFailed(idx=4, ts=13.0, error="Timeout", message="no dump", attempt=1, retry=True),
        ev.SampleSent(idx=4, ts=13.0, attempt=2, tokens=100),
    ],
    # A crash after one sample, then a second session that finishes the job.
    "resume": [
        started(4, 1.0),
        ev.SampleSent(idx=0, ts=2.0),
        ev.SampleSent(idx=1, ts=2.0),
        ev.SampleDumped(idx=0, ts=3.0),
        saved(0, 4.0),
        started(4, 100.0, session=2),
        *[ev.SampleSent(idx=i, ts=101.0, attempt=1) for i in (1, 2, 3)],
        *[ev.SampleDumped(idx=i, ts=102.0) for i in (1, 2, 3)],
        saved(1, 103.0),
        saved(2, 103.5),
        saved(3, 104.0),
        ev.RunFinished(ts=105.0, saved=4, failed=0),
    ],
    # Retries exhausted, a malformed line, and a stop by signal.
    "failures": [
        started(3, 1.0),
        ev.SampleFailed(
            idx=1, ts=1.5, error="bad_json", message="line 2 (sample 1): bad JSON", attempt=0
        ),
        ev.SampleSent(idx=0, ts=2.0),
        ev.SampleSent(idx=2, ts=2.0),
        ev.SampleFailed(idx=0, ts=3.0, error="BadDump", message="NaN", attempt=1, retry=True),
        ev.SampleSent(idx=0, ts=3.0, attempt=2),
        ev.SampleFailed(idx=0, ts=4.0, error="BadDump", message="NaN", attempt=2, retry=False),
        ev.RunState(ts=4.5, state="draining", reason="signal SIGTERM"),
        ev.RunStopped(ts=5.0, reason="signal SIGTERM"),
    ],
    # One sample a second for 60 s, half of a 120-sample job: rates and ETA.
    "rates": [
        started(120, 99.0),
        *[
            x
            for i in range(60)
            for x in (ev.SampleSent(idx=i, ts=100.0 + i), saved(i, 100.0 + i + 0.5))
        ],
    ],
    # A record of a kind from a newer eagle3d, then a stats record and a paused state.
    "unknown_kind": [
        started(2, 1.0),
        ev.SampleSent(idx=0, ts=2.0),
        ev.Stats(
            ts=3.0,
            disk=[ev.DiskUsage(label="output", total_bytes=100, used_bytes=60, free_bytes=40)],
        ),
        ev.RunState(ts=4.0, state="paused", reason="disk full"),
    ],
}


def write(name: str, events: list[ev.Event]) -> None:
    d = os.path.join(HERE, name)
    shutil.rmtree(d, ignore_errors=True)
    w = JournalWriter(d, background=False)
    w.open()
    w.run_id = RUN
    for e in events:
        w.append(e)
    if name == "unknown_kind":
        import msgspec

        w.flush()
        with open(w._segment, "ab") as f:
            f.write(
                encode_frame(
                    msgspec.msgpack.encode(
                        {
                            "kind": "from_the_future",
                            "seq": w._next_seq,
                            "ts": 5.0,
                            "run": RUN,
                            "x": 1,
                        }
                    )
                )
            )
        w._next_seq += 1
    w.close()


def write_torn() -> None:
    """The 'pipeline' journal with its last frame torn in half."""
    src = os.path.join(HERE, "pipeline")
    dst = os.path.join(HERE, "torn")
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    (seg,) = [os.path.join(dst, n) for n in os.listdir(dst)]
    size = os.path.getsize(seg)
    os.truncate(seg, size - 20)


def main() -> int:
    # The run id must be in every segment header too, so patch it before the first segment.
    orig = JournalWriter._start_segment

    def start_with_fixed_run(self: JournalWriter) -> None:
        self.run_id = RUN
        orig(self)

    JournalWriter._start_segment = start_with_fixed_run  # type: ignore[method-assign]
    for name, events in SCENARIOS.items():
        write(name, events)
    write_torn()
    print(f"wrote {len(SCENARIOS) + 1} golden journals under {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
