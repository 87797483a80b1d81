"""Periodic ``stats`` records: what a remote monitor cannot observe itself.

:class:`Telemetry` builds one :class:`eagle3proto.events.Stats` per call to
:meth:`Telemetry.sample` (the daemon calls it about once a second and journals the result):
GPU health per device via NVML, disk usage of the output filesystem and of the dump area,
the daemon's own CPU% and RSS, and the producer health the daemon passes in.

GPU health beyond utilisation: uncorrected and corrected ECC counts (volatile) and the
board's lifetime uncorrected count, clock throttle reasons, power draw against the enforced
limit, and critical XID events (an NVML event set per device, drained without waiting at
every sample: their count since the daemon started, the newest code and when it was seen).

Every probe sits behind :class:`Probes` (the narrow I/O seam); :class:`SystemProbes` is the
real one. Without a GPU, or without ``pynvml`` installed, the GPU list is empty and
``gpu_note`` says why; that is never an error. ``nvmlShutdown`` is only called after a
successful ``nvmlInit``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from eagle3proto import events as ev
from eagle3proto import locks

# NVML throttle ("clocks event") reason bits, from nvml.h; names as nvidia-smi prints them.
_THROTTLE_BITS = {
    0x0000000000000002: "applications_clocks",
    0x0000000000000004: "sw_power_cap",
    0x0000000000000008: "hw_slowdown",
    0x0000000000000010: "sync_boost",
    0x0000000000000020: "sw_thermal",
    0x0000000000000040: "hw_thermal",
    0x0000000000000080: "hw_power_brake",
    0x0000000000000100: "display_clocks",
}


class Probes(Protocol):
    """The I/O seam: everything :class:`Telemetry` reads from the machine."""

    def gpus(self) -> tuple[list[ev.GpuInfo], str]:
        """GPU facts and a note (empty when GPUs were read fine)."""
        ...

    def disk(self, label: str, path: str) -> ev.DiskUsage | None:
        """Usage of the filesystem holding ``path`` (None if it cannot be read)."""
        ...

    def process(self) -> tuple[float, int]:
        """This process's CPU percent since the last call, and its RSS in bytes."""
        ...

    def children_rss(self) -> int:
        """RSS of this process's children (the producer's workers), in bytes."""
        ...

    def close(self) -> None: ...


def throttle_names(mask: int) -> list[str]:
    """Names of the throttle reasons set in an NVML reason bitmask (idle bit ignored)."""
    return [name for bit, name in _THROTTLE_BITS.items() if mask & bit]


#: NVML's event type bit for critical XID errors (nvml.h nvmlEventTypeXidCriticalError).
XID_EVENT = 0x0000000000000008


#: Where an NVIDIA driver shows itself (Linux, containers given GPUs, WSL2): with none of
#: them, NVML cannot start, and ``pynvml`` is not imported (its import costs a start 30 ms
#: of CPU and holds the interpreter from the commit threads meanwhile).
DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg")


class NvmlGpus:
    """Reads GPUs through ``pynvml``; initialised once, lazily, never retried after failing.

    ``clock`` gives the wall time an XID event is stamped with (it is seen at the next read),
    ``boot_clock`` the boot-clock reading beside it (readers place the event on the
    session's timeline with it, whatever the wall clock did since).
    """

    def __init__(
        self,
        nvml: Any | None = None,
        clock: Callable[[], float] = time.time,
        boot_clock: Callable[[], float] = locks.boottime,
        driver_paths: tuple[str, ...] = DRIVER_PATHS,
    ) -> None:
        self._nvml: Any = nvml
        self.driver_paths = driver_paths
        self._ok: bool | None = None
        self.note = ""
        self.clock = clock
        self.boot_clock = boot_clock
        self._xid_sets: dict[int, Any] = {}  # device index -> its event set (None: unsupported)
        # index -> (count, last code, wall time, boot-clock time)
        self._xids: dict[int, tuple[int, int, float, float]] = {}

    def _init(self) -> bool:
        if self._ok is not None:
            return self._ok
        self._ok = False
        nvml = self._nvml
        if nvml is None:
            if not any(os.path.exists(p) for p in self.driver_paths):
                self.note = (
                    f"no GPU telemetry: no NVIDIA driver ({', '.join(self.driver_paths)}: none)"
                )
                return False
            try:
                import pynvml  # optional: the "gpu" extra (nvidia-ml-py)
            except ImportError:
                self.note = "no GPU telemetry: pynvml (nvidia-ml-py) is not installed"
                return False
            self._nvml = nvml = pynvml
        try:
            nvml.nvmlInit()
        except Exception as e:  # NVMLError (no driver, no device) or a broken install
            self.note = f"no GPU telemetry: {_nvml_error(e)}"
            return False
        self._ok = True
        return True

    def read(self) -> tuple[list[ev.GpuInfo], str]:
        if not self._init():
            return [], self.note
        nvml = self._nvml
        try:
            count = nvml.nvmlDeviceGetCount()
        except Exception as e:
            return [], f"NVML device count failed: {_nvml_error(e)}"
        if count == 0:
            return [], "no GPU devices"
        return [self._device(nvml, i) for i in range(count)], ""

    def _drain_xids(self, nvml: Any, i: int, h: Any) -> None:
        """Count the XID events waiting in device ``i``'s event set (registered on first use)."""
        if i not in self._xid_sets:
            self._xid_sets[i] = None
            try:
                if nvml.nvmlDeviceGetSupportedEventTypes(h) & XID_EVENT:
                    es = nvml.nvmlEventSetCreate()
                    nvml.nvmlDeviceRegisterEvents(h, XID_EVENT, es)
                    self._xid_sets[i] = es
            except Exception:  # not supported on this board or driver: no XID counts
                pass
        es = self._xid_sets[i]
        if es is None:
            return
        for _ in range(64):  # bounded: a storm of events must not hold up the stats record
            try:
                data = nvml.nvmlEventSetWait_v2(es, 0)
            except Exception:  # NVML_ERROR_TIMEOUT: nothing (more) waiting
                return
            if int(data.eventType) & XID_EVENT:
                n = self._xids[i][0] if i in self._xids else 0
                self._xids[i] = (n + 1, int(data.eventData), self.clock(), self.boot_clock())

    def _device(self, nvml: Any, i: int) -> ev.GpuInfo:
        info = ev.GpuInfo(index=i)
        try:
            h = nvml.nvmlDeviceGetHandleByIndex(i)
        except Exception:
            return info

        def q(fn: str, *args: Any) -> Any:
            # One failing query (not supported on this board, driver too old) must only
            # blank that field, never the whole record (nvitop's NA sentinel idea).
            f = getattr(nvml, fn, None)
            if f is None:
                return None
            try:
                return f(h, *args)
            except Exception:
                return None

        name = q("nvmlDeviceGetName")
        if name is not None:
            info.name = name.decode() if isinstance(name, bytes) else str(name)
        util = q("nvmlDeviceGetUtilizationRates")
        if util is not None:
            info.util_percent = float(util.gpu)
        mem = q("nvmlDeviceGetMemoryInfo")
        if mem is not None:
            info.mem_used_bytes = int(mem.used)
            info.mem_total_bytes = int(mem.total)
        temp = q("nvmlDeviceGetTemperature", getattr(nvml, "NVML_TEMPERATURE_GPU", 0))
        if temp is not None:
            info.temperature_c = float(temp)
        power = q("nvmlDeviceGetPowerUsage")
        if power is not None:
            info.power_w = float(power) / 1000.0  # NVML reports milliwatts
        limit = q("nvmlDeviceGetEnforcedPowerLimit")
        if limit is not None:
            info.power_limit_w = float(limit) / 1000.0
        uncorrected = getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
        corrected = getattr(nvml, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
        volatile = getattr(nvml, "NVML_VOLATILE_ECC", 0)
        aggregate = getattr(nvml, "NVML_AGGREGATE_ECC", 1)
        ecc = q("nvmlDeviceGetTotalEccErrors", uncorrected, volatile)
        if ecc is not None:
            info.ecc_errors = int(ecc)
        ecc = q("nvmlDeviceGetTotalEccErrors", corrected, volatile)
        if ecc is not None:
            info.ecc_corrected = int(ecc)
        ecc = q("nvmlDeviceGetTotalEccErrors", uncorrected, aggregate)
        if ecc is not None:
            info.ecc_uncorrected_total = int(ecc)
        mask = q("nvmlDeviceGetCurrentClocksEventReasons")
        if mask is None:
            mask = q("nvmlDeviceGetCurrentClocksThrottleReasons")
        if mask is not None:
            info.throttle = throttle_names(int(mask))
        self._drain_xids(nvml, i, h)
        if i in self._xids:
            info.xid_errors, info.last_xid, info.last_xid_ts, info.last_xid_bt = self._xids[i]
        return info

    def close(self) -> None:
        if self._ok:
            self._ok = None
            for es in self._xid_sets.values():
                if es is not None:
                    with contextlib.suppress(Exception):
                        self._nvml.nvmlEventSetFree(es)
            self._xid_sets.clear()
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()


def _nvml_error(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text


class SystemProbes:
    """The real probes: NVML, ``os.statvfs`` and ``psutil`` for this process."""

    def __init__(self, nvml: Any | None = None) -> None:
        self._gpus = NvmlGpus(nvml)
        self._proc: Any = None
        try:
            import psutil

            self._proc = psutil.Process(os.getpid())
            self._proc.cpu_percent(None)  # the first call only starts the measurement
        except Exception:
            self._proc = None

    def gpus(self) -> tuple[list[ev.GpuInfo], str]:
        return self._gpus.read()

    def disk(self, label: str, path: str) -> ev.DiskUsage | None:
        try:
            st = os.statvfs(path)
        except OSError:
            return None
        total = st.f_blocks * st.f_frsize
        free = st.f_bavail * st.f_frsize  # what an unprivileged writer can still use
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        return ev.DiskUsage(
            label=label, path=path, total_bytes=total, used_bytes=used, free_bytes=free
        )

    def process(self) -> tuple[float, int]:
        if self._proc is None:
            return 0.0, 0
        try:
            with self._proc.oneshot():
                return float(self._proc.cpu_percent(None)), int(self._proc.memory_info().rss)
        except Exception:
            return 0.0, 0

    def children_rss(self) -> int:
        if self._proc is None:
            return 0
        total = 0
        with contextlib.suppress(Exception):
            for child in self._proc.children(recursive=True):
                with contextlib.suppress(Exception):  # it may be gone meanwhile
                    total += int(child.memory_info().rss)
        return total

    def close(self) -> None:
        self._gpus.close()


class Telemetry:
    """Builds ``stats`` records for one daemon.

    Args:
        output_dir: the job's output directory (its filesystem is reported as ``output``).
        dump_dir: where the producer drops dumps (reported as ``dump`` when it is on a
            different filesystem or path).
        probes: the I/O seam; :class:`SystemProbes` by default.
    """

    def __init__(
        self, output_dir: str, dump_dir: str | None = None, *, probes: Probes | None = None
    ):
        self.output_dir = output_dir
        self.dump_dir = dump_dir
        self.probes: Probes = probes if probes is not None else SystemProbes()

    def sample(
        self,
        *,
        producer_health: ev.ProducerHealth | None = None,
        inflight: int = 0,
        orphans: int = 0,
        state: str = "running",
        producer_rss: bool = False,
    ) -> ev.Stats:
        """One ``stats`` record (``seq``/``ts``/``run`` are stamped by the journal).

        ``producer_rss`` adds the memory of the daemon's child processes (asked for while the
        producer starts: a model load that makes progress grows it).
        """
        disks = []
        out = self.probes.disk("output", self.output_dir)
        if out is not None:
            disks.append(out)
        if self.dump_dir:
            dump = self.probes.disk("dump", self.dump_dir)
            if dump is not None:
                disks.append(dump)
        gpus, note = self.probes.gpus()
        cpu, rss = self.probes.process()
        return ev.Stats(
            state=state,
            disk=disks,
            gpus=gpus,
            gpu_note=note,
            producer=producer_health if producer_health is not None else ev.ProducerHealth(),
            cpu_percent=cpu,
            rss_bytes=rss,
            inflight=inflight,
            orphans=orphans,
            producer_rss_bytes=self.probes.children_rss() if producer_rss else 0,
        )

    def close(self) -> None:
        self.probes.close()
