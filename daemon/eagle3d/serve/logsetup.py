"""Logging set-up: plain timestamped lines on a terminal, journald-friendly lines under systemd.

Under systemd, stderr is a stream into journald, which stamps every line itself; a second
timestamp in the message only adds noise to ``journalctl``. systemd says so through
``$JOURNAL_STREAM`` (``<device>:<inode>`` of the stream it connected). When that matches our
stderr, lines carry no timestamp and start with a syslog priority prefix (``<3>``, sd-daemon(3))
that journald turns into the entry's priority, so ``journalctl -p warning`` works.

On a terminal, lines go through a Rich console (:func:`terminal_console`), so that the live
progress line (:mod:`eagle3d.serve.progress`) stays below them instead of being torn by them.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, TextIO

TERMINAL_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
JOURNAL_FORMAT = "%(name)s: %(message)s"

# logging level -> syslog priority (sd-daemon(3) prefixes).
_PRIORITY = (
    (logging.CRITICAL, 2),
    (logging.ERROR, 3),
    (logging.WARNING, 4),
    (logging.INFO, 6),
)


def syslog_priority(levelno: int) -> int:
    for level, prio in _PRIORITY:
        if levelno >= level:
            return prio
    return 7


class JournalFormatter(logging.Formatter):
    """``<prio>name: message`` without a timestamp (journald adds its own)."""

    def __init__(self) -> None:
        super().__init__(JOURNAL_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        return f"<{syslog_priority(record.levelno)}>{super().format(record)}"


class _ConsoleHandler(logging.Handler):
    """Writes formatted records through a Rich console (plain text: no markup, no colour)."""

    def __init__(self, console: Any) -> None:
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from rich.text import Text

            self.console.print(Text(self.format(record)), soft_wrap=True)
        except Exception:
            self.handleError(record)


_console: Any = None


def terminal_console() -> Any:
    """The Rich console the log writes to when stderr is a terminal, else None."""
    return _console


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def stream_is_journal(stream: TextIO, env: Mapping[str, str] | None = None) -> bool:
    """Whether ``stream`` is the journald stream systemd named in ``$JOURNAL_STREAM``."""
    env = os.environ if env is None else env
    value = env.get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return st.st_dev == dev and st.st_ino == ino


def setup_logging(
    level: int | str = logging.INFO,
    env: Mapping[str, str] | None = None,
    stream: TextIO | None = None,
) -> bool:
    """Configure the root logger to write to ``stream`` (stderr). True if in journald mode.

    Replaces handlers installed by an earlier call, so it is safe to call twice.
    """
    global _console
    stream = sys.stderr if stream is None else stream
    journal = stream_is_journal(stream, env)
    _console = None
    handler: logging.Handler
    if not journal and _isatty(stream):
        from rich.console import Console

        _console = Console(file=stream, highlight=False, markup=False)
        handler = _ConsoleHandler(_console)
    else:
        handler = logging.StreamHandler(stream)
    handler.setFormatter(JournalFormatter() if journal else logging.Formatter(TERMINAL_FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_eagle3d", False):
            root.removeHandler(h)
    handler._eagle3d = True  # type: ignore[union-attr]
    root.addHandler(handler)
    root.setLevel(level)
    return journal
