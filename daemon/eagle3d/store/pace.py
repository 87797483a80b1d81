"""How fast this machine can commit: the commit path's measured CPU per byte, and what a
machine's cores and commit threads can hold with it (``eagle3d plan``'s commit line, the
daemon's line about its commit threads). Pure.

On a GPU node the producer makes states faster than on any CPU (an 8B target at ~30k
tokens/s per GPU is ~1 GB/s of bf16 per GPU), so what the daemon spends per committed byte
is multiplied by that: at ``c`` CPU-seconds per GB, committing ``R`` GB/s takes ``c * R``
cores. ``bench/commit_cpu.py`` measures ``c`` against the floor (one memcpy of the bytes
plus ``dd oflag=direct`` writing them) in the same run; the figures below are its medians
on this project's reference machine (docs/benchmarks.md, issue #32). A commit thread does
its CPU work on one core at a time, so ``n`` threads hold at most ``n`` cores' worth.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Daemon CPU-seconds per GB committed, beyond its fixed start (bench/commit_cpu.py, h2048,
#: 400-800-token samples, a dump area in 4 KiB pages): dumps in the sample file's layout,
#: written out from the mapped dump (the HF workers', the SGLang hook's), bfloat16 0.48-0.57
#: and fp8 0.62-0.68 (half the bytes per sample for the same per-sample work; the safetensors
#: layout's read, check and checksum took 0.80 and 0.89 in the same runs); and bfloat16
#: dumps quantized to fp8 by the commit (2.85). A dump area in 2 MiB pages takes 0.29-0.37
#: for bfloat16.
CPU_S_PER_GB_AS_IS = 0.5
CPU_S_PER_GB_AS_IS_FP8 = 0.65
CPU_S_PER_GB_QUANTIZED = 2.9


@dataclass(frozen=True, slots=True)
class CommitPace:
    """What ``threads`` commit threads on ``cpus`` cores can commit, by the measured cost."""

    cpus: int
    threads: int
    cpu_s_per_gb: float
    bytes_per_s: float  # the commit rate the cores can hold (CPU only; the disk is apart)
    tokens_per_s: float  # the same at the job's bytes per token

    def describe(self) -> str:
        return (
            f"commits: {self.threads} thread(s) on {self.cpus} CPU(s) hold about "
            f"{self.bytes_per_s / 1e9:.1f} GB/s ({self.tokens_per_s:,.0f} tokens/s) of CPU "
            f"at {self.cpu_s_per_gb:.2f} CPU-s per GB committed; the disk's own rate is apart"
        )


def estimate(
    cpus: int,
    threads: int,
    bytes_per_token: float,
    fp8: bool = False,
    quantized_by_commit: bool = False,
) -> CommitPace:
    """The commit rate ``threads`` threads on ``cpus`` cores hold for a job of
    ``bytes_per_token`` (``fp8``: in the fp8 format; ``quantized_by_commit``: its dumps are
    bfloat16, quantized by the commit)."""
    if quantized_by_commit:
        cost = CPU_S_PER_GB_QUANTIZED
    else:
        cost = CPU_S_PER_GB_AS_IS_FP8 if fp8 else CPU_S_PER_GB_AS_IS
    cores = max(1, min(cpus, threads))
    rate = cores * 1e9 / cost
    return CommitPace(cpus, threads, cost, rate, rate / bytes_per_token if bytes_per_token else 0.0)
