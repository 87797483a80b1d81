"""The command line (issue 27, point 9, in part): ``-o``/``--output`` on every subcommand that
takes an output, and every option of ``run`` with help text (its default where it has one)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from runkit import ENV


def _sub(name: str) -> argparse.ArgumentParser:
    from eagle3d.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_every_run_option_has_help() -> None:
    p = _sub("run")
    missing = [a.option_strings for a in p._actions if a.option_strings and not a.help]
    assert missing == [], missing
    for flag in ("--request-timeout", "--device", "--aux-layers", "--socket", "--on-overflow"):
        act = next(a for a in p._actions if flag in a.option_strings)
        assert "default" in (act.help or ""), (flag, act.help)


def test_o_is_output_on_every_subcommand_with_an_output() -> None:
    for name in ("run", "plan", "verify", "export", "report"):
        p = _sub(name)
        act = next(a for a in p._actions if "--output" in a.option_strings)
        assert "-o" in act.option_strings, name
    # A real `run -o` parses as --output (it then refuses the missing model, exit 3 or 2).
    r = subprocess.run(
        [sys.executable, "-m", "eagle3d", "run", "-o", "/nonexistent/out", "--model", "/nope"],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    assert "unrecognized arguments" not in r.stderr and r.returncode != 0, r.stderr


def _eagle3d(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "eagle3d", *args], capture_output=True, text=True, env=ENV
    )


def test_a_mistyped_option_names_the_subcommand_and_what_was_meant() -> None:
    r = _eagle3d("run", "--model", "m", "--dataset", "d", "--ouput", "/tmp/x")
    assert r.returncode == 2
    assert r.stderr.startswith("usage: eagle3d run "), r.stderr
    assert "unrecognized argument: --ouput (did you mean --output?)" in r.stderr, r.stderr
    assert "/tmp/x" not in r.stderr.splitlines()[-1], r.stderr  # its value is not a second error
    r = _eagle3d("verify", "-o", "/tmp/x", "--jsno")
    assert r.returncode == 2 and r.stderr.startswith("usage: eagle3d verify "), r.stderr
    assert "(did you mean --json?)" in r.stderr, r.stderr
    r = _eagle3d("export", "-o", "/tmp/x", "--to", "/tmp/y", "--format", "specforge", "--xyzzy")
    assert r.returncode == 2 and "unrecognized argument: --xyzzy" in r.stderr, r.stderr
    assert "did you mean" not in r.stderr, r.stderr


def _options_in_help(text: str) -> set[str]:
    """The long options an ``--help`` text lists (in its usage and its options section)."""
    return {w.strip("[],") for w in text.split() if w.strip("[],").startswith("--")}


def test_plan_help_lists_plans_options_only() -> None:
    from eagle3d import config

    r = _eagle3d("plan", "--help")
    assert r.returncode == 0, r.stderr
    listed = _options_in_help(r.stdout)
    run_only = {"--" + f.replace("_", "-") for f in config.RUN_ONLY}
    assert {"--workers", "--request-timeout", "--socket", "--device"} <= run_only
    assert listed & run_only == set(), sorted(listed & run_only)
    for own in (
        "--model",
        "--dataset",
        "--output",
        "--max-length",
        "--on-overflow",
        "--shard",
        "--store-dtype",
        "--space-reserve",
        "--max-failed-fraction",
        "--commit-threads",
        "--layers",
        "--recipe",
        "--config",
        "--sample",
        "--seed",
        "--json",
    ):
        assert own in listed, own
    p = _sub("plan")
    missing = [a.option_strings for a in p._actions if a.option_strings and not a.help]
    assert missing == [], missing
    # `run` still lists every one of them.
    assert run_only <= _options_in_help(_eagle3d("run", "--help").stdout)


def test_plan_refuses_a_run_only_option_with_its_own_usage() -> None:
    r = _eagle3d("plan", "--model", "m", "--dataset", "d", "--workers", "2")
    assert r.returncode == 2 and r.stderr.startswith("usage: eagle3d plan "), r.stderr
    assert "unrecognized argument: --workers" in r.stderr, r.stderr
    r = _eagle3d("plan", "--model", "m", "--dataset", "d", "--max-lenght", "9")
    assert r.returncode == 2 and r.stderr.startswith("usage: eagle3d plan "), r.stderr
    assert "(did you mean --max-length?)" in r.stderr, r.stderr


def test_plan_reads_a_job_file_holding_run_only_keys(tmp_path: Path) -> None:
    """A job file written for `run` (workers, socket, ...) plans as it is: plan ignores the
    run's own settings rather than refusing the file."""
    from eagle3d import config

    job = tmp_path / "job.toml"
    job.write_text('model = "m"\ndataset = "d"\noutput = "o"\nworkers = 3\nrequest_timeout = 5.0\n')
    p = argparse.ArgumentParser()
    config.add_job_arguments(p, run=False)
    args = p.parse_args(["--config", str(job), "--max-length", "64"])
    cfg = config.from_args(args)
    assert (cfg.workers, cfg.request_timeout, cfg.max_length) == (3, 5.0, 64)
