"""``eagle3d run``'s command (:mod:`eagle3d.run.command`): once the run is over and its exit
status decided, a stop that arrives while the interpreter winds down changes nothing."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import runkit
from eagle3proto import events as ev

# The daemon's own command, then the stop a supervisor (or a Ctrl-C to the process group)
# sends just as the finished run exits: the process must still exit with the run's status.
_SCRIPT = """
import os, signal, sys
from eagle3d.cli import main
code = main(sys.argv[2:])
os.kill(os.getpid(), int(sys.argv[1]))
sys.exit(code)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_after_the_run_ended_keeps_its_exit_status(
    tiny_model_dir: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    data = runkit.write_jsonl(tmp_path / "data.jsonl", runkit.conversations(3))
    out = tmp_path / "out"
    argv = runkit.run_args(tiny_model_dir, data, out)[3:]  # after "python -m eagle3d"
    r = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(int(sig)), *argv],
        capture_output=True,
        text=True,
        timeout=180,
        env=runkit.env_without_faults(),
        start_new_session=True,
    )
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    finished = [e for e in runkit.events(out) if isinstance(e, ev.RunFinished)]
    assert len(finished) == 1 and finished[0].exit_code == 0 and finished[0].saved == 3
