"""The pure judgements of :mod:`eagle3d.core.envfault` (whose fault a failure is, when a pause
ends, how much the dump area holds), and :func:`eagle3d.core.resume.finish_code`."""

from __future__ import annotations

import errno
import os

import pytest
from eagle3d.core import envfault, resume
from eagle3d.core.envfault import DUMPS, OUTPUT, EnvFault
from eagle3d.exitcodes import EXIT_FAILED, EXIT_OK


@pytest.mark.parametrize(
    ("message", "want"),
    [
        ("writing the dump failed: ENOSPC: No space left on device", errno.ENOSPC),
        ("CommitError: commit of sample 3 failed: Permission denied", errno.EACCES),
        ("[Errno 30] Read-only file system: '/x'", errno.EROFS),
        ("journal fdatasync failed: [Errno 5] Input/output error", errno.EIO),
        ("Disk quota exceeded", errno.EDQUOT),
        ("EPERM", errno.EPERM),
        ("input_ids differ from what was sent", None),
        ("[Errno 22] Invalid argument", None),  # not the environment's
        ("ENOSPCX is no errno name", None),
    ],
)
def test_errno_in_a_message(message: str, want: int | None) -> None:
    assert envfault.errno_in(message) == want


def test_env_errnos() -> None:
    for e in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO):
        assert envfault.env_errno(e)
    for e in (None, 0, errno.EINVAL, errno.ENOENT, errno.EBADF):
        assert not envfault.env_errno(e)


def test_a_pause_reason_names_the_errno_and_the_place() -> None:
    r = EnvFault(OUTPUT, "/data/hs/rows_0-2000", errno.EACCES, "commit of sample 4").reason
    assert r.startswith("permission denied (EACCES) writing to the output /data/hs/rows_0-2000")
    assert (
        "disk full (ENOSPC) writing to the dump area /dev/shm/x"
        in EnvFault(DUMPS, "/dev/shm/x", errno.ENOSPC).reason
    )
    assert "(EROFS)" in EnvFault(OUTPUT, "/o", errno.EROFS).reason
    assert "I/O error (EIO)" in EnvFault(OUTPUT, "/o", errno.EIO).reason


def _judge(error: str, message: str, *, stopping: bool = False, full: bool = False):  # type: ignore[no-untyped-def]
    return envfault.producer_failure(
        error, message, stopping=stopping, dump_dir="/dumps", dump_area_full=full
    )


def test_producer_failures_judged() -> None:
    # The sample's own: counted attempts.
    assert _judge("BadDump", "NaN").counted
    assert _judge("Timeout", "no dump within 600 s").counted
    # A worker that died computing this sample alone (its traceback, SIGSEGV, a hang).
    assert _judge(
        "ProducerCrashed", "worker 9 exited with code 1, computing this sample alone"
    ).counted
    assert _judge(
        "ProducerCrashed", "worker 9 exited with code -11, computing this sample alone"
    ).counted
    assert _judge(
        "ProducerCrashed", "worker 9 made no progress for 600 s, computing this sample alone"
    ).counted
    assert _judge("DumpMissing", "wrote it 20 s ago", full=False).counted
    # The environment's: never counted.
    for code in (-2, -15, -1, -9):
        v = _judge("ProducerCrashed", f"worker 9 exited with code {code}")
        assert not v.counted and v.pause is None and "killed by SIG" in v.why
    assert not _judge("ProducerDown", "no live worker").counted
    # A worker that died with others in its batch, or before the request started: each
    # sample of the batch is sent again alone, nothing charged.
    for said in ("computing a batch of 3: each is sent again alone", "before this request started"):
        for code in (1, -11):
            v = _judge("ProducerCrashed", f"worker 9 exited with code {code}, {said}")
            assert (
                not v.counted and v.pause is None and "not die computing this sample alone" in v.why
            )
    v = _judge("DumpWriteError", "writing the dump failed: ENOSPC: No space left on device")
    assert not v.counted and v.pause == EnvFault(DUMPS, "/dumps", errno.ENOSPC, v.pause.detail)
    v = _judge("DumpWriteError", "writing the dump failed: EACCES: Permission denied")
    assert v.pause is not None and v.pause.errno == errno.EACCES
    v = _judge("DumpMissing", "wrote it 20 s ago", full=True)
    assert not v.counted and v.pause is not None and v.pause.area == DUMPS
    # Anything at all during a stop: pending for the next run.
    assert not _judge("BadDump", "NaN", stopping=True).counted


@pytest.mark.parametrize(
    ("error", "message", "env"),
    [
        ("ProducerCrashed", "worker 123 exited with code -15", True),  # a group SIGTERM
        ("ProducerCrashed", "worker 123 exited with code -2", True),  # Ctrl-C
        ("ProducerCrashed", "worker 123 exited with code 1", False),
        ("ProducerDown", "no live worker", True),
        ("DumpWriteError", "writing the dump failed: ENOSPC: No space left on device", True),
        ("CommitError", "CommitError: commit of sample 3 failed: Permission denied", True),
        ("CommitError", "commit of sample 3 failed: No such file or directory", True),
        ("CommitError", "JournalError: journal write failed: [Errno 28] No space left", True),
        ("BadDump", "input_ids differ", False),
        ("bad_json", "line 7 (sample 6): bad JSON", False),
        ("Timeout", "no dump within 600 s", False),
    ],
)
def test_records_of_older_versions(error: str, message: str, env: bool) -> None:
    assert envfault.recorded_failure_is_environment(error, message) is env


def test_may_resume() -> None:
    full = EnvFault(OUTPUT, "/o", errno.ENOSPC)
    denied = EnvFault(OUTPUT, "/o", errno.EACCES)
    quota = EnvFault(OUTPUT, "/o", errno.EDQUOT)
    assert not envfault.may_resume(full, True, 100, 1000)  # room for 4 KiB, not the sample
    assert envfault.may_resume(full, True, 1000, 1000)
    assert not envfault.may_resume(full, False, 10**9, 1000)
    assert envfault.may_resume(denied, True, 0, 1000)  # statvfs says nothing of permissions
    assert not envfault.may_resume(denied, False, 10**9, 1000)
    assert envfault.may_resume(quota, True, 0, 1000)  # a quota is invisible to statvfs


def test_dump_room() -> None:
    assert envfault.dump_room(free=0, planned=0, need=10**9, in_flight=0)  # one always goes
    assert envfault.dump_room(free=1000, planned=500, need=300, in_flight=3)
    assert not envfault.dump_room(free=1000, planned=500, need=301, in_flight=3)
    assert not envfault.dump_area_full(2 << 20, 1 << 20)
    assert envfault.dump_area_full(512 << 10, 0)  # under 1 MiB
    assert envfault.dump_area_full(5 << 20, 6 << 20)


def test_finish_code_and_counts() -> None:
    assert resume.finish_code(0, 218, 218, 0.05) == EXIT_FAILED  # every sample failed
    assert resume.finish_code(0, 0, 0, 0.05) == EXIT_OK  # nothing to do
    assert resume.finish_code(297, 3, 300, 0.05) == EXIT_OK  # the demo: 1 %
    assert resume.finish_code(20, 3, 23, 0.05) == EXIT_FAILED  # 13 %
    assert resume.finish_code(20, 3, 23, 0.2) == EXIT_OK
    assert resume.finish_code(1, 1, 2, 1.0) == EXIT_OK
    assert resume.finish_code(0, 2, 2, 1.0) == EXIT_FAILED  # all failed, whatever the fraction
    assert resume.describe_counts(0, 218, 218) == "saved 0 / 218 (0 %), 218 failed"
    assert resume.describe_counts(297, 3, 300) == "saved 297 / 300 (99 %), 3 failed"
    assert resume.describe_counts(1, 0, 300) == "saved 1 / 300 (0.3 %), 0 failed"


def test_signal_names_are_parsed() -> None:
    assert envfault.signal_in("worker 5 exited with code -15") == 15
    assert envfault.signal_in("worker 5 exited with code 3") is None
    assert envfault.signal_in("made no progress") is None
    assert envfault.name(errno.ENOSPC) == "ENOSPC" and envfault.name(9999) == "errno 9999"
    assert os.strerror(errno.ENOSPC) in EnvFault(OUTPUT, "/o", errno.ENOSPC, os.strerror(28)).reason
