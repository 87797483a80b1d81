"""Fault injection for the crash and fault tests, driven by the ``EAGLE3D_FAULT`` variable.

Comma-separated specs, each optionally suffixed ``@/path/marker`` (fire only if the marker
file does not exist, and create it when firing, so a restarted process, or a second worker
process, does not fire again):

* ``kill:<point>`` - the daemon exits abruptly (``os._exit(137)``) at a named point:
  ``after_tmp_write``, ``after_rename``, ``before_journal_append``,
  ``after_append_before_sync``, ``mid_frame``, and ``eagle3d export``'s
  ``export_after_rename``, ``export_before_sync``; ``kill:<point>:<n>`` fires at the n-th time.
* ``worker_hang:<n>`` / ``worker_exit:<n>`` - the HF worker hangs / dies after n batches.
* ``worker_slow:<ms>`` - the HF worker rests ``ms`` milliseconds after every batch (a slow
  producer, so that a test can act while a run is surely still in progress).
* ``worker_slow_load:<ms>`` - the HF worker rests ``ms`` milliseconds before it loads the
  model (a 70B model's load, on a tiny model).
* ``worker_oom:<tokens>`` - in the HF worker's forward, a batch of more than ``tokens``
  tokens makes a real allocation too large for any machine (``bytearray(2**62)``), which
  raises a real MemoryError: memory that a smaller batch would not need.
* ``worker_crash:<n>`` - the HF worker exits with code 1 in the middle of its n-th forward
  (a crash of the process, as a bug in a library or a driver makes).
* ``worker_device_error:<n>`` - the HF worker's n-th forward raises ``RuntimeError("CUDA
  error: device-side assert triggered")``, as a failing device does.
* ``worker_crash_over:<tokens>`` - every forward of a batch holding a sample longer than
  ``tokens`` tokens exits with code 1: a sample that crashes its worker every time.
* ``bad_dump:<ids|shape|nan|truncate|vanish|layers>:<n>`` - the HF worker corrupts its n-th
  dump (``vanish``: deletes it right after writing it, as a cleanup of the dump area would;
  ``layers``: writes one layer fewer, names and states, as a producer set up for another
  capture would).
* ``count_slow:<ms>`` - the start's count of the dataset's rows rests ``ms`` milliseconds
  after every chunk it scans (a big dataset's read, on a small one: a test acts during it).
* ``export_slow:<ms>`` - ``eagle3d export`` rests ``ms`` milliseconds after every sample (a
  long export of a small job, so that a test sees its progress lines).
* ``hook_drop:<n>`` - the SGLang capture hook's writer silently drops its n-th dump (no file,
  no failure marker), as a server dying between its answer and the write would.
* ``wall_offset:<path>`` - the daemon's wall clock (its records' ``ts``) reads the seconds
  written in ``path`` (re-read each second; a step mid-run is a new number) ahead of the
  machine's: a clock set back or stepped forward under the daemon alone, never the
  machine's own. (libfaketime 0.9.10 cannot do it: with ``FAKETIME_DONT_FAKE_MONOTONIC=1``,
  which keeps the boot clock true, Python's ``time.sleep`` fails with EINVAL.)

With the variable unset every check is a dictionary lookup that returns False.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

KILL_POINTS = (
    "after_tmp_write",
    "after_rename",
    "before_journal_append",
    "after_append_before_sync",
    "mid_frame",
    "before_dump_removal",  # a batch's sample_saved records durable, its dumps not yet removed
    "export_after_rename",  # eagle3d export: a sample's file renamed, not yet recorded
    "export_before_sync",  # eagle3d export: records written, not yet synced
)

BAD_DUMPS = ("ids", "shape", "nan", "truncate", "vanish", "layers")


@dataclass(slots=True)
class Fault:
    name: str
    arg: str
    n: int
    marker: str
    seen: int = 0


def parse(text: str) -> dict[str, Fault]:
    """Parse the variable's value into faults keyed by ``name`` (``kill:point`` for kills)."""
    out: dict[str, Fault] = {}
    for spec in filter(None, (s.strip() for s in text.split(","))):
        spec, _, marker = spec.partition("@")
        parts = spec.split(":")
        name = parts[0]
        if name == "kill":
            if len(parts) < 2 or parts[1] not in KILL_POINTS:
                raise ValueError(f"EAGLE3D_FAULT: unknown kill point in {spec!r}")
            n = int(parts[2]) if len(parts) > 2 else 1
            out[f"kill:{parts[1]}"] = Fault("kill", parts[1], n, marker)
        elif name in (
            "worker_hang",
            "worker_exit",
            "worker_slow",
            "worker_slow_load",
            "worker_oom",
            "worker_crash",
            "worker_device_error",
            "worker_crash_over",
            "hook_drop",
            "export_slow",
            "count_slow",
        ):
            out[name] = Fault(name, "", int(parts[1]) if len(parts) > 1 else 1, marker)
        elif name == "wall_offset":
            out[name] = Fault(name, spec.partition(":")[2], 1, marker)
        elif name == "bad_dump":
            if len(parts) < 2 or parts[1] not in BAD_DUMPS:
                raise ValueError(f"EAGLE3D_FAULT: bad_dump needs {'|'.join(BAD_DUMPS)}: {spec!r}")
            out[name] = Fault(name, parts[1], int(parts[2]) if len(parts) > 2 else 1, marker)
        else:
            raise ValueError(f"EAGLE3D_FAULT: unknown fault {spec!r}")
    return out


_lock = threading.Lock()
_faults: dict[str, Fault] | None = None


def _active() -> dict[str, Fault]:
    global _faults
    if _faults is None:
        _faults = parse(os.environ.get("EAGLE3D_FAULT", ""))
    return _faults


def hit(key: str) -> Fault | None:
    """Count one occurrence of ``key``; return the fault if it fires now."""
    faults = _active()
    if not faults:
        return None
    f = faults.get(key)
    if f is None:
        return None
    with _lock:
        f.seen += 1
        if f.seen != f.n:
            return None
        if f.marker:
            # Created exclusively: of several worker processes reaching the n-th occurrence
            # at once, exactly one fires.
            try:
                with open(f.marker, "x") as m:
                    m.write(f"{key} fired in pid {os.getpid()}\n")
            except FileExistsError:
                return None
    return f


def armed(key: str) -> Fault | None:
    """The fault armed under ``key``, if any, without counting an occurrence."""
    faults = _active()
    return faults.get(key) if faults else None


def allocate_for(tokens: int) -> None:
    """``worker_oom``: a real allocation that fails when ``tokens`` exceed the armed limit."""
    f = armed("worker_oom")
    if f is not None and tokens > f.n:
        bytearray(1 << 62)  # MemoryError from the allocator itself


def crash_in_forward(longest: int) -> None:
    """``worker_crash``, ``worker_device_error``, ``worker_crash_over``: the forward of a
    batch whose longest sample has ``longest`` tokens dies here, if one is armed."""
    over = armed("worker_crash_over")
    if (over is not None and longest > over.n) or hit("worker_crash") is not None:
        os._exit(1)
    if hit("worker_device_error") is not None:
        raise RuntimeError("CUDA error: device-side assert triggered")


def kill_point(point: str) -> None:
    """Exit abruptly here if ``kill:<point>`` is armed (no cleanup, like SIGKILL)."""
    if hit(f"kill:{point}") is not None:
        os._exit(137)


def wall_clock() -> Callable[[], float]:
    """The daemon's wall clock: ``time.time``, or with ``wall_offset`` armed, it plus the
    seconds in the fault's file (read at most once a second)."""
    fault = _active().get("wall_offset")
    if fault is None:
        return time.time
    path = fault.arg
    last = [-1.0, 0.0]  # when read (monotonic), the offset read

    def clock() -> float:
        now = time.monotonic()
        if now - last[0] >= 1.0:
            last[0] = now
            try:
                with open(path) as f:
                    last[1] = float(f.read().strip() or 0)
            except (OSError, ValueError):
                pass  # keep the last offset: a file being rewritten
        return time.time() + last[1]

    return clock
