"""Whose fault is a failure: the environment's, or the sample's own. Pure functions, no I/O.

The rule: only a sample's own data (its line, its template, its length, a dump of it that
fails validation) may make it fail for good. A stop, a signal, a dying worker or server, a
full or unwritable disk is the environment's: it pauses, waits or retries, and never counts
an attempt. Every failure path of the daemon asks here which it is:

* :func:`env_errno` - an errno that means "the place we write to is full, unwritable or
  failing" (ENOSPC, EDQUOT, EACCES, EPERM, EROFS, EIO): the run pauses on that area;
* :func:`producer_failure` - a producer's report of a failed request, judged;
* :func:`recorded_failure_is_environment` - a ``sample_failed`` record an older eagle3d
  wrote "for good" that was really the environment's: retried on resume;
* :func:`may_resume` and :func:`dump_room` - when a pause ends, and how many requests the
  dump area's free space allows in flight.

Time and free space are arguments, never read here.
"""

from __future__ import annotations

import errno
import os
import re
import signal
from dataclasses import dataclass

#: Errnos that pause the run: the area written to is full, unwritable or failing.
ENV_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO}
)
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})

#: Where the daemon writes, as named in pause reasons.
OUTPUT, JOURNAL, DUMPS = "output", "journal", "dump area"

#: Signals another process sends (a terminal's Ctrl-C, scancel, kill, a container stop, the
#: OOM killer): a worker dying of one did nothing wrong with its sample.
OUTSIDE_SIGNALS = frozenset(
    {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL, signal.SIGQUIT, signal.SIGPIPE}
)

# strerror texts, for failures known only by their message (a producer's report, or a
# record an older eagle3d wrote).
_STRERROR = {os.strerror(e): e for e in ENV_ERRNOS}
_NAME = re.compile(r"\b(" + "|".join(errno.errorcode[e] for e in ENV_ERRNOS) + r")\b")
_ERRNO = re.compile(r"\[Errno (\d+)\]")
_EXIT = re.compile(r"exited with code (-?\d+)")


def name(err: int) -> str:
    """``ENOSPC`` for 28; ``errno 1234`` for a number without a name."""
    return errno.errorcode.get(err, f"errno {err}")


def env_errno(err: int | None) -> bool:
    """True for an errno that pauses the run (see :data:`ENV_ERRNOS`)."""
    return err in ENV_ERRNOS


def errno_in(message: str) -> int | None:
    """The environment errno a failure message names (``ENOSPC``, ``[Errno 28]`` or
    ``No space left on device``), else None."""
    m = _NAME.search(message)
    if m is not None:
        return int(getattr(errno, m.group(1)))
    m = _ERRNO.search(message)
    if m is not None and int(m.group(1)) in ENV_ERRNOS:
        return int(m.group(1))
    for text, err in _STRERROR.items():
        if text in message:
            return err
    return None


def signal_in(message: str) -> int | None:
    """The signal a worker died of, from ``worker N exited with code -15``; else None."""
    m = _EXIT.search(message)
    if m is None or int(m.group(1)) >= 0:
        return None
    return -int(m.group(1))


@dataclass(frozen=True, slots=True)
class EnvFault:
    """The environment refused a write: ``area`` (output, journal, dump area) at ``path``."""

    area: str
    path: str
    errno: int
    detail: str = ""

    @property
    def disk_full(self) -> bool:
        return self.errno in DISK_FULL

    @property
    def reason(self) -> str:
        """What a paused state says, naming the errno: ``disk full (ENOSPC) writing to the
        output /data/hs: ...``."""
        if self.errno in DISK_FULL:
            what = "disk full"
        elif self.errno in (errno.EACCES, errno.EPERM):
            what = "permission denied"
        elif self.errno == errno.EROFS:
            what = "read-only filesystem"
        else:
            what = "I/O error"
        tail = f": {self.detail}" if self.detail else ""
        return f"{what} ({name(self.errno)}) writing to the {self.area} {self.path}{tail}"


@dataclass(frozen=True, slots=True)
class Verdict:
    """How the daemon treats one failed attempt."""

    counted: bool  # an attempt of the sample's own (retried up to --max-attempts)
    pause: EnvFault | None = None  # the run pauses on this area until a probe write succeeds
    why: str = ""  # for an uncounted failure: why it is the environment's


SAMPLE = Verdict(counted=True)

#: Said of a worker that exited after a MemoryError outside a forward (its exit status
#: ``hf_protocol.EXIT_OUT_OF_MEMORY``): the host's memory, never a sample's fault.
OUT_OF_MEMORY = "out of memory"

#: Said of a request whose worker died (exited, was killed or hung) while computing it in a
#: batch of its own: the one-sample run that proves the sample's own data is the cause, the
#: only worker death that counts an attempt. A death in a batch of several, or before the
#: request started, counts none: each sample of that batch is sent again alone.
ALONE = "computing this sample alone"


def producer_failure(
    error: str, message: str, *, stopping: bool, dump_dir: str, dump_area_full: bool
) -> Verdict:
    """Judge a producer's report that a request failed.

    ``stopping``: the run is draining (a worker that dies now was stopped with it);
    ``dump_area_full``: the dump area was seen full lately (a dump that never arrived was
    then most likely refused by the full area, which the server cannot tell us).
    """
    if stopping:
        return Verdict(False, why="the run is stopping")
    if error == "DumpWriteError":
        err = errno_in(message)
        if err is not None:
            return Verdict(
                False, EnvFault(DUMPS, dump_dir, err, message), "the dump area refused it"
            )
    if error == "DumpMissing" and dump_area_full:
        fault = EnvFault(
            DUMPS, dump_dir, errno.ENOSPC, f"a dump never arrived while full: {message}"
        )
        return Verdict(False, fault, "the dump area was full")
    if error == "ProducerCrashed":
        sig = signal_in(message)
        if sig in OUTSIDE_SIGNALS:
            return Verdict(False, why=f"the worker was killed by {signal.Signals(sig).name}")
        if OUT_OF_MEMORY in message:
            return Verdict(False, why="the worker ran out of memory")
        if ALONE not in message:
            return Verdict(False, why="the worker did not die computing this sample alone")
    if error == "ProducerDown":
        return Verdict(False, why="the producer is down")
    return SAMPLE


#: ``sample_failed`` errors that name a write the environment refused.
_WRITE_ERRORS = ("DumpWriteError", "CommitError", "JournalError")


def recorded_failure_is_environment(error: str, message: str) -> bool:
    """A ``sample_failed`` record with ``retry`` false that an older eagle3d wrote for a
    failure that was not the sample's own: retried on the next run.

    A worker killed by a signal (Ctrl-C, SIGTERM to the process group during a drain), no
    live worker, a write refused by a full or unwritable disk, or an output that vanished
    (``No such file or directory`` while committing).
    """
    if error == "ProducerCrashed":
        return signal_in(message) in OUTSIDE_SIGNALS
    if error == "ProducerDown":
        return True
    if error.startswith(_WRITE_ERRORS) or message.startswith(_WRITE_ERRORS):
        return errno_in(message) is not None or os.strerror(errno.ENOENT) in message
    return False


def may_resume(fault: EnvFault, probe_ok: bool, free: int, need: int) -> bool:
    """Whether a pause on ``fault`` may end: a probe write into its area succeeded and, for
    a full disk, ``free`` bytes there hold ``need`` (room for the largest waiting sample).
    A quota (EDQUOT) is invisible to statvfs: its probe alone decides, and a commit that
    hits the quota again pauses again."""
    if not probe_ok:
        return False
    if fault.errno == errno.ENOSPC:
        return free >= need
    return True


#: Share of the dump area's free space the requests in flight may plan to fill.
DUMP_AREA_SHARE = 0.8


def dump_room(free: int, planned: int, need: int, in_flight: int) -> bool:
    """May one more request, whose dump takes about ``need`` bytes, be sent while the
    requests in flight will still write ``planned`` bytes into a dump area with ``free``
    bytes left? One request is always allowed when none is in flight, so the run moves
    (and pauses, if even that one does not fit)."""
    if in_flight == 0:
        return True
    return planned + need <= DUMP_AREA_SHARE * free


def dump_area_full(free: int, largest_dump: int) -> bool:
    """The dump area cannot take another dump of the largest size seen (or 1 MiB)."""
    return free < max(largest_dump, 1 << 20)


__all__ = [
    "ALONE",
    "DISK_FULL",
    "DUMPS",
    "ENV_ERRNOS",
    "JOURNAL",
    "OUTPUT",
    "SAMPLE",
    "EnvFault",
    "Verdict",
    "dump_area_full",
    "dump_room",
    "env_errno",
    "errno_in",
    "may_resume",
    "name",
    "producer_failure",
    "recorded_failure_is_environment",
    "signal_in",
]
