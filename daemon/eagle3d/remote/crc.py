"""CRC-32 (zlib's polynomial and values) at memory speed when ISA-L is installed.

Every committed byte passes through CRC-32 twice in a sample's life: the zip records of the
sample file carry it (``torch.load`` checks them), and ``eagle3d verify`` recomputes the
whole file's. zlib's table-driven CRC runs at 2-5 GB/s here and was a tenth of the daemon's
CPU during a run; ISA-L's (carry-less multiply) gives the same numbers an order of magnitude
faster. Without the ``isal`` package, zlib's is used: same results, only slower.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

crc32: Callable[[Any, int], int]
try:
    from isal.isal_zlib import crc32 as _isal_crc32
except ImportError:  # pragma: no cover - the extract extra installs isal
    crc32 = zlib.crc32
    ENGINE = "zlib"
else:
    crc32 = _isal_crc32
    ENGINE = "isal"
