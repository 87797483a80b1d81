"""How many Hugging Face workers a node gets, on which devices, with how many threads. Pure
but for the few reads of the machine it names (CPUs, GPUs, weight files)."""

from __future__ import annotations

import contextlib
import os


def cpu_worker(device: str, gpus: int) -> bool:
    """A worker on this ``--device`` runs on the CPU (it never initializes CUDA)."""
    return device == "cpu" or (device == "auto" and gpus == 0)


#: A batch's token budget when ``--batch-tokens`` is not given: on a GPU, batches large enough
#: to fill the device; on a CPU, small ones. A CPU forward's cost grows with the tokens it
#: computes, padding included, and gains little from long batches: on the demo set a budget
#: of 512 tokens computed 91-96 % real tokens against 68-75 % with 8192, and the whole short
#: job went from 0.97x to 1.2-1.3x the serial script (docs/benchmarks.md, "Whole short job").
GPU_BATCH_TOKENS = 8192
CPU_BATCH_TOKENS = 512


def token_budget(configured: int, device: str, gpus: int) -> int:
    """The token budget of a worker's batches: ``configured``, or by its device when 0."""
    if configured > 0:
        return configured
    return CPU_BATCH_TOKENS if cpu_worker(device, gpus) else GPU_BATCH_TOKENS


def worker_device(device: str, slot: int, gpus: int) -> str:
    """The ``--device`` for worker ``slot``: on CUDA, workers go round-robin over the GPUs.

    Without this, ``--workers 8`` on an 8-GPU node would load eight copies of the model onto
    the first GPU. ``gpus`` counts the GPUs this process sees (``CUDA_VISIBLE_DEVICES``
    applies); with none, ``auto`` stays ``auto`` and the worker takes the CPU.
    """
    if device in ("auto", "cuda") and gpus > 0:
        return f"cuda:{slot % gpus}"
    return device


# More CPU workers than this gain little: each holds a copy of the model and its activations.
MAX_CPU_WORKERS = 8


def worker_layout(
    workers: int, threads: int, *, gpus: int, cpus: int, model_bytes: int, mem_available: int
) -> tuple[int, int]:
    """(worker processes, torch threads in each) for ``--workers``/``--worker-threads``.

    0 means automatic. On GPUs: one worker per GPU. On a CPU: one worker per core, at most
    :data:`MAX_CPU_WORKERS`, and no more copies of the model than half the available memory
    holds (counting each copy twice, for an fp32 upcast and the activations). The CPUs are
    then divided among the workers. Why several single-threaded workers rather than one
    worker using every core: a multi-threaded forward meets at a barrier after each operator,
    so CPU time the daemon takes from one core stalls all of them, while independent workers
    lose only the time taken (docs/benchmarks.md, fifth session).
    """
    cpus = max(1, cpus)
    if workers <= 0:
        if gpus > 0:
            workers = gpus
        else:
            fits = mem_available // max(1, 4 * model_bytes)
            workers = max(1, min(cpus, MAX_CPU_WORKERS, fits))
    if threads <= 0:
        threads = max(1, cpus // workers)
    return workers, threads


def model_weight_bytes(model_dir: str) -> int:
    """Bytes of the weight files in a model directory (0 when there are none to count)."""
    total = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(model_dir):
            if entry.name.endswith((".safetensors", ".bin", ".pt", ".pth")) and entry.is_file():
                total += entry.stat().st_size
    return total


def usable_cpus() -> int:
    """CPUs this process may run on (Slurm and cgroup affinity apply), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


#: What a CUDA (or ROCm) driver puts on a host, a container given GPUs included.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def visible_gpus(device: str) -> int:
    """How many CUDA devices this process sees; 0 for a CPU job or a CPU-only torch."""
    if device == "cpu" or not any(os.path.exists(p) for p in GPU_DEVICE_NODES):
        # No GPU driver on this host: nothing to count, and no torch import in the daemon
        # (a second or two of CPU that its workers, loading the model, need more).
        return 0
    try:
        import torch
    except ImportError:  # pragma: no cover - the extract extra brings torch
        return 0
    # device_count() asks the driver without creating a context: no GPU memory is taken
    # in the daemon, and the workers are exec'd, never forked from it.
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
