"""Which device each HF worker gets: round-robin over the GPUs, the CPU without them."""

from __future__ import annotations

from eagle3d.producers.hf import visible_gpus, worker_device


def test_cuda_workers_spread_round_robin_over_the_gpus() -> None:
    assert [worker_device("cuda", slot, 4) for slot in range(6)] == [
        "cuda:0",
        "cuda:1",
        "cuda:2",
        "cuda:3",
        "cuda:0",
        "cuda:1",
    ]
    assert [worker_device("auto", slot, 2) for slot in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]


def test_without_gpus_or_on_the_cpu_the_setting_passes_through() -> None:
    assert worker_device("auto", 3, 0) == "auto"  # the worker falls back to the CPU itself
    assert worker_device("cpu", 1, 8) == "cpu"  # asked for the CPU on a GPU node
    assert worker_device("cuda", 0, 0) == "cuda"  # the worker then fails with torch's message


def test_a_cpu_job_or_a_cpu_only_machine_sees_no_gpu() -> None:
    assert visible_gpus("cpu") == 0
    import torch

    if not torch.cuda.is_available():  # this machine (CI): the CPU wheel of torch
        assert visible_gpus("auto") == 0
    else:  # a GPU node: what torch sees
        assert visible_gpus("auto") == torch.cuda.device_count()
