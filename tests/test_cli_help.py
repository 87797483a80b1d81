"""The command line (issue 27, point 9, in part): ``-o``/``--output`` on every subcommand that
takes an output, and every option of ``run`` with help text (its default where it has one)."""

from __future__ import annotations

import argparse
import subprocess
import sys

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
