"""Kernel names for this process's Python threads.

CPython (before 3.14) leaves every thread with the executable's name, so ``top -H``,
``ps -L``, ``perf`` and ``/proc`` show a dozen ``python`` threads and cannot tell the commit
threads from the feeder, the journal flusher or watchdog's observer. A process may set any of
its own threads' names through ``/proc/self/task/TID/comm``, so one call names every thread
alive, those that libraries start included, without wrapping their targets. The main thread
keeps the process's name. In a process that is not ours (the SGLang server that loads the
capture hook), :func:`name_this_thread` names only the calling thread.
"""

from __future__ import annotations

import threading
import weakref

#: The kernel's limit on a thread name, in bytes (``TASK_COMM_LEN`` less the NUL).
COMM_LEN = 15

_named: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def kernel_name(name: str) -> str:
    """``name`` as the kernel will keep it: ASCII, at most :data:`COMM_LEN` bytes.

    ``concurrent.futures`` names its threads ``ThreadPoolExecutor-N_M`` unless given a
    prefix; the counters are what tells them apart, so they are what is kept.
    """
    if name.startswith("ThreadPoolExecutor-"):
        name = "pool-" + name.removeprefix("ThreadPoolExecutor-")
    return name.encode("ascii", "replace").decode("ascii")[:COMM_LEN]


def _set(tid: int, name: str) -> bool:
    """Set thread ``tid``'s (of this process) kernel name; False if it ended or there is no
    ``/proc``."""
    try:
        with open(f"/proc/self/task/{tid}/comm", "w") as f:
            f.write(kernel_name(name))
    except OSError:
        return False
    return True


def name_threads() -> int:
    """Give every live thread of this process, except the main one, its Python name as its
    kernel name, once; returns how many were named now. Threads that ended meanwhile, and
    systems without ``/proc``, are skipped."""
    named = 0
    main = threading.main_thread()
    for t in threading.enumerate():
        if t is main or t in _named or t.native_id is None or not _set(t.native_id, t.name):
            continue
        _named.add(t)
        named += 1
    return named


def name_this_thread(name: str) -> bool:
    """Set the calling thread's kernel name to ``name`` (cut as :func:`kernel_name` cuts);
    whether it took. For our own thread inside another program's process, whose other
    threads are not ours to rename."""
    return _set(threading.get_native_id(), name)
