"""Bad input and a bad environment: clear messages naming the file, line or key, and the exit
codes documented in ``eagle3d run --help`` (:func:`eagle3d.exitcodes.help_text`).

Malformed lines fail one sample each (recorded with the line number) and the run goes on;
a bad model, output, config, a changed dataset or a second daemon end the run at once with
their own exit code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import runkit
from eagle3d.exitcodes import help_text

DEMO_LINES = runkit.DEMO.read_text(encoding="utf-8").splitlines()


def _codes() -> dict[int, str]:
    out = {}
    for line in help_text().splitlines()[1:]:
        code, _, text = line.strip().partition(" ")
        if code.isdigit():
            out[int(code)] = text.strip()
    return out


def test_exit_codes_are_documented() -> None:
    codes = _codes()
    assert set(codes) >= {0, 1, 2, 3, 4, 5, 6, 8}
    r = subprocess.run(
        [sys.executable, "-m", "eagle3d", "run", "--help"], capture_output=True, text=True
    )
    for code in (2, 3, 4, 5, 6):
        assert f"  {code}  {codes[code]}" in r.stdout


def test_malformed_lines_fail_with_their_line_numbers(tiny_model_dir: Path, tmp_path: Path) -> None:
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    lines = [
        *DEMO_LINES[:6],
        '{"conversations": [{"role": "user", "content": "unterminated',  # 7: bad JSON
        '{"conversations": []}',  # 8: empty conversation
        '{"conversations": [{"role": "wizard", "content": "Cast a spell."}]}',  # 9: unknown role
        '["not", "an", "object"]',  # 10: not a sample
        *DEMO_LINES[6:8],
    ]
    data.write_text("\n".join(lines) + "\n")
    r = runkit.run(tiny_model_dir, data, out, "--max-failed-fraction", "0.5")  # 4 of 12 bad
    assert r.returncode == 0, r.stderr[-2000:]
    failed = {f["idx"]: f for f in runkit.records(out, "sample_failed")}
    assert set(failed) == {6, 7, 8, 9}
    assert failed[6]["error"] == "bad_json" and "line 7" in str(failed[6]["message"])
    assert failed[7]["error"] == "no_turns" and "line 8" in str(failed[7]["message"])
    assert failed[8]["error"] == "unknown_role" and "'wizard'" in str(failed[8]["message"])
    assert "line 10" in str(failed[9]["message"])
    for f in failed.values():
        assert not f.get("retry")
        # ... and the foreground run says so too, naming the dataset file and the line.
        assert str(f["message"]) in r.stderr, (f["message"], r.stderr[-3000:])
    assert str(data) in r.stderr
    runkit.assert_complete(out, set(range(len(lines))) - set(failed), set(failed))


@pytest.mark.parametrize("overflow", ["truncate", "skip"])
def test_samples_over_max_length(overflow: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    valid, malformed = runkit.dataset(data, 8, malformed=False)
    limit = 40
    r = runkit.run(
        tiny_model_dir,
        data,
        out,
        "--max-length",
        str(limit),
        "--on-overflow",
        overflow,
        "--max-failed-fraction",
        "1",  # most demo samples are longer than the limit
    )
    assert r.returncode == 0, r.stderr[-2000:]
    saved = {s["idx"]: s for s in runkit.records(out, "sample_saved")}
    failed = {f["idx"]: f for f in runkit.records(out, "sample_failed")}
    if overflow == "truncate":
        # A cut that leaves no assistant token has nothing to train on: that, and only that,
        # may fail.
        assert all(f["error"] == "no_loss" for f in failed.values()), failed
        long = [s for s in saved.values() if s.get("truncated")]
        assert long, "some demo samples are longer than 40 tokens"
        for s in saved.values():
            assert s["tokens"] <= limit
        assert all(s["tokens"] == limit for s in long)
        valid, malformed = valid - set(failed), set(failed)
    else:
        assert failed, "some demo samples are longer than 40 tokens"
        for f in failed.values():
            assert f["error"] == "too_long" and str(limit) in str(f["message"]), f
        assert all(s["tokens"] <= limit and not s.get("truncated") for s in saved.values())
        valid, malformed = valid - set(failed), set(failed)
    runkit.assert_complete(out, valid, malformed)


def _run_quick(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "eagle3d", "run", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env or runkit.env_without_faults(),
    )


def test_missing_or_unreadable_model_exits_3(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    runkit.dataset(data, 3)
    missing = tmp_path / "no-such-model"
    r = _run_quick("--model", str(missing), "--dataset", str(data), "--output", str(tmp_path / "o"))
    assert r.returncode == 3 and str(missing) in r.stderr, r.stderr
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    r = _run_quick("--model", str(empty), "--dataset", str(data), "--output", str(tmp_path / "o"))
    assert r.returncode == 3 and "config.json" in r.stderr and str(empty) in r.stderr, r.stderr
    r = _run_quick(
        "--model",
        str(tiny_model_dir),
        "--dataset",
        str(tmp_path / "nope.jsonl"),
        "--output",
        str(tmp_path / "o"),
    )
    assert r.returncode == 3 and "nope.jsonl" in r.stderr, r.stderr


def test_unwritable_output_exits_4(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    runkit.dataset(data, 3)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    under_file = a_file / "out"  # a path under a regular file: ENOTDIR even for root
    r = _run_quick(
        "--model", str(tiny_model_dir), "--dataset", str(data), "--output", str(under_file)
    )
    assert r.returncode == 4 and str(under_file) in r.stderr and "not writable" in r.stderr, (
        r.stderr
    )
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        return  # a read-only mount needs root; the case above still ran
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)]).returncode:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        r = _run_quick("--model", str(tiny_model_dir), "--dataset", str(data), "--output", str(ro))
        assert r.returncode == 4 and str(ro) in r.stderr, r.stderr
        assert "Read-only file system" in r.stderr
    finally:
        subprocess.run(["umount", str(ro)])


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ('model = "m"\nbatch_size = 3\n', "batch_size"),  # unknown key
        ('max_length = "long"\n', "max_length"),  # wrong type
        ("concurrency = 2.5\n", "concurrency"),
        ("max_attempts = 0\n", "max_attempts"),  # out of range
        ('on_overflow = "drop"\n', "on_overflow"),
        ('model = "m"\nmax_length = = 3\n', "line 2"),  # not TOML: the parser's position
    ],
)
def test_bad_config_exits_2_naming_the_key(
    toml: str, needle: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data.jsonl"
    runkit.dataset(data, 3)
    job = tmp_path / "job.toml"
    job.write_text(toml)
    r = _run_quick(
        "--config",
        str(job),
        "--model",
        str(tiny_model_dir),
        "--dataset",
        str(data),
        "--output",
        str(tmp_path / "o"),
    )
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert needle in r.stderr, r.stderr
    assert not (tmp_path / "o").exists(), "a bad config must not touch the output"


def test_changed_dataset_refuses_to_resume_unless_forced(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    valid, malformed = runkit.dataset(data, 6)
    assert runkit.run(tiny_model_dir, data, out).returncode == 0
    with data.open("a") as f:
        f.write(DEMO_LINES[10] + "\n" + DEMO_LINES[11] + "\n")
    r = runkit.run(tiny_model_dir, data, out)
    assert r.returncode == 6, r.stderr[-2000:]
    assert "fingerprint" in r.stderr and "dataset" in r.stderr and "--force-resume" in r.stderr
    assert runkit.records(out, "run_started")[-1]["job"]["dataset_bytes"] != data.stat().st_size
    r = runkit.run(tiny_model_dir, data, out, "--force-resume")
    assert r.returncode == 0, r.stderr[-2000:]
    n = len(valid) + len(malformed)
    runkit.assert_complete(out, valid | {n, n + 1}, malformed)


def test_second_daemon_on_the_same_output_exits_5(tiny_model_dir: Path, tmp_path: Path) -> None:
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    valid, malformed = runkit.dataset(data, 25)
    # One sample per batch and a rest after each: the first daemon is still running when
    # the second one starts, however slow the machine is to start a second interpreter.
    first = runkit.start(
        tiny_model_dir,
        data,
        out,
        "--batch-tokens",
        "1",
        fault="worker_slow:1000",
        log=tmp_path / "first.log",
    )
    try:
        # (SIGTERM before the producer is up kills the daemon outright: see docs/reliability.md)
        runkit.wait_for(
            lambda: b" up; window " in (tmp_path / "first.log").read_bytes(), 90, "the first daemon"
        )
        r = runkit.run(tiny_model_dir, data, out, "--socket", str(tmp_path / "second.sock"))
        assert r.returncode == 5, r.stderr[-2000:]
        assert f"pid {first.pid}" in r.stderr and "lock" in r.stderr, r.stderr
        first.send_signal(signal.SIGTERM)  # a clean stop: resumable, exit 0
        assert first.wait(timeout=90) == 0, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert runkit.records(out, "run_stopped") or runkit.check(out).finished
    assert runkit.run(tiny_model_dir, data, out).returncode == 0
    runkit.assert_complete(out, valid, malformed)
