"""The space check's rows kept beside the journal (eagle3d.run.keptrows): a resume takes the
rows an earlier start read instead of tokenizing them again, with the same estimate; a kept
file of another dataset, tokenizer or settings, a damaged one, or one whose pool no longer
holds the rows still to do is ignored with a message, and the rows are read afresh."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from eagle3d import config
from eagle3d.core.sample import SAVED
from eagle3d.run import estimate, job, keptrows, spacecheck
from eagle3proto import paths
from eagle3proto.paths import Shard
from runkit import ENV, conversations, run, run_args, write_jsonl

KEY = keptrows.key(
    dataset_sha="d",
    tokenizer="t",
    max_length=0,
    on_overflow="truncate",
    fmt="jsonl",
    max_line=1 << 20,
    shard=Shard(),
)


def _job(model: Path, tmp: Path, rows: list[Any], **extra: Any) -> tuple[Any, Any, str]:
    data = write_jsonl(tmp / "data.jsonl", rows)
    out = str(tmp / "out")
    flags = {"model": str(model), "dataset": str(data), "output": out, "max_length": 0}
    cfg = config.build({}, {**flags, **extra})
    return cfg, job.describe(cfg, cfg.shard_spec(), out), out


def test_a_resume_takes_the_rows_a_first_start_read_with_the_same_estimate(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    rows: list[Any] = [*conversations(40, seed=3), "{not json", {"messages": []}]
    cfg, facts, out = _job(tiny_model_dir, tmp_path, rows)
    jdir = paths.journal_dir(out, cfg.shard_spec())
    os.makedirs(jdir)
    status = bytearray(facts.lines)
    first = estimate.check_run(cfg, facts, cfg.shard_spec(), out, status)
    assert not first.kept and first.keep is not None and not first.report.sampled
    first.keep.save(jdir)

    status[:15] = bytes([SAVED]) * 15  # the run settled its first 15 rows
    fresh = estimate.check_run(cfg, facts, cfg.shard_spec(), str(tmp_path / "elsewhere"), status)

    def never(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("rows were read although an earlier start kept them")

    caplog.set_level("INFO", logger="eagle3d")
    with monkeypatch.context() as m:
        m.setattr(estimate, "_read", never)
        again = estimate.check_run(cfg, facts, cfg.shard_spec(), out, status)
        assert spacecheck.check_space(cfg, facts, cfg.shard_spec(), out, status) is None
    assert again.kept and again.keep is None
    assert "tokenized at an earlier start (kept beside the journal)" in caplog.text
    mine, theirs = again.report.shards[0], fresh.report.shards[0]
    assert mine.estimate == theirs.estimate and not again.report.sampled
    assert (mine.invalid, mine.over, mine.first_invalid) == (
        theirs.invalid,
        theirs.over,
        theirs.first_invalid,
    )
    assert mine.invalid == 2 and len(mine.first_invalid) == 2
    assert again.report.tokenized == facts.lines - 15


def test_a_kept_file_of_other_settings_is_ignored_and_the_rows_read_again(
    tiny_model_dir: Path, tmp_path: Path, caplog: Any
) -> None:
    cfg, facts, out = _job(tiny_model_dir, tmp_path, conversations(12, seed=1))
    jdir = paths.journal_dir(out, cfg.shard_spec())
    os.makedirs(jdir)
    status = bytearray(facts.lines)
    first = estimate.check_run(cfg, facts, cfg.shard_spec(), out, status)
    assert first.keep is not None
    first.keep.save(jdir)
    caplog.set_level("INFO", logger="eagle3d")
    flags = {"model": cfg.model, "dataset": cfg.dataset, "output": out, "max_length": 16}
    other = config.build({}, flags)  # another cut: other tokens
    checked = estimate.check_run(other, facts, cfg.shard_spec(), out, status)
    assert not checked.kept and checked.keep is not None
    assert "the dataset, the tokenizer or the job's settings changed since" in caplog.text
    caplog.clear()
    with open(keptrows.path_in(jdir), "r+b") as f:  # a flipped byte in the payload
        f.seek(40)
        b = f.read(1)
        f.seek(40)
        f.write(bytes([b[0] ^ 0xFF]))
    checked = estimate.check_run(cfg, facts, cfg.shard_spec(), out, status)
    assert not checked.kept and "its checksum does not match (damaged)" in caplog.text


def _read(rows: list[int], pool: list[int], complete: bool) -> keptrows.Read:
    found = [keptrows.Found(10 + r % 7, keptrows.OK) for r in rows]
    return keptrows.Read(rows, found, np.asarray(pool), complete)


def test_the_sampled_rows_still_to_do_are_taken_while_enough_remain(tmp_path: Path) -> None:
    lines = 50_000
    pool = list(range(0, lines, 2))  # the odd rows were settled before the first start
    rows = sorted(random.Random(0).sample(pool, 4_000))
    keptrows.Keep(_read(rows, pool, complete=False), KEY, lines).save(str(tmp_path))
    rest = np.asarray(pool[len(pool) // 2 :])  # half the pool settled since, in order
    got = keptrows.take(str(tmp_path), KEY, rest, lines)
    assert got is not None
    ids, found, sampled = got
    assert sampled and ids == [r for r in rows if r >= rest[0]]
    assert [f.tokens for f in found] == [10 + r % 7 for r in ids]
    # Too few of the sampled rows left: read afresh.
    tail = rest[-3_000:]
    assert sum(r >= tail[0] for r in rows) < keptrows.MIN_ROWS
    assert keptrows.take(str(tmp_path), KEY, tail, lines) is None
    # A row to do that was settled at the first start (say, made pending again): not taken.
    assert keptrows.take(str(tmp_path), KEY, np.asarray([1, *rest]), lines) is None
    # Another dataset's or setting's key, or another row count: not taken.
    assert keptrows.take(str(tmp_path), KEY + "0", rest, lines) is None
    assert keptrows.take(str(tmp_path), KEY, rest, lines + 1) is None


def test_a_pool_read_whole_stays_exact_however_few_rows_remain(tmp_path: Path) -> None:
    pool = list(range(3, 900))
    keptrows.Keep(_read(pool, pool, complete=True), KEY, 1_000).save(str(tmp_path))
    got = keptrows.take(str(tmp_path), KEY, np.asarray(pool[-5:]), 1_000)
    assert got is not None and got[0] == pool[-5:] and not got[2]


def test_a_killed_run_resumes_without_tokenizing_its_rows_again(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """End to end: a first start keeps the rows its space check read once the start is
    accepted; the resume after a kill says its estimate stands on them."""
    data = write_jsonl(tmp_path / "d.jsonl", conversations(30, seed=5))
    out = tmp_path / "out"
    cmd = run_args(tiny_model_dir, data, out, "--max-length", "0")
    r = subprocess.run(
        cmd,
        env={**ENV, "EAGLE3D_FAULT": "kill:after_rename:11"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 137
    assert "(from every row: all 30 still to do, tokenized)" in r.stderr, r.stderr[-3000:]
    kept = Path(keptrows.path_in(paths.journal_dir(str(out), Shard())))
    assert kept.exists()
    r = run(tiny_model_dir, data, out, "--max-length", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "still to do, tokenized at an earlier start (kept beside the journal)" in r.stderr


def test_a_refused_start_keeps_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", conversations(10))
    out = tmp_path / "out"
    r = run(tiny_model_dir, data, out, "--max-length", "0", "--space-reserve", "100%")
    assert r.returncode == 10 and "the job does not fit" in r.stderr
    assert not out.exists() or not any(out.rglob(keptrows.NAME))


def test_a_kept_file_of_another_version_or_shape_is_named_so(tmp_path: Path) -> None:
    """The kept files' one way of opening (eagle3proto.sealed.open_struct): a sealed payload
    that is not the struct, or of another version, is refused in words."""
    import msgspec
    from eagle3proto import sealed

    read = _read([1, 2], [1, 2], complete=True)
    good = keptrows.decode(keptrows.encode(read, KEY, 10))
    later = msgspec.structs.replace(good, version=keptrows.VERSION + 1)
    other = sealed.seal(keptrows.MAGIC, keptrows._SEED, msgspec.msgpack.encode(later))
    with pytest.raises(ValueError, match=f"version {keptrows.VERSION + 1}, not 1"):
        keptrows.decode(other)
    garbled = sealed.seal(keptrows.MAGIC, keptrows._SEED, msgspec.msgpack.encode([1, 2]))
    with pytest.raises(ValueError, match="it does not decode"):
        keptrows.decode(garbled)
    (tmp_path / keptrows.NAME).write_bytes(other)
    assert keptrows.take(str(tmp_path), KEY, np.asarray([1]), 10) is None
