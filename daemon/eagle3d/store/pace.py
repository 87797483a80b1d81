"""How fast this machine can commit: the commit path's measured CPU per sample file and per
byte, and what a machine's cores and commit threads can hold with it (``eagle3d plan``'s
commit line). Pure.

On a GPU node the producer makes states faster than on any CPU (an 8B target at ~30k
tokens/s per GPU is ~1 GB/s of bf16 per GPU), so what the daemon spends per committed file
and byte is multiplied by that. ``bench/commit_cpu.py`` measures the daemon's CPU against
the floor (one memcpy of the bytes plus ``dd oflag=direct`` writing them) in the same run;
at a job's size (3,000 samples of 3.3 and 6.7 MB) its CPU beyond the start is a part per
sample file, whatever its size (the file's create, sync and rename, the checks, the journal
record), and a part per byte that is the direct write itself (docs/benchmarks.md, issue
#32). A commit thread does its CPU work on one core at a time, so ``n`` threads hold at
most ``n`` cores' worth.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Daemon CPU-seconds per sample file committed (every thread: the commit's calls, the main
#: loop's ledger and journal, the feeder, the dump watcher), and per GB: fitted to resumes of
#: h2048 fp8 samples of 400 and 800 tokens (3.3 and 6.6 MB) on a fresh journaled ext4, as a
#: node's data disk is, beyond the start (``bench/commit_cpu.py --fresh-fs``, 2026-12-07,
#: with a v2 dump staged in the commit thread's buffer: 0.32-0.40 and 0.23-0.27 CPU-s/GB,
#: so 0.82 ms per file and 0.13 CPU-s/GB, the benchmark's producer's ~0.07 ms per file
#: included).
CPU_S_PER_FILE = 0.85e-3
#: ... per GB: the pages moved into the direct write (a dump area in 4 KiB pages).
CPU_S_PER_GB = 0.13


@dataclass(frozen=True, slots=True)
class CommitPace:
    """What ``threads`` commit threads on ``cpus`` cores can commit, by the measured cost."""

    cpus: int
    threads: int
    bytes_per_sample: float
    cpu_s_per_gb: float  # at these samples' size: the per-file part spread over their bytes
    bytes_per_s: float  # the commit rate the cores can hold (CPU only; the disk is apart)
    tokens_per_s: float  # the same at the job's bytes per token

    def describe(self) -> str:
        return (
            f"commits: {self.threads} thread(s) on {self.cpus} CPU(s) hold about "
            f"{self.bytes_per_s / 1e9:.1f} GB/s ({self.tokens_per_s:,.0f} tokens/s) of CPU "
            f"at {self.cpu_s_per_gb:.2f} CPU-s per GB committed ({CPU_S_PER_FILE * 1e3:.2f} ms "
            f"per sample file + {CPU_S_PER_GB:.2f} CPU-s per GB, samples of "
            f"{self.bytes_per_sample / 1e6:,.1f} MB); the disk's own rate is apart"
        )


def estimate(
    cpus: int, threads: int, bytes_per_token: float, bytes_per_sample: float
) -> CommitPace:
    """The commit rate ``threads`` threads on ``cpus`` cores hold for a job of
    ``bytes_per_token`` and ``bytes_per_sample`` (its mean sample file)."""
    per_sample = max(bytes_per_sample, 1.0)
    cost = (CPU_S_PER_FILE + CPU_S_PER_GB * per_sample / 1e9) / per_sample * 1e9
    cores = max(1, min(cpus, threads))
    rate = cores * 1e9 / cost
    tokens = rate / bytes_per_token if bytes_per_token else 0.0
    return CommitPace(cpus, threads, bytes_per_sample, cost, rate, tokens)
