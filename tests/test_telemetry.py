"""Telemetry: the real probes on this (GPU-less) machine, and NVML through a test double."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
from eagle3d import telemetry
from eagle3d.telemetry import NvmlGpus, SystemProbes, Telemetry, throttle_names
from eagle3proto import events as ev


class NVMLError(Exception):
    pass


class FakeNvml:
    """Stands in for the ``pynvml`` module: the seam NvmlGpus takes as an argument."""

    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0

    def __init__(self, devices: int = 2, init_error: bool = False) -> None:
        self.devices = devices
        self.init_error = init_error
        self.shutdowns = 0

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

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        if h == 1:
            raise NVMLError("Not Supported")
        return 3

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return 0x4 | 0x40 | 0x1  # sw power cap, hw thermal, idle (ignored)


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
    g.close()
    assert nvml.shutdowns == 1


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
    t.close()
    assert probes.closed
