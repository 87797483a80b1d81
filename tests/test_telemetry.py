"""Telemetry: the real probes on this (GPU-less) machine, and NVML through a test double."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
from eagle3d.serve import telemetry
from eagle3d.serve.telemetry import NvmlGpus, SystemProbes, Telemetry, throttle_names
from eagle3proto import events as ev


class NVMLError(Exception):
    pass


class FakeNvml:
    """Stands in for the ``pynvml`` module: the seam NvmlGpus takes as an argument.

    Its constants are pynvml's; ``xids`` lists (device, code) events waiting to be read.
    """

    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_AGGREGATE_ECC = 1

    def __init__(self, devices: int = 2, init_error: bool = False, xid: bool = True) -> None:
        self.devices = devices
        self.init_error = init_error
        self.shutdowns = 0
        self.xid_supported = xid
        self.xids: list[tuple[int, int]] = []
        self.sets: dict[int, int] = {}  # event set -> device
        self.freed: list[int] = []

    def nvmlInit(self) -> None:
        if self.init_error:
            raise NVMLError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return self.devices

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA H200"

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=87, memory=40)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(used=(h + 1) << 30, total=141 << 30, free=0)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return 61

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return 412_500  # milliwatts

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        return 700_000

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        if h == 1:
            raise NVMLError("Not Supported")
        # uncorrected volatile 3, corrected volatile 41, uncorrected over the board's life 5
        return {(1, 0): 3, (0, 0): 41, (1, 1): 5}[(kind, counter)]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return 0x4 | 0x40 | 0x1  # sw power cap, hw thermal, idle (ignored)

    def nvmlDeviceGetSupportedEventTypes(self, h: int) -> int:
        return 0x8 | 0x1 if self.xid_supported else 0x1

    def nvmlEventSetCreate(self) -> int:
        es = 100 + len(self.sets)
        self.sets[es] = -1
        return es

    def nvmlDeviceRegisterEvents(self, h: int, types: int, es: int) -> None:
        assert types == 0x8
        self.sets[es] = h

    def nvmlEventSetWait_v2(self, es: int, timeout_ms: int) -> SimpleNamespace:
        assert timeout_ms == 0  # never blocks the stats record
        dev = self.sets[es]
        for k, (d, code) in enumerate(self.xids):
            if d == dev:
                del self.xids[k]
                return SimpleNamespace(eventType=0x8, eventData=code, device=d)
        raise NVMLError("Timeout")

    def nvmlEventSetFree(self, es: int) -> None:
        self.freed.append(es)


def test_real_probes_without_gpu_give_empty_gpus_and_a_note(tmp_path) -> None:
    t = Telemetry(str(tmp_path), str(tmp_path / "dumps"))
    os.makedirs(tmp_path / "dumps")
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    s = t.sample(producer_health=ev.ProducerHealth(name="hf", up=True, latency_s=0.5))
    t.close()  # after a failed nvmlInit this must not call nvmlShutdown (it would raise)
    if s.gpus:
        pytest.skip("this machine has a GPU; the GPU-less path is covered by the double")
    assert s.gpu_note.startswith("no GPU telemetry")
    assert [d.label for d in s.disk] == ["output", "dump"]
    st = os.statvfs(tmp_path)
    assert s.disk[0].total_bytes == st.f_blocks * st.f_frsize
    assert 0 < s.disk[0].free_bytes <= s.disk[0].total_bytes
    assert s.rss_bytes > 10 << 20
    assert s.cpu_percent > 0
    assert s.producer.name == "hf" and s.producer.up
    back = ev.decode(ev.encode(s))
    assert back == s


def test_fake_nvml_reads_every_field_and_blanks_only_unsupported_ones() -> None:
    nvml = FakeNvml(devices=2)
    g = NvmlGpus(nvml)
    gpus, note = g.read()
    assert note == ""
    assert [x.index for x in gpus] == [0, 1]
    a, b = gpus
    assert a.name == "NVIDIA H200"
    assert a.util_percent == 87
    assert a.mem_used_bytes == 1 << 30 and a.mem_total_bytes == 141 << 30
    assert a.temperature_c == 61
    assert a.power_w == pytest.approx(412.5)
    assert a.ecc_errors == 3
    assert b.ecc_errors == 0  # "Not Supported" blanks the field, not the device
    assert a.throttle == ["sw_power_cap", "hw_thermal"]
    assert (a.power_limit_w, a.ecc_corrected, a.ecc_uncorrected_total) == (700.0, 41, 5)
    assert (a.xid_errors, a.last_xid, a.last_xid_ts) == (0, 0, 0.0)
    g.close()
    assert nvml.shutdowns == 1


def test_xid_events_are_counted_per_device_with_the_newest_code_and_time() -> None:
    """No GPU is lent to this task: the XID path runs against the double at the NVML seam."""
    nvml = FakeNvml(devices=2)
    now = [1000.0]
    g = NvmlGpus(nvml, clock=lambda: now[0], boot_clock=lambda: now[0] - 900.0)
    gpus, _ = g.read()
    assert [x.xid_errors for x in gpus] == [0, 0]
    nvml.xids += [(1, 13), (1, 79)]
    now[0] = 1005.0
    a, b = g.read()[0]
    assert (a.xid_errors, b.xid_errors, b.last_xid, b.last_xid_ts) == (0, 2, 79, 1005.0)
    assert b.last_xid_bt == 105.0  # the boot clock beside it
    now[0] = 1010.0
    a, b = g.read()[0]  # nothing new: the count and the time hold
    assert (b.xid_errors, b.last_xid, b.last_xid_ts) == (2, 79, 1005.0)
    nvml.xids.append((0, 48))
    a, b = g.read()[0]
    assert (a.xid_errors, a.last_xid, a.last_xid_ts) == (1, 48, 1010.0)
    g.close()
    assert sorted(nvml.freed) == [100, 101]


def test_a_board_without_xid_events_reads_everything_else() -> None:
    nvml = FakeNvml(devices=1, xid=False)
    gpus, note = NvmlGpus(nvml).read()
    assert note == "" and gpus[0].util_percent == 87 and gpus[0].xid_errors == 0
    assert nvml.sets == {}


def test_failed_init_is_a_note_and_never_shut_down() -> None:
    nvml = FakeNvml(init_error=True)
    t = Telemetry("/", probes=SystemProbes(nvml))
    s = t.sample()
    assert s.gpus == []
    assert s.gpu_note == "no GPU telemetry: Driver Not Loaded"
    t.sample()  # not retried, still fine
    t.close()
    assert nvml.shutdowns == 0


def test_zero_devices_and_missing_dump_dir(tmp_path) -> None:
    t = Telemetry(str(tmp_path), str(tmp_path / "missing"), probes=SystemProbes(FakeNvml(0)))
    s = t.sample(inflight=4, orphans=2, state="paused")
    assert s.gpus == [] and s.gpu_note == "no GPU devices"
    assert [d.label for d in s.disk] == ["output"]  # an unreadable path is left out
    assert (s.inflight, s.orphans, s.state) == (4, 2, "paused")


def test_real_pynvml_module_without_driver_is_not_an_error() -> None:
    pynvml = pytest.importorskip("pynvml")
    g = NvmlGpus(pynvml)
    gpus, note = g.read()
    if gpus:
        pytest.skip("NVML works here")
    assert note.startswith("no GPU telemetry")
    g.close()


def test_throttle_names() -> None:
    assert throttle_names(0) == []
    assert throttle_names(0x8 | 0x80) == ["hw_slowdown", "hw_power_brake"]
    assert telemetry._THROTTLE_BITS  # the table is what the names come from


class FakeProbes:
    """A double at the Probes seam: fixed facts, and a record of what was asked."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.closed = False

    def gpus(self) -> tuple[list[ev.GpuInfo], str]:
        return [ev.GpuInfo(index=0, name="X", util_percent=50.0)], ""

    def disk(self, label: str, path: str) -> ev.DiskUsage | None:
        self.asked.append(f"{label}:{path}")
        return ev.DiskUsage(label=label, path=path, total_bytes=100, used_bytes=60, free_bytes=40)

    def process(self) -> tuple[float, int]:
        return 12.5, 1 << 30

    def children_rss(self) -> int:
        self.asked.append("children")
        return 3 << 30

    def close(self) -> None:
        self.closed = True


def test_telemetry_composes_a_stats_record_from_the_seam() -> None:
    probes = FakeProbes()
    t = Telemetry("/out", "/dev/shm/dumps", probes=probes)
    s = t.sample(producer_health=ev.ProducerHealth(name="sglang", up=False), inflight=7)
    assert probes.asked == ["output:/out", "dump:/dev/shm/dumps"]
    assert [(d.label, d.free_bytes) for d in s.disk] == [("output", 40), ("dump", 40)]
    assert s.gpus[0].util_percent == 50.0 and s.gpu_note == ""
    assert (s.cpu_percent, s.rss_bytes, s.inflight) == (12.5, 1 << 30, 7)
    assert s.producer.name == "sglang" and not s.producer.up
    assert Telemetry("/out", probes=probes).sample().disk[0].label == "output"
    assert "children" not in probes.asked and s.producer_rss_bytes == 0  # only while loading
    assert t.sample(producer_rss=True).producer_rss_bytes == 3 << 30
    t.close()
    assert probes.closed


def test_children_rss_counts_the_real_child_processes() -> None:
    """The producer's workers are the daemon's children: their memory is what a load grows."""
    import subprocess
    import sys

    probes = SystemProbes(FakeNvml(0))
    before = probes.children_rss()
    code = "import sys; b = bytearray(200 << 20); print('ready', flush=True); sys.stdin.read()"
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        assert probes.children_rss() - before > 190 << 20
    finally:
        child.communicate("")


def test_without_a_driver_pynvml_is_not_even_imported(tmp_path) -> None:
    """No NVIDIA driver anywhere it shows itself: the note says so, and pynvml (30 ms of a
    start, the interpreter held meanwhile) is never imported."""
    import subprocess
    import sys

    from eagle3d.serve import telemetry

    if any(os.path.exists(p) for p in telemetry.DRIVER_PATHS):
        pytest.skip("this machine has an NVIDIA driver")
    probe = (
        "import sys\n"
        "from eagle3d.serve.telemetry import NvmlGpus\n"
        "gpus, note = NvmlGpus().read()\n"
        "print(gpus == [], 'pynvml' in sys.modules, note)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("True False no GPU telemetry: no NVIDIA driver"), out
    # A driver's path present: NVML is asked (and, with no driver behind it, says why).
    present = tmp_path / "nvidiactl"
    present.touch()
    gpus, note = NvmlGpus(driver_paths=(str(present),)).read()
    assert gpus == [] and note.startswith("no GPU telemetry") and "no NVIDIA driver" not in note
