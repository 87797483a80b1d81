"""The exit codes of ``eagle3d run`` come from one table (:mod:`eagle3d.exitcodes`): the
constants, both ``--help`` texts, the systemd unit's ``RestartPreventExitStatus=`` and the
README's list are checked against it here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from eagle3d import exitcodes
from eagle3d.exitcodes import CODES, NO_RESTART

ROOT = Path(__file__).resolve().parent.parent


def test_the_table_is_the_constants() -> None:
    assert [c.code for c in CODES] == list(range(len(CODES)))  # one row per status, no gaps
    for c in CODES:
        assert getattr(exitcodes, f"EXIT_{c.name}") == c.code
    assert 0 not in NO_RESTART and 1 in [c.code for c in CODES if c.restart]
    assert set(NO_RESTART) == {2, 3, 4, 5, 6, 7, 9, 10}  # what only the operator can fix


def test_help_lists_every_code() -> None:
    for argv in (["--help"], ["run", "--help"]):
        out = subprocess.run(
            [sys.executable, "-m", "eagle3d", *argv], capture_output=True, text=True, check=True
        ).stdout
        assert "exit codes of `eagle3d run`:" in out
        for c in CODES:
            assert f"  {c.code}  {c.meaning}" in out, (argv, c)


def test_the_shipped_unit_restarts_only_where_it_can_help() -> None:
    unit = (ROOT / "systemd" / "eagle3d@.service").read_text()
    (line,) = [x for x in unit.splitlines() if x.startswith("RestartPreventExitStatus=")]
    assert tuple(int(x) for x in line.partition("=")[2].split()) == NO_RESTART


def test_the_readme_lists_exactly_the_codes_of_the_table() -> None:
    text = (ROOT / "README.md").read_text()
    section = text.split("### Exit codes", 1)[1]
    run = section.split("\n\n", 2)[1]  # the `eagle3d run` paragraph
    assert run.startswith("`eagle3d run`:")
    # "0 finished ... · 1 internal error · 2 ...": the codes, in order.
    listed = [int(m) for m in re.findall(r"(?:^`eagle3d run`: |· )(\d+) ", run.replace("\n", " "))]
    assert listed == [c.code for c in CODES]
