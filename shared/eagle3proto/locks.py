"""Who holds a shard lock, and whether that process is the daemon a journal names.

A lock alone proves nothing: any process that can open the file can ``flock`` it. The
holder is read from ``/proc/locks`` (its pid), and a process is recognised by its pid *and*
its start time (``/proc/<pid>/stat``, clock ticks since boot) on the same boot
(``/proc/sys/kernel/random/boot_id``): a pid reused by another process, or a lock taken by
another program after the daemon died, is not the daemon.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import time

PROC_LOCKS = "/proc/locks"
BOOT_ID = "/proc/sys/kernel/random/boot_id"
#: How old a read begun by :func:`read_early` may be when :func:`holders` takes it.
EARLY_MAX_AGE_S = 0.5

_early_done = _thread.allocate_lock()
_early: list[tuple[float, str | None]] = []  # (when the read ended, its text), at most one


def read_early() -> None:
    """Begin reading ``/proc/locks`` on a background thread, for the next :func:`holders`.

    Linux makes every read of ``/proc/locks`` wait for an RCU grace period (the file lock
    lists' ``percpu_down_write``): 8-20 ms of sleep, no CPU, on every monitor start that
    asks whether a daemon holds its lock. Begun before the monitor's imports, that wait
    passes while they run. The text is taken only if read within :data:`EARLY_MAX_AGE_S`
    (a liveness sample a few milliseconds older than the call), and only once.
    """
    if not _early_done.acquire(blocking=False):
        return  # a read is under way

    def read() -> None:
        try:
            _early[:] = [(time.monotonic(), _read(PROC_LOCKS))]
        finally:
            _early_done.release()

    _thread.start_new_thread(read, ())


def _read(proc_locks: str) -> str | None:
    try:
        with open(proc_locks) as f:
            return f.read()
    except OSError:
        return None


def _locks_text(proc_locks: str) -> str | None:
    """``/proc/locks``' text: the early read's, when one is fresh enough, else read now."""
    if proc_locks == PROC_LOCKS and (_early_done.locked() or _early):
        with _early_done:  # waits for a read under way
            early = _early.pop() if _early else None
        if early is not None and time.monotonic() - early[0] <= EARLY_MAX_AGE_S:
            return early[1]
    return _read(proc_locks)


def holders(path: str, proc_locks: str = PROC_LOCKS) -> list[int] | None:
    """The pids holding an ``flock`` on ``path`` ([] when none); None when ``/proc/locks``
    cannot be read."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return []
    text = _locks_text(proc_locks)
    if text is None:
        return None
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    ino = f":{st.st_ino}"
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 6 or parts[1] == "->" or parts[1] != "FLOCK":
            continue
        where = parts[5]
        # Overlay filesystems report the lower device; the inode still identifies the file.
        if where == want or where.endswith(ino):
            with contextlib.suppress(ValueError):
                out.append(int(parts[4]))
    return out


def start_time(pid: int) -> int:
    """Process ``pid``'s start time in clock ticks since boot (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    # The command name (field 2) may hold spaces and parentheses: count after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return 0


def boot_id() -> str:
    """This boot's id ('' where it cannot be read)."""
    try:
        with open(BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


def boottime() -> float:
    """Seconds since boot on ``CLOCK_BOOTTIME``: one clock for every process of this boot,
    counting suspended time, never stepped by ``settimeofday`` (a journal record's ``bt``)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def is_eagle3d(pid: int) -> bool:
    """True when ``pid`` runs eagle3d (``python -m eagle3d ...`` or the ``eagle3d`` script)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return False
    if "-m" in argv[:-1] and argv[argv.index("-m") + 1] == "eagle3d":
        return True
    return any(os.path.basename(a) == "eagle3d" for a in argv[:2])


def describe(pid: int) -> str:
    """``pid 123 (python -m eagle3d run ...) of user 1000``, for messages."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = ""
    try:
        uid: int | None = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        uid = None
    said = f"pid {pid}"
    if cmd:
        said += f" ({cmd[:80]}{'...' if len(cmd) > 80 else ''})"
    if uid is not None:
        said += f" of user {uid}"
    return said


def is_process(pid: int, started: int, boot: str) -> bool:
    """Whether ``pid`` is the process that started at ``started`` on boot ``boot``. Without
    a start time (a journal of an older version) the pid alone is taken."""
    if pid <= 0:
        return False
    if boot and boot != boot_id():
        return False
    now = start_time(pid)
    return now != 0 and (started == 0 or now == started)


__all__ = ["boot_id", "boottime", "describe", "holders", "is_process", "read_early", "start_time"]
