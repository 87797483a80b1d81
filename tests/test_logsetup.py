"""Journald-friendly logging: no timestamps and syslog priorities when stderr is the journal."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest
from eagle3d.serve.logsetup import setup_logging, stream_is_journal, syslog_priority


@pytest.fixture(autouse=True)
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def journal_env(f) -> dict[str, str]:
    st = os.fstat(f.fileno())
    return {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}


def test_stream_is_journal_matches_device_and_inode(tmp_path):
    with open(tmp_path / "a", "w") as a, open(tmp_path / "b", "w") as b:
        assert stream_is_journal(a, journal_env(a))
        assert not stream_is_journal(a, journal_env(b))
        assert not stream_is_journal(a, {})
        assert not stream_is_journal(a, {"JOURNAL_STREAM": "garbage"})


def test_journal_mode_has_priorities_and_no_timestamp(tmp_path):
    with open(tmp_path / "log", "w") as f:
        assert setup_logging(logging.INFO, journal_env(f), f)
        logging.getLogger("eagle3d.runner").warning("disk %d%% full", 91)
        logging.getLogger("eagle3d.runner").info("saved 3/4")
        logging.getLogger("eagle3d.runner").debug("hidden")
    lines = (tmp_path / "log").read_text().splitlines()
    assert lines == ["<4>eagle3d.runner: disk 91% full", "<6>eagle3d.runner: saved 3/4"]


def test_terminal_mode_has_timestamps_and_calling_twice_does_not_duplicate(tmp_path):
    with open(tmp_path / "log", "w") as f:
        assert not setup_logging(logging.INFO, {}, f)
        assert not setup_logging(logging.INFO, {}, f)
        logging.getLogger("x").error("boom")
    lines = (tmp_path / "log").read_text().splitlines()
    assert len(lines) == 1
    assert re.match(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ERROR   x: boom$", lines[0])


def test_priorities():
    assert [syslog_priority(x) for x in (5, 10, 20, 30, 40, 50)] == [7, 7, 6, 4, 3, 2]


def test_child_process_detects_its_stderr(tmp_path):
    """As under systemd: JOURNAL_STREAM names the file the child's stderr really is."""
    path = tmp_path / "stderr"
    code = (
        "import logging; from eagle3d.serve.logsetup import setup_logging; "
        "setup_logging(); logging.getLogger('eagle3d').info('hello')"
    )
    with open(path, "w") as f:
        env = {**os.environ, **journal_env(f)}
        subprocess.run([sys.executable, "-c", code], stderr=f, env=env, check=True, timeout=60)
    assert path.read_text() == "<6>eagle3d: hello\n"
