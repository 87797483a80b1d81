"""State checkpoints beside the journal (eagle3proto.checkpoint): a reader that starts from a
checkpoint and replays the tail ends with the same state as a full replay, on the golden
journals at every cut; a damaged or stale checkpoint is ignored with a message."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from eagle3d.tools import report
from eagle3proto import checkpoint, paths, reducer
from eagle3proto.codec import HEADER_SIZE, scan
from eagle3proto.journalread import Replay, iter_events, list_segments, replay
from eagle3top import once
from eagle3top.sources import Target, fold_journal, once_local, read_journal

GOLDEN = Path(__file__).parent / "data" / "golden"
NAMES = sorted(p.name.removesuffix(".expected.json") for p in GOLDEN.glob("*.expected.json"))
NOW = 200.0


def positions(jdir: Path) -> list[checkpoint.Position]:
    """Every record's position, in order, read from the segments' frames."""
    out = []
    events, _ = iter_events(str(jdir))
    k = 0
    for seg in list_segments(str(jdir)):
        data = Path(seg).read_bytes()
        at = HEADER_SIZE
        for p in scan(data, HEADER_SIZE).payloads:
            end = at + 8 + len(p)
            e = events[k]
            crc = int.from_bytes(data[at : at + 4], "little")
            out.append(
                checkpoint.Position(
                    run=e.run, seq=e.seq, segment=Path(seg).name, start=at, end=end, crc=crc
                )
            )
            at, k = end, k + 1
            if k == len(events):
                return out
    return out


def write_at(jdir: Path, k: int) -> checkpoint.Position:
    """A checkpoint of the first ``k + 1`` records, as the daemon writes one."""
    events, _ = iter_events(str(jdir))
    state = reducer.apply_all(reducer.new_state(), events[: k + 1])
    pos = positions(jdir)[k]
    ck = checkpoint.Checkpoint(version=checkpoint.VERSION, position=pos, ts=1.0, state=state)
    checkpoint.write(str(jdir), checkpoint.encode(ck))
    return pos


def full(jdir: Path) -> tuple[reducer.ShardState, Replay]:
    state = reducer.new_state()
    rep = replay(str(jdir), lambda b: reducer.apply_all(state, b))
    return state, rep


def once_text(jdir: Path) -> tuple[str, list[str]]:
    row = once_local(Target(label="s", jdir=str(jdir), socket=str(jdir / "no.sock")))
    doc, report = once.build([row], NOW)
    return once.render_text(doc, report, color=False), row.notes


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_plus_tail_equals_full_replay_at_every_cut(name: str, tmp_path: Path) -> None:
    jdir = tmp_path / name
    shutil.copytree(GOLDEN / name, jdir)
    want, want_rep = full(jdir)
    want_text, want_notes = once_text(jdir)
    n = len(positions(jdir))
    assert n > 0
    for k in range(n):
        write_at(jdir, k)
        assert checkpoint.load(str(jdir)).note == ""
        got, rep, refused = fold_journal(str(jdir))  # --once and report
        assert refused == ""
        assert reducer.encode_state(got) == reducer.encode_state(want), (name, k)
        assert rep.count == want_rep.count - (k + 1)
        assert [p.reason for p in rep.problems] == [p.reason for p in want_rep.problems]
        tui, _fol = read_journal(str(jdir))  # the TUI's catch-up
        assert reducer.encode_state(tui) == reducer.encode_state(want), (name, k)
        assert once_text(jdir) == (want_text, want_notes)


def damage(jdir: Path, how: str) -> None:
    path = Path(checkpoint.path_in(str(jdir)))
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x40
    elif how == "truncate":
        del data[len(data) // 2 :]
    elif how == "empty":
        data.clear()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("how", "words"),
    [("flip", "checksum mismatch"), ("truncate", "where the header says"), ("empty", "shorter")],
)
def test_damaged_checkpoint_is_ignored_with_a_message(how: str, words: str, tmp_path: Path) -> None:
    jdir = tmp_path / "j"
    shutil.copytree(GOLDEN / "resume", jdir)
    want, _ = full(jdir)
    want_text, _ = once_text(jdir)
    write_at(jdir, 3)
    damage(jdir, how)
    loaded = checkpoint.load(str(jdir))
    assert loaded.checkpoint is None
    assert words in loaded.note and "the whole journal is read" in loaded.note
    got, _rep, refused = fold_journal(str(jdir))
    assert refused == loaded.note
    assert reducer.encode_state(got) == reducer.encode_state(want)
    text, notes = once_text(jdir)
    assert any("checkpoint" in n and words in n for n in notes), notes
    assert text.split("\n")[0] == want_text.split("\n")[0]


def test_checkpoint_past_a_cut_journal_is_refused(tmp_path: Path) -> None:
    """A crash cut the journal back before the record a checkpoint names (a chatty record
    never synced): the checkpoint is refused, not trusted."""
    jdir = tmp_path / "j"
    shutil.copytree(GOLDEN / "pipeline", jdir)
    pos = write_at(jdir, len(positions(jdir)) - 1)
    seg = jdir / pos.segment
    with open(seg, "r+b") as f:
        f.truncate(pos.start)
    loaded = checkpoint.load(str(jdir))
    assert loaded.checkpoint is None
    assert "ends before record" in loaded.note


def test_checkpoint_naming_another_record_is_refused(tmp_path: Path) -> None:
    """Same seq and offsets, another record (a later session wrote over a cut tail)."""
    jdir = tmp_path / "j"
    shutil.copytree(GOLDEN / "pipeline", jdir)
    write_at(jdir, 2)
    path = Path(checkpoint.path_in(str(jdir)))
    ck = checkpoint._decoder.decode(path.read_bytes()[checkpoint._HEAD.size :])
    ck.position = checkpoint.Position(
        run=ck.position.run,
        seq=ck.position.seq,
        segment=ck.position.segment,
        start=ck.position.start,
        end=ck.position.end,
        crc=ck.position.crc ^ 1,
    )
    checkpoint.write(str(jdir), checkpoint.encode(ck))
    loaded = checkpoint.load(str(jdir))
    assert loaded.checkpoint is None
    assert "another record" in loaded.note


def test_missing_checkpoint_reads_the_whole_journal_without_a_note(tmp_path: Path) -> None:
    jdir = tmp_path / "j"
    shutil.copytree(GOLDEN / "resume", jdir)
    loaded = checkpoint.load(str(jdir))
    assert loaded.missing and "whole journal" in loaded.note
    _state, _rep, refused = fold_journal(str(jdir))
    assert refused == ""


def report_output(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """An output holding golden journal ``name`` as its one shard's journal."""
    out = tmp_path / "out"
    jdir = Path(paths.journal_dir(str(out), paths.Shard()))
    shutil.copytree(GOLDEN / name, jdir)
    return out, jdir


def summary(out: Path) -> dict[str, object]:
    stories = report.read(str(out), summary=True)
    return report.document(str(out), stories, summary=True)


@pytest.mark.parametrize("name", NAMES)
def test_report_summary_from_checkpoint_plus_tail_equals_a_full_replay(
    name: str, tmp_path: Path
) -> None:
    """``eagle3d report --summary`` reads the checkpoint and the tail: at every cut, the
    same document as with no checkpoint (the whole journal), and the same figures as the
    full report (which replays it all for the story)."""
    out, jdir = report_output(tmp_path, name)
    want = summary(out)  # no checkpoint yet: the whole journal
    whole = report.document(str(out), report.read(str(out)))
    for s, w in zip(want["shards"], whole["shards"], strict=True):  # type: ignore[call-overload]
        assert s == {k: w[k] for k in s if k != "problems"} | {"problems": s["problems"]}
    assert want["total"] == {k: whole["total"][k] for k in want["total"]}  # type: ignore[index]
    for k in range(len(positions(jdir))):
        write_at(jdir, k)
        assert summary(out) == want, (name, k)


def test_report_summary_falls_back_on_a_damaged_checkpoint_with_a_message(tmp_path: Path) -> None:
    out, jdir = report_output(tmp_path, "failures")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "eagle3d", "report", "--output", str(out), *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120)

    want = cli("--summary", "--json")
    assert want.returncode == 0, want.stderr
    write_at(jdir, 3)
    damage(jdir, "flip")
    got = cli("--summary", "--json")
    assert got.returncode == 0, got.stderr
    assert "checksum mismatch" in got.stderr and "the whole journal is read" in got.stderr
    assert json.loads(got.stdout) == json.loads(want.stdout)
    text = cli("--summary").stdout
    assert "a summary, from the checkpoint and the journal's tail" in text
