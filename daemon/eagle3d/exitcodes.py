"""The exit codes of ``eagle3d run``: one table, from which the constants, ``--help`` and the
systemd unit's ``RestartPreventExitStatus=`` come; the README's table is tested against it.

An exit status is computed by its owner from what happened (a :class:`Fatal` raised by a
check, :func:`eagle3d.core.resume.finish_code` for a finished run), never made up on the spot.
"""

from __future__ import annotations

from typing import NamedTuple


class ExitCode(NamedTuple):
    code: int
    name: str
    meaning: str
    restart: bool  # whether systemd should start the service again after it


CODES = (
    ExitCode(0, "OK", "finished, or stopped cleanly (rerun the same command to resume)", False),
    ExitCode(1, "INTERNAL", "internal error", True),
    ExitCode(2, "CONFIG", "bad usage or configuration (unknown key, wrong type)", False),
    ExitCode(
        3,
        "INPUT",
        "model or dataset missing, unreadable, or not a dataset format eagle3d reads",
        False,
    ),
    ExitCode(
        4, "OUTPUT", "output not writable, or removed, moved or replaced during the run", False
    ),
    ExitCode(5, "LOCKED", "another daemon holds this shard of the output", False),
    ExitCode(
        6,
        "FINGERPRINT",
        "job fingerprint changed under a resumed job (--force-resume overrides), or the"
        " dataset changed during the run",
        False,
    ),
    ExitCode(
        7,
        "LAYOUT",
        "a daemon of another shard count runs on the output, or died with samples in flight"
        " (N may change only between runs)",
        False,
    ),
    ExitCode(
        8,
        "PRODUCER",
        "producer could not start, or its dumps break the job's capture contract (layers,"
        " hidden size)",
        True,
    ),
    ExitCode(
        9,
        "FAILED",
        "finished, but every sample failed or more than --max-failed-fraction did",
        False,
    ),
    ExitCode(
        10,
        "SPACE",
        "the job does not fit on the output filesystem with --space-reserve"
        " (eagle3d plan says how much it needs; --no-space-check starts anyway)",
        False,
    ),
)

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_CONFIG = 2
EXIT_INPUT = 3
EXIT_OUTPUT = 4
EXIT_LOCKED = 5
EXIT_FINGERPRINT = 6
EXIT_LAYOUT = 7
EXIT_PRODUCER = 8
EXIT_FAILED = 9
EXIT_SPACE = 10

#: Exit statuses after which restarting the service cannot help (systemd's
#: ``RestartPreventExitStatus=``): the operator must change something first.
NO_RESTART = tuple(c.code for c in CODES if c.code != EXIT_OK and not c.restart)


def help_text() -> str:
    """The ``exit codes of `eagle3d run`:`` block of ``--help``."""
    lines = ["exit codes of `eagle3d run`:"]
    lines += [f"  {c.code}  {c.meaning}" for c in CODES]
    return "\n".join(lines) + "\n"


class Fatal(Exception):
    """A condition that ends the run with a specific exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


__all__ = [
    "CODES",
    "EXIT_CONFIG",
    "EXIT_FAILED",
    "EXIT_FINGERPRINT",
    "EXIT_INPUT",
    "EXIT_INTERNAL",
    "EXIT_LAYOUT",
    "EXIT_LOCKED",
    "EXIT_OK",
    "EXIT_OUTPUT",
    "EXIT_PRODUCER",
    "EXIT_SPACE",
    "NO_RESTART",
    "ExitCode",
    "Fatal",
    "help_text",
]
