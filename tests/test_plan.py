"""``eagle3d plan`` and ``eagle3d run``'s space check (eagle3d.tools.plan,
eagle3d.store.sizing, eagle3d.run.spacecheck): the estimate against what real runs wrote, for bfloat16 and fp8; a resumed job counts what
remains; a sampled plan's bound; a run refused on a small tmpfs (exit 10)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from eagle3d import config
from eagle3d.remote import storedtype
from eagle3d.store import sizing
from eagle3d.tools import plan
from eagle3d.tools.verify import verify
from eagle3proto import events as ev
from runkit import ENV, conversations, events, run, run_args, write_jsonl


def eagle3d_plan(model: Path, data: Path, out: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    cmd = [sys.executable, "-m", "eagle3d", "plan", "--model", str(model), "--dataset"]
    r = subprocess.run(
        [*cmd, str(data), "--output", str(out), "--json", *extra],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.stdout.startswith("{"), r.stderr[-3000:]
    return r.returncode, json.loads(r.stdout)


def du(path: Path) -> int:
    """Bytes the files under ``path`` take (their sizes, as ``du -sb`` counts them)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_plan_equals_the_bytes_a_real_run_wrote(
    stored_outputs: Any, tiny_model_dir: Path, tmp_path: Path, dtype: str
) -> None:
    """Planned on a fresh output with the run's arguments: the sample files exactly (their
    sizes follow from the token counts), everything under the output within 5 %."""
    data, done = stored_outputs["dataset"], stored_outputs[dtype]
    rc, p = eagle3d_plan(tiny_model_dir, data, tmp_path / "fresh", "--store-dtype", dtype)
    assert rc == 0 and p["fits"] is True and p["sampled"] is False, p
    saved = [e for e in events(done) if isinstance(e, ev.SampleSaved)]
    (shard,) = p["shards"]
    assert shard["samples"] == p["samples"] == len(saved) == 40
    assert shard["tokens"] == p["tokens"] == sum(e.tokens for e in saved)
    assert shard["files_bytes"] == sum(e.bytes for e in saved)
    written = du(done)
    assert abs(p["bytes"] - written) <= 0.05 * written, (p["bytes"], written)
    # The same job planned on its finished output: nothing remains, the journal's bytes shown.
    rc, again = eagle3d_plan(tiny_model_dir, data, done, "--store-dtype", dtype)
    assert rc == 0 and again["bytes"] == 0 and again["samples"] == 0, again
    assert again["shards"][0]["saved_samples"] == 40
    assert again["shards"][0]["saved_bytes"] == shard["files_bytes"]


def test_fp8_files_take_about_half_the_bytes_of_bf16(stored_outputs: Any) -> None:
    b = sum(e.bytes for e in events(stored_outputs["bfloat16"]) if isinstance(e, ev.SampleSaved))
    f = sum(e.bytes for e in events(stored_outputs["fp8"]) if isinstance(e, ev.SampleSaved))
    # Hidden size 64: ids and mask (16 B per token) and the 4 KiB blocks weigh more here
    # than at a real model's size (docs/benchmarks.md measures H=4096).
    assert f < 0.75 * b, (f, b)
    fp8, bf16 = storedtype.get("fp8"), storedtype.get("bfloat16")
    assert sizing.file_bytes(4096, 4096, 3, fp8) / sizing.file_bytes(4096, 4096, 3, bf16) < 0.51


def test_a_resumed_job_counts_only_what_remains(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", conversations(30, seed=5))
    out = tmp_path / "out"
    r = subprocess.run(
        run_args(tiny_model_dir, data, out),
        env={**ENV, "EAGLE3D_FAULT": "kill:after_rename:11"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 137
    saved = {e.idx: e for e in events(out) if isinstance(e, ev.SampleSaved)}
    _, whole = eagle3d_plan(tiny_model_dir, data, tmp_path / "fresh")
    rc, rest = eagle3d_plan(tiny_model_dir, data, out)
    assert rc == 0
    s = rest["shards"][0]
    assert s["saved_samples"] == len(saved) and s["saved_bytes"] == sum(
        e.bytes for e in saved.values()
    )
    assert rest["samples"] == 30 - len(saved)
    assert s["files_bytes"] == whole["shards"][0]["files_bytes"] - s["saved_bytes"]
    assert run(tiny_model_dir, data, out).returncode == 0  # and the run finishes the rest
    done = [e for e in events(out) if isinstance(e, ev.SampleSaved)]
    assert sum(e.bytes for e in done) == whole["shards"][0]["files_bytes"]


def test_a_sampled_plan_states_a_bound_that_holds(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Of 40 seeds, the 95 % bound of a 12-row sample of 60 rows holds the exact total in at
    least 34 (a 95 % bound misses 1 in 20)."""
    data = write_jsonl(tmp_path / "d.jsonl", [*conversations(60, seed=9), "[1, 2]"])
    cfg = config.build(
        {}, {"model": str(tiny_model_dir), "dataset": str(data), "output": str(tmp_path / "o")}
    )
    exact = plan.make_plan(cfg, sample=0)
    truth = exact.shards[0].estimate.bytes
    assert not exact.sampled and exact.bound == 0 and exact.tokenized == 61
    held = 0
    for seed in range(40):
        p = plan.make_plan(cfg, sample=12, seed=seed)
        assert p.sampled and p.tokenized == 12 and p.bound > 0
        est = p.shards[0].estimate
        held += abs(est.bytes - truth) <= est.bound
    assert held >= 34, held


def test_per_shard_figures_add_up_and_the_verdict_is_the_shards(
    stored_outputs: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = stored_outputs["dataset"]
    _, whole = eagle3d_plan(tiny_model_dir, data, tmp_path / "o")
    rc, three = eagle3d_plan(tiny_model_dir, data, tmp_path / "o", "--shard", "1/3")
    assert rc == 0 and three["scope"] == "shard-1-of-3"
    assert [s["shard"] for s in three["shards"]] == [f"shard-{i}-of-3" for i in range(3)]
    assert sum(s["files_bytes"] for s in three["shards"]) == whole["shards"][0]["files_bytes"]
    assert sum(s["tokens"] for s in three["shards"]) == whole["tokens"]
    assert three["bytes"] == three["shards"][1]["bytes"] + sizing.JOURNAL_FIXED


def test_a_reserve_that_cannot_be_met_refuses_plan_and_run_unless_no_space_check(
    stored_outputs: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = stored_outputs["dataset"]
    rc, p = eagle3d_plan(tiny_model_dir, data, tmp_path / "o", "--space-reserve", "100%")
    assert rc == 10 and p["fits"] is False and p["exit_code"] == 10
    r = run(tiny_model_dir, data, tmp_path / "o", "--space-reserve", "100%")
    assert r.returncode == 10, r.stderr[-2000:]
    assert "the job does not fit" in r.stderr and "--no-space-check" in r.stderr
    assert not list((tmp_path / "o").glob("rows_*"))
    r = run(tiny_model_dir, data, tmp_path / "o", "--space-reserve", "100%", "--no-space-check")
    assert r.returncode == 0, r.stderr[-2000:]
    assert verify(str(tmp_path / "o")).ok


@contextlib.contextmanager
def tmpfs(path: Path, nbytes: int) -> Iterator[Path]:
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounts a tmpfs: root")
def test_a_run_is_refused_for_lack_of_space_on_a_small_tmpfs(
    stored_outputs: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A tmpfs with room for the fp8 extraction and not for the bfloat16 one: the bfloat16
    run exits 10 before a sample is written, the fp8 run of the same job completes."""
    data = stored_outputs["dataset"]
    reserve = 1 << 20
    _, f8 = eagle3d_plan(tiny_model_dir, data, tmp_path / "x", "--store-dtype", "fp8")
    _, bf = eagle3d_plan(tiny_model_dir, data, tmp_path / "x", "--store-dtype", "bfloat16")
    assert f8["bytes"] < bf["bytes"]
    size = reserve + (f8["bytes"] + bf["bytes"]) // 2 + (64 << 10)
    with tmpfs(tmp_path / "small", size) as small:
        args = ("--space-reserve", str(reserve))
        rc, p = eagle3d_plan(tiny_model_dir, data, small / "out", *args)
        assert rc == 10 and p["fits"] is False, p
        r = run(tiny_model_dir, data, small / "out", *args)
        assert r.returncode == 10, r.stderr[-2000:]
        assert "the job does not fit" in r.stderr
        assert not list((small / "out").glob("rows_*"))  # nothing written
        r = run(tiny_model_dir, data, small / "out8", "--store-dtype", "fp8", *args)
        assert r.returncode == 0, r.stderr[-2000:]
        report = verify(str(small / "out8"))
        assert report.ok and report.checked == 40


def test_sizes_and_the_estimate_arithmetic() -> None:
    assert sizing.parse_size("256M") == 256 << 20
    assert sizing.parse_size("1.5G") == int(1.5 * (1 << 30))
    assert sizing.parse_size("4096") == 4096
    assert sizing.parse_size("2%", 1000) == 20
    with pytest.raises(ValueError, match="'lots' is not a size"):
        sizing.parse_size("lots")
    t = sizing.Tally()
    for b in (100, 200, 300, 0):
        t.add(b // 10, b)
    assert (t.rows, t.samples, t.refused) == (4, 3, 1)
    full = sizing.scale(t, 4)
    assert full.bytes == 600 and full.bound == 0 and full.samples == 3
    half = sizing.scale(t, 8)
    sd = math.sqrt(sum((b - 150) ** 2 for b in (100, 200, 300, 0)) / 3)
    assert half.bytes == 1200
    assert half.bound == math.ceil(1.96 * 8 * sd / 2 * math.sqrt(0.5))
    with pytest.raises(config.ConfigError, match="space_reserve"):
        config.build({}, {"model": "m", "dataset": "d", "output": "o", "space_reserve": "x%"})


def test_the_run_tokenizes_nothing_when_every_row_at_max_length_fits(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """The space check's ceiling (eagle3d.run.spacecheck): with room for every pending row
    at ``max_length`` tokens the estimate is never made (no tokenizer pass before the first
    request); with room for the estimate and not the ceiling, the estimate decides."""
    from eagle3d.run import job, spacecheck

    data = write_jsonl(tmp_path / "data.jsonl", conversations(20))
    out = str(tmp_path / "out")

    def check(max_length: int, reserve: str) -> None:
        flags = {"model": str(tiny_model_dir), "dataset": str(data), "output": out}
        cfg = config.build({}, {**flags, "max_length": max_length, "space_reserve": reserve})
        facts = job.describe(cfg, cfg.shard_spec(), out)
        spacecheck.check_space(cfg, facts, cfg.shard_spec(), out, bytearray(facts.lines))

    def never(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("the rows were tokenized although their ceiling fits")

    caplog.set_level("INFO", logger="eagle3d")
    with monkeypatch.context() as m:
        m.setattr(plan, "estimate", never)
        check(2048, "0")
    assert "space: at most" in caplog.text and "(20 rows of at most 2048 tokens)" in caplog.text
    caplog.clear()
    # A ceiling of gigabytes against room for 500 MB more than the reserve: the estimate
    # (a few hundred kilobytes) runs, and fits.
    free = sizing.free_space(out).free
    check(1_000_000, str(free - (500 << 20)))
    assert (
        "space: at most" not in caplog.text
        and "(from every row: all 20 still to do, tokenized)" in caplog.text
    )
