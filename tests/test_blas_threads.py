"""The daemon loads numpy with one BLAS thread (OpenBLAS's pool would only spin), and
leaves the environment of the processes it starts as the user set it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import os, sys
{load}
import numpy
threads = len(os.listdir("/proc/self/task"))
print(threads, "OPENBLAS_NUM_THREADS" in os.environ)
"""


def _probe(load: str, **env: str) -> tuple[int, bool]:
    base = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(load=load)],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return int(out[0]), out[1] == "True"


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS starts no pool on one core")
def test_the_daemon_loads_numpy_without_a_blas_pool_and_restores_the_environment() -> None:
    plain, _ = _probe("")
    assert plain > 1  # OpenBLAS's pool: what the daemon avoids
    ours, left_set = _probe(
        "from eagle3d.run.command import _numpy_with_one_blas_thread\n_numpy_with_one_blas_thread()"
    )
    assert ours == 1 and not left_set
    # The user's own setting stands.
    users, left_set = _probe(
        "from eagle3d.run.command import _numpy_with_one_blas_thread\n"
        "_numpy_with_one_blas_thread()",
        OPENBLAS_NUM_THREADS="2",
    )
    assert users == 2 and left_set
