"""Write a sample file (:mod:`eagle3d.remote.samplefile`'s layout) to a descriptor: in one
``writev`` straight from the tensors' memory, or with direct I/O
(:func:`eagle3d.store.directio.write_direct`), gathered into a reused aligned buffer and
written from it to the device, bypassing the page cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

from eagle3d.remote.dumpfile import writev_all
from eagle3d.remote.samplefile import Written, build
from eagle3d.store.directio import DirectBuffer, write_direct

if TYPE_CHECKING:
    import torch


def write(fd: int, tensors: dict[str, torch.Tensor], direct: DirectBuffer | None = None) -> Written:
    """Write ``tensors`` (contiguous CPU tensors; see :func:`eagle3d.remote.samplefile.fits`)
    to ``fd`` as ``torch.save(tensors)`` would. Raises OSError (ENOSPC, EIO) as the write
    fails. With ``direct``, ``fd`` was opened with ``O_DIRECT``: see
    :func:`eagle3d.store.directio.write_direct`."""
    parts, written = build(tensors)
    if direct is None:
        writev_all(fd, parts)
    else:
        write_direct(fd, parts, written.nbytes, direct)
    return written
