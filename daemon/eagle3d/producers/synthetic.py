"""Synthetic producer: dumps of the right shape at memory speed, no model weights needed.

For sizing the commit path of a node ("can this disk keep up with the GPU?") and for the
committed-MB/s benchmark: the daemon validates and commits these dumps exactly as it does real
ones. Only the model's ``config.json`` (hidden size) and tokenizer are used.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from eagle3proto.events import ProducerHealth

from ..dump import write_dump
from .base import Producer, ProducerEvents, Request


class SyntheticProducer(Producer):
    """Writes a constant-valued dump per request from a small thread pool."""

    name = "synthetic"

    def __init__(
        self,
        *,
        dump_dir: str,
        hidden_size: int,
        aux_layers: list[int],
        dtype: str = "bfloat16",
        threads: int = 2,
        window: int = 8,
    ) -> None:
        self.dump_dir = dump_dir
        self.hidden = hidden_size
        self.layers = aux_layers
        self.dtype = dtype
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="synthetic")
        self._window = window
        self._events: ProducerEvents | None = None
        self._done = 0
        self._t0 = time.monotonic()

    async def start(self, events: ProducerEvents) -> None:
        self._events = events
        events.producer_state("up", f"synthetic dumps, hidden {self.hidden}, {self.dtype}")

    def submit(self, request: Request) -> None:
        self._pool.submit(self._write, request)

    def _write(self, r: Request) -> None:
        import torch

        dtype = getattr(torch, "float32" if self.dtype == "auto" else self.dtype)
        t = len(r.input_ids)
        ids = torch.tensor(r.input_ids, dtype=torch.int64)
        aux = torch.full((t, len(self.layers) * self.hidden), 0.5, dtype=dtype)
        hid = torch.full((t, self.hidden), 0.25, dtype=dtype)
        write_dump(self.dump_dir, r.rid, ids, aux, hid, self.layers)
        self._done += 1

    def window(self) -> int:
        return self._window

    def health(self) -> ProducerHealth:
        return ProducerHealth(
            name="synthetic",
            up=True,
            detail={"dumps": float(self._done), "uptime_s": time.monotonic() - self._t0},
        )

    async def stop(self) -> None:
        await asyncio.to_thread(self._pool.shutdown, True)
