"""eagle3d.store.crc gives zlib's CRC-32 values, whole or continued, from any buffer."""

from __future__ import annotations

import os
import zlib

import numpy as np
from eagle3d.store import crc


def test_engine_is_isal_where_the_extra_is_installed() -> None:
    # The extract extra installs isal; a silent fallback to zlib would cost commit CPU.
    assert crc.ENGINE == "isal"


def test_values_equal_zlib_whole_and_continued() -> None:
    data = os.urandom(1 << 20) + b"tail"
    assert crc.crc32(data, 0) == zlib.crc32(data)
    head, rest = data[:12345], data[12345:]
    assert crc.crc32(rest, crc.crc32(head, 0)) == zlib.crc32(data)
    assert crc.crc32(b"", 0) == 0


def test_accepts_memoryviews_of_arrays() -> None:
    arr = np.arange(1000, dtype=np.float32)
    mv = memoryview(arr.view(np.uint8))
    assert crc.crc32(mv, 7) == zlib.crc32(arr.tobytes(), 7)
