"""How many bytes a job writes, and whether they fit: the estimation core of ``eagle3d plan``
and of ``eagle3d run``'s check at start.

A sample file's size is known exactly from its token count: it is the archive
:mod:`eagle3d.remote.samplefile` lays out for the sample's tensors in the job's storage format (ids and
mask int64, the states in the stored dtype, fp8's scales, the zip's records, padded to
whole 4 KiB blocks), computed by the same code that lays out every commit
(:func:`file_bytes`). Beside the files the job writes its journal (about
:data:`JOURNAL_PER_SAMPLE` bytes per sample, plus :data:`JOURNAL_FIXED`) and directory
entries (:data:`DIRENT_PER_SAMPLE`).

When only a sample of the rows is tokenized, the total is the rows' count times the
sampled rows' mean size, and :class:`Tally` gives its 95 % bound from the sample's spread
(the normal approximation, with the finite-population correction: a full tokenization has
none). Pure but for :func:`free_space` (one ``statvfs``).
"""

from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass

from eagle3d.remote.storedtype import StoreFormat

#: Journal bytes per sample (its sent, dumped and saved records, measured on demo runs:
#: 127 KB for 297 samples with their stats records), and per job (a segment's header,
#: the 64 KiB reserve file beside it).
JOURNAL_PER_SAMPLE = 450
JOURNAL_FIXED = (64 << 10) + (4 << 10)
#: Directory entries: a sample's name in its row directory, the row directories.
DIRENT_PER_SAMPLE = 48
Z95 = 1.96
#: Rows tokenized by default: all up to this many, else a uniform random sample of it.
DEFAULT_SAMPLE = 20_000
#: Left free by default beside the job: the monitor counts less as a full disk.
DEFAULT_RESERVE = "256M"


@functools.lru_cache(maxsize=65536)
def file_bytes(tokens: int, hidden: int, n_layers: int, fmt: StoreFormat) -> int:
    """The exact size of the file of a ``tokens``-token sample in format ``fmt``."""
    from eagle3d.remote import samplefile as ckpt
    from eagle3d.remote.samplefile import fp8_spec, states_spec

    if fmt.scaled:
        spec = fp8_spec(tokens, hidden, n_layers)
    else:
        spec = states_spec(tokens, hidden, n_layers, fmt.torch_dtype)
    return ckpt.plan(spec).total


#: Bytes per element of a stored state, by the safetensors code of its dtype.
_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


def file_bytes_at_most(tokens: int, hidden: int, n_layers: int, fmt: StoreFormat) -> int:
    """A bound on :func:`file_bytes` that imports nothing (no torch): the start's space
    check runs before anything is written and before the workers start, and must not
    delay them by torch's import. Every tensor at its size, 8-byte ids and mask, fp8's
    scales as 4 bytes per token and state, and 64 KiB for the archive's own bytes."""
    item = _ITEMSIZE.get(fmt.safetensors, 4)
    per_token = 16 + (1 + n_layers) * hidden * item + (4 * (1 + n_layers) if fmt.scaled else 0)
    return tokens * per_token + (64 << 10)


def overhead_bytes(samples: int) -> int:
    """What the job writes beside its sample files for ``samples`` samples."""
    return samples * (JOURNAL_PER_SAMPLE + DIRENT_PER_SAMPLE)


@dataclass(slots=True)
class Tally:
    """The tokenized rows of one shard: how many, their sizes' sum and sum of squares (a
    row that the encoder refuses counts as a 0-byte, 0-token sample: it is never saved)."""

    rows: int = 0  # rows tokenized
    samples: int = 0  # of them, samples (the encoder took them)
    tokens: int = 0
    bytes: int = 0
    sq: float = 0.0  # sum of bytes squared
    refused: int = 0

    def add(self, tokens: int, nbytes: int) -> None:
        self.rows += 1
        if tokens <= 0:
            self.refused += 1
            return
        self.samples += 1
        self.tokens += tokens
        self.bytes += nbytes
        self.sq += float(nbytes) * nbytes


@dataclass(frozen=True, slots=True)
class Estimate:
    """A shard's remaining rows, scaled up from its tally: samples, tokens, file bytes and
    the 95 % bound on the file bytes (0 when every row was tokenized)."""

    rows: int
    samples: int
    tokens: int
    bytes: int
    bound: int

    @property
    def total(self) -> int:
        """Files plus what is written beside them."""
        return self.bytes + overhead_bytes(self.samples)


def scale(t: Tally, rows: int) -> Estimate:
    """The estimate for ``rows`` rows of which ``t`` tokenized a uniform sample."""
    if t.rows == 0 or rows == 0:
        return Estimate(rows, 0, 0, 0, 0)
    f = rows / t.rows
    bound = 0
    if t.rows < rows:
        mean = t.bytes / t.rows
        var = max(t.sq / t.rows - mean * mean, 0.0) * t.rows / max(t.rows - 1, 1)
        se = rows * math.sqrt(var / t.rows) * math.sqrt(1 - t.rows / rows)
        bound = math.ceil(Z95 * se)
    return Estimate(rows, round(t.samples * f), round(t.tokens * f), round(t.bytes * f), bound)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)i?b?\s*$", re.I)
_PCT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def parse_size(text: str, fs_total: int = 0) -> int:
    """Bytes of a size such as ``256M``, ``1.5T``, ``1073741824`` (powers of 1024), or
    ``2%`` of ``fs_total``. Raises ValueError naming the text."""
    m = _PCT.match(text)
    if m:
        return int(float(m.group(1)) / 100 * fs_total)
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"space_reserve: {text!r} is not a size (256M, 1G, 2%, bytes)")
    power = "kmgtp".find(m.group(2).lower()) + 1 if m.group(2) else 0
    return int(float(m.group(1)) * 1024**power)


@dataclass(frozen=True, slots=True)
class Disk:
    """The filesystem a path is (or will be) on."""

    path: str  # the path statted: the output, or its nearest existing parent
    free: int  # available to unprivileged users (df's "Avail")
    total: int


def free_space(path: str) -> Disk:
    """``statvfs`` of ``path``, or of its nearest existing parent when it does not exist
    yet. Raises OSError."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    st = os.statvfs(p)
    return Disk(p, st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)


def size(n: float) -> str:
    """``1.23 GB``: decimal units, as disks are sold and ``df -H`` shows."""
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"
