"""The crash loop: its independent checker (``tests/crashcheck.py``), and short loops of
``bench/crashloop.py``.

The checker is tested against outputs built with the real JournalWriter and deliberately
damaged (a missing, truncated or stray file, a duplicate record, a corrupt frame), so a loop
that reports zero problems is a loop whose checks can fail.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import zlib
from pathlib import Path

import crashcheck as cl
import pytest
from eagle3proto import events as ev
from eagle3proto.journal import JournalWriter

REPO = Path(__file__).resolve().parent.parent


def _jdir(out: Path) -> Path:
    return out / ".eagle3d" / "journal" / "shard-0-of-1"


def _write_sample(out: Path, idx: int, content: bytes) -> tuple[str, int, str]:
    rel = cl.relpath_of(idx)
    p = out / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(content)
    return rel, len(content), f"crc32:{zlib.crc32(content):08x}"


def _build(out: Path, saved: list[int], sent_only: tuple[int, ...] = ()) -> None:
    """An output with real journal records: ``saved`` committed, ``sent_only`` in flight."""
    with JournalWriter(str(_jdir(out))) as j:
        j.open()
        j.append(ev.RunStarted(total=10))
        for i in [*saved, *sent_only]:
            j.append(ev.SampleSent(idx=i, rid=f"r-{i}"))
        for i in saved:
            rel, n, crc = _write_sample(out, i, f"sample {i} ".encode() * (i + 3))
            j.append(ev.SampleSaved(idx=i, path=rel, bytes=n, tokens=3, checksum=crc))
        j.append(ev.SampleFailed(idx=9, error="bad_json", message="line 10"))


def test_reader_sees_what_the_writer_wrote(tmp_path: Path) -> None:
    _build(tmp_path, [0, 1, 2])
    view = cl.read_journal(str(_jdir(tmp_path)))
    kinds = [r["kind"] for r in view.records]
    assert kinds.count("sample_saved") == 3 and kinds[0] == "run_started"
    assert [r.get("seq", 0) for r in view.records] == list(range(len(view.records)))
    assert not view.problems and not view.torn_tail
    c = cl.check_output(str(tmp_path))
    assert c.saved == {0, 1, 2} and c.failed == {9} and c.files_checked == 3 and not c.bad


def test_torn_tail_is_tolerated_but_a_corrupt_middle_is_not(tmp_path: Path) -> None:
    _build(tmp_path, [0, 1, 2])
    seg = sorted(_jdir(tmp_path).glob("*.e3j"))[-1]
    data = seg.read_bytes()
    seg.write_bytes(data + data[64:80])  # half a frame header + payload start: torn
    view = cl.read_journal(str(_jdir(tmp_path)))
    assert view.torn_tail and not view.problems
    bad = bytearray(data)
    bad[100] ^= 0x01  # a flipped bit inside an early frame, with valid data after it
    seg.write_bytes(bytes(bad))
    view = cl.read_journal(str(_jdir(tmp_path)))
    assert view.problems and "corrupt" in view.problems[0]


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped", "stray", "duplicate"])
def test_checker_catches_damage(tmp_path: Path, damage: str) -> None:
    _build(tmp_path, [0, 1, 2, 3])
    f = tmp_path / cl.relpath_of(2)
    if damage == "missing":
        f.unlink()
    elif damage == "truncated":
        f.write_bytes(f.read_bytes()[:-1])
    elif damage == "flipped":
        b = bytearray(f.read_bytes())
        b[0] ^= 0x40
        f.write_bytes(bytes(b))
    elif damage == "stray":
        _write_sample(tmp_path, 7, b"nobody asked for me")
    elif damage == "duplicate":
        with JournalWriter(str(_jdir(tmp_path))) as j:
            j.open()
            rel, n, crc = _write_sample(tmp_path, 2, f"sample {2} ".encode() * 5)
            j.append(ev.SampleSaved(idx=2, path=rel, bytes=n, tokens=3, checksum=crc))
    c = cl.check_output(str(tmp_path))
    found = {
        "missing": c.lost,
        "truncated": c.corrupt,
        "flipped": c.corrupt,
        "stray": c.unaccounted,
        "duplicate": c.duplicated,
    }[damage]
    assert found, (damage, c)
    assert len(c.bad) == len(found)


def test_checker_catches_a_sample_sent_again_without_a_failure(tmp_path: Path) -> None:
    _build(tmp_path, [0, 1])
    with JournalWriter(str(_jdir(tmp_path))) as j:
        j.open()
        # A retry after a journaled failure is fine; attempt 2 of sample 1 with none is not.
        j.append(ev.SampleSent(idx=5, rid="r-5-1", attempt=1))
        j.append(ev.SampleFailed(idx=5, error="Timeout", message="m", attempt=1, retry=True))
        j.append(ev.SampleSent(idx=5, rid="r-5-2", attempt=2))
        j.append(ev.SampleSent(idx=1, rid="r-1-2", attempt=2))
        # A new session starts counting attempts again.
        j.append(ev.RunStarted(total=10, session=2))
        j.append(ev.SampleSent(idx=5, rid="r-5-1b", attempt=1))
    c = cl.check_output(str(tmp_path))
    assert len(c.resent) == 1 and c.resent[0].startswith("sample 1: attempt 2"), c.resent
    assert c.bad == c.resent


def test_temp_files_and_uncommitted_leftovers_are_accounted(tmp_path: Path) -> None:
    _build(tmp_path, [0, 1], sent_only=(4,))
    _write_sample(tmp_path, 4, b"renamed but not yet journaled")  # a crash after the rename
    (tmp_path / "rows_0-2000" / ".data_5.ckpt.tmp-123-0").write_bytes(b"half")
    c = cl.check_output(str(tmp_path))
    assert not c.bad
    assert c.leftovers == [4] and c.temp_files == 1


def test_expected_malformed_matches_the_demo_dataset() -> None:
    lines = (REPO / "daemon" / "eagle3d" / "data" / "demo.jsonl").read_text().splitlines()
    assert {i for i, ln in enumerate(lines) if cl.expected_malformed(ln)} == {41, 142, 263}


def test_short_crash_loop(tiny_model_dir: Path, tmp_path: Path) -> None:
    """At least 5 SIGKILLs at random moments; every check after every kill must pass."""
    seed = random.randrange(1 << 30)
    print(f"crashloop seed {seed}")
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "crashloop.py"),
            "--kills",
            "5",
            "--seed",
            str(seed),
            "--samples",
            "40",
            "--startup-fraction",
            "0.4",
            "--startup-window",
            "4",
            "--commit-window",
            "1.5",
            "--max-delay",
            "2",
            "--model",
            str(tiny_model_dir),
            "--workdir",
            str(tmp_path),
            "--json",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout
    summary = json.loads(out[out.index("{") :])
    assert summary["kills"] >= 5, summary
    assert summary["checks"] == summary["kills"] + summary["natural_exits"]
    assert summary["lost"] == summary["duplicated"] == summary["corrupt"] == 0, summary
    assert summary["unaccounted"] == summary["journal_problems"] == 0, summary
    assert summary["final_problems"] == 0, summary
    assert summary["ok"] and r.returncode == 0, (seed, summary["examples"], r.stderr[-2000:])


def test_short_crash_loop_with_group_signals(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGINT and SIGTERM to the daemon's whole process group (a terminal's Ctrl-C, scancel)
    at random moments, mixed with SIGKILLs: every signalled daemon drains and exits 0, and
    no valid sample is ever recorded failed (burnt); every check passes."""
    seed = random.randrange(1 << 30)
    print(f"crashloop seed {seed}")
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "crashloop.py"),
            "--kills",
            "6",
            "--seed",
            str(seed),
            "--samples",
            "60",
            "--signal-fraction",
            "0.7",
            "--startup-fraction",
            "0.2",
            "--max-delay",
            "3",
            # Batches of about one sample and a rest after each: work is in flight when
            # the signal comes, whatever the machine's speed.
            "--daemon-arg=--batch-tokens",
            "--daemon-arg=256",
            "--fault",
            "worker_slow:100",
            "--model",
            str(tiny_model_dir),
            "--workdir",
            str(tmp_path),
            "--json",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = r.stdout
    summary = json.loads(out[out.index("{") :])
    assert summary["signals_int"] + summary["signals_term"] >= 1, summary
    assert summary["burnt"] == 0 and summary["signal_stops_unclean"] == 0, summary
    assert summary["lost"] == summary["duplicated"] == summary["corrupt"] == 0, summary
    assert summary["unaccounted"] == summary["journal_problems"] == 0, summary
    assert summary["ok"] and r.returncode == 0, (seed, summary["examples"], r.stderr[-2000:])


def test_short_crash_loop_with_file_faults(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``--file-faults`` (issue 26): the dataset rewritten in place, a row folder removed
    and the daemon's clock stepped back at random moments (fixed seed), each followed by
    what a user would do and a rerun: nothing lost, mixed, burnt or falsely finished."""
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "crashloop.py"),
            "--kills",
            "3",
            "--seed",
            "2603",
            "--samples",
            "60",
            "--file-faults",
            "1.0",
            "--file-fault-kinds",
            "rewritten,rows_removed,clock_back",
            "--commit-window",
            "1",
            # Batches of about one sample and a rest after each: the run is still going
            # when the fault comes, whatever the machine's speed.
            "--daemon-arg=--batch-tokens",
            "--daemon-arg=256",
            "--fault",
            "worker_slow:100",
            "--model",
            str(tiny_model_dir),
            "--workdir",
            str(tmp_path),
            "--json",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = r.stdout
    summary = json.loads(out[out.index("{") :])
    assert summary["file_faults"] >= 3, summary
    assert summary["mixed"] == summary["false_finished"] == summary["fault_problems"] == 0, summary
    assert summary["lost"] == summary["duplicated"] == summary["burnt"] == 0, summary
    assert summary["unaccounted"] == summary["journal_problems"] == 0, summary
    assert summary["ok"] and r.returncode == 0, (summary["examples"], r.stderr[-2000:])
