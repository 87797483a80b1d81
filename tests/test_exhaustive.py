"""Every message and every effect is handled, or ``mypy --strict`` says which is not.

The shell's dispatchers (:meth:`eagle3d.run.pipeline.Pipeline.dispatch` over the inbox's
messages, :meth:`~eagle3d.run.pipeline.Pipeline.carry_out` over the ledger's effects,
:meth:`eagle3d.core.ledger.Ledger.handle` over the ledger's messages) are ``match``
statements that end in ``assert_never``. Here a scratch copy of the tree loses one ``case``
of each, and mypy (the configuration of CI stage 0) must fail naming each type left
unhandled; the same copy without the cuts passes. Runs in the normal suite (about 35 s of
CPU: two mypy runs over the tree, the second incremental).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: (file, the lines of one case to cut, the type mypy must then name).
CUTS = [
    (
        "daemon/eagle3d/run/pipeline.py",
        "            case fx.Cancel(rid=rid):\n                self.pieces.cancel(rid)\n",
        '"Cancel',
    ),
    (
        "daemon/eagle3d/run/pipeline.py",
        "            case fx.Resumed(reason=reason):\n"
        '                self.recorder.append(ev.RunState(state="running", reason=reason))\n'
        "                self.recorder.reserve.make()\n",
        '"Resumed"',
    ),
    (
        "daemon/eagle3d/run/pipeline.py",
        "            case Signalled(signum=signum):\n"
        "                self.handle(m.Stop(signal.Signals(signum).name), now)\n",
        '"Signalled"',
    ),
    (
        "daemon/eagle3d/core/ledger.py",
        "            case m.Lose(what=what):\n                return self.lose(what, now)\n",
        '"Lose"',
    ),
]


def _copy(dst: Path) -> None:
    for top in ("daemon", "shared", "tui"):
        shutil.copytree(
            ROOT / top, dst / top, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
        )
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")


def _mypy(tree: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache), "--no-error-summary"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.timeout(900)  # ~35 s of CPU; on a loaded machine its wall time is longer
def test_a_case_cut_from_a_dispatcher_fails_mypy_naming_its_type(tmp_path: Path) -> None:
    tree, cache = tmp_path / "tree", tmp_path / "cache"
    _copy(tree)
    whole = _mypy(tree, cache)
    assert whole.returncode == 0, whole.stdout[-3000:]  # the copy passes as it is
    for rel, lines, _ in CUTS:
        path = tree / rel
        src = path.read_text(encoding="utf-8")
        assert src.count(lines) == 1, f"{rel} no longer has the case {lines!r}"
        path.write_text(src.replace(lines, ""), encoding="utf-8")
    cut = _mypy(tree, cache)
    assert cut.returncode != 0
    errors = [line for line in cut.stdout.splitlines() if ": error:" in line]
    for rel, _, name in CUTS:
        assert any(line.startswith(rel) and name in line for line in errors), (
            f"mypy did not name {name} in {rel}: {errors}"
        )
