"""A batch's states to the host: in the stored format, into pinned memory, off the forward.

On a GPU the worker puts a batch's states in the job's storage format where they are
(:func:`eagle3d.remote.storedtype.to_stored`: half the bytes over PCIe for bfloat16 from
float32, a quarter for fp8, whose quantization then costs the daemon nothing), and
:meth:`HostCopy.start` queues their copy into pinned host buffers on a stream of its own,
behind an event recorded after the forward: the next batch's forward is queued at once
and runs while the copy does, and only the dump writer waits for the copy
(:meth:`Pending.wait`) before it touches the bytes. On a CPU device the same calls run:
the states are already on the host, :meth:`HostCopy.start` hands them over as they are and
:meth:`Pending.wait` returns at once (the CPU worker puts each sample in the stored format
in its dump writer instead, so that the padding is never converted).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class Pending:
    """Host tensors whose copy may still be running; :meth:`wait` before reading them."""

    def __init__(self, tensors: list[torch.Tensor], done: Any = None) -> None:
        self.tensors = tensors
        self._done = done

    def wait(self) -> list[torch.Tensor]:
        """The host tensors, once their copy is complete."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return self.tensors


class HostCopy:
    """Copies tensors of ``device`` to the host, asynchronously on a CUDA device."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch = torch
        self.cuda = torch.device(device).type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.copies = 0  # device-to-host copies queued (0 on a CPU device: none are made)

    def start(self, tensors: list[torch.Tensor]) -> Pending:
        """Queue the copy of ``tensors`` to pinned host memory behind what the current
        stream has queued so far (the forward, the casts); return at once."""
        if not self.cuda or self.stream is None:
            return Pending([t if t.device.type == "cpu" else t.cpu() for t in tensors])
        torch = self.torch
        ready = torch.cuda.Event()
        ready.record()
        hosts = []
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for t in tensors:
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                # The caching allocator must not hand t's memory to the next forward
                # before this stream has read it.
                t.record_stream(self.stream)
                hosts.append(h)
                self.copies += 1
            done = torch.cuda.Event()
            done.record(self.stream)
        return Pending(hosts, done)
