"""How a Hugging Face worker forms its batches and keeps its memory, pure where it can be.

:func:`next_batch` and :func:`batch_budget` choose the next batch from the pending requests
(nearby lengths, padding never stored); :func:`tune_malloc` keeps the forward's freed
activations mapped for the next batch.
"""

from __future__ import annotations

import os

# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def tune_malloc() -> str:
    """Keep the forward's freed activations mapped for the next batch; returns what applied.

    By default glibc serves large blocks with ``mmap`` and returns them (or the top of the
    heap) to the kernel when freed, so every batch faults its activations back in on fresh
    pages the kernel must zero: 5 % of a CPU worker's time went to ``clear_page`` (perf),
    and glibc's sliding threshold made it differ from one worker process to the next.
    Blocks up to 32 MiB (glibc's ceiling) now come from the heap, and up to 1 GiB of free
    heap is kept. Nothing changes where the operator set ``MALLOC_*`` themselves, or
    without glibc. The benchmark's bare loop calls this too (``bench/bench_pipeline.py``).
    """
    import ctypes

    if any(k in os.environ for k in MALLOC_ENV):
        return "MALLOC_* set by the operator"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "no mallopt (not glibc)"
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    if mallopt(M_MMAP_THRESHOLD, 32 << 20) and mallopt(M_TRIM_THRESHOLD, 1 << 30):
        return "mmap threshold 32 MiB, trim threshold 1 GiB"
    return "mallopt refused"  # pragma: no cover - a libc that lacks these parameters


#: A batch padded to less than this share of the budget counts as under-filled.
MIN_FILL = 0.5


def next_batch(lengths: dict[str, int], budget: int) -> list[str]:
    """The next batch from a pool of pending requests (``lengths`` in arrival order).

    The batch always holds the oldest request, so nothing waits for ever however long or
    short it is. Around it, the pool sorted by length is cut into runs that fit the budget
    (count x longest); the run kept is the one that wastes the least on padding (real /
    padded tokens), where a run padded to under ``MIN_FILL`` of the budget is marked down
    by how empty it is (small batches use the hardware badly); ties go to the larger run.
    Taking the shortest requests first instead, as a plain sort does, left the long ones
    to pile up: behind the daemon's refilled window the demo set ran at 57 % real tokens,
    against 72 % with this rule (counted in the worker; see docs/benchmarks.md).
    """
    if not lengths:
        return []
    oldest = next(iter(lengths))
    order = sorted(lengths, key=lambda r: lengths[r])
    k = order.index(oldest)
    best: list[str] = [oldest]
    best_key = (-1.0, 0)
    for start in range(k, -1, -1):
        longest = 0
        total = 0
        end = start
        while end < len(order):
            n = lengths[order[end]]  # sorted: each request is the run's longest so far
            if end > start and n * (end - start + 1) > budget:
                break
            longest = n
            total += n
            end += 1
        if end <= k:
            break  # runs starting further left cannot reach the oldest request either
        padded = longest * (end - start)
        score = total / padded * min(1.0, padded / budget / MIN_FILL)
        key = (score, end - start)
        if key > best_key:
            best, best_key = order[start:end], key
    return best


def batch_budget(pending: int, budget: int) -> int:
    """The token budget of the next batch when ``pending`` tokens wait: ``budget``, except
    when all of them would fit in one batch; then about half of them (never under a quarter
    of ``budget``), so that the last of a worker's work goes in two lighter batches.

    That only happens when nothing refills the queue, at the end of the dataset: one batch
    padded to the longest of everything left made the worker that got it finish last
    while another idled, and two batches of similar lengths pad less (demo set: 77-80 % real
    tokens against 73-78 %, idle workers 1.5-2.5 % of the span against 2.3-5 %).
    """
    if pending >= budget:
        return budget
    return max(pending // 2, budget // 4)
