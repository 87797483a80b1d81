"""Synthetic producer: dumps of the right shape, no model weights needed.

For sizing the commit path of a node ("can this disk keep up with the GPU?") and for the
pipeline benchmarks: the daemon validates and commits these dumps exactly as it does real
ones. Only the model's ``config.json`` (hidden size) and tokenizer are used.

By default dumps are written at memory speed. ``EAGLE3D_SYNTHETIC_LINK=1`` makes them cost
nothing: a request whose ids equal an earlier one's gets that dump's bytes, hard-linked under
its own name (its rid lives in the file name; the states are constant anyway), so a
benchmark of the commit path on a small machine does not spend half its CPU writing dumps
that a GPU node's server writes on cores of its own. ``EAGLE3D_SYNTHETIC_LATENCY_S`` models a
GPU server instead: requests are served in batches (up to ``EAGLE3D_SYNTHETIC_BATCH``, default 32),
each batch taking that many seconds however full it is, the way a prefill-bound server with
continuous batching behaves. ``EAGLE3D_SYNTHETIC_LAYOUT=safetensors`` writes v1 dumps
(:mod:`eagle3d.remote.dumpfile`) instead of the sample layout, for a benchmark's A/B. These
are benchmark knobs, not job settings.

Its dumps of the storage formats are made without torch (:func:`constant_dump`): the
daemon's process, where this producer runs, then imports no torch, as on a GPU node whose
producer is another process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import struct
import threading
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from eagle3proto.events import ProducerHealth

from eagle3d.core.sample import Request
from eagle3d.produce.base import Producer, ProducerEvents
from eagle3d.remote import samplefile, storedtype
from eagle3d.remote.dumpfile import dump_path, trailer, write_dump, write_parts
from eagle3d.remote.samplefile import fp8_spec, states_spec


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
        latency_s: float | None = None,
        batch: int | None = None,
    ) -> None:
        self.dump_dir = dump_dir
        self.hidden = hidden_size
        self.layers = aux_layers
        self.dtype = dtype
        env = os.environ
        self.latency = (
            float(env.get("EAGLE3D_SYNTHETIC_LATENCY_S", 0)) if latency_s is None else latency_s
        )
        self.batch = int(env.get("EAGLE3D_SYNTHETIC_BATCH", 32)) if batch is None else batch
        self.link = env.get("EAGLE3D_SYNTHETIC_LINK", "") == "1"
        self.layout = env.get("EAGLE3D_SYNTHETIC_LAYOUT", "sample")
        self._templates: dict[tuple[int, ...], str] = {}
        self._names = itertools.count()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="synthetic")
        self._window = window
        self._events: ProducerEvents | None = None
        self._done = 0
        self._t0 = time.monotonic()
        self._queue: list[Request] = []
        self._cond = threading.Condition()
        self._stopped = False
        self._server: threading.Thread | None = None
        self._cache: dict[int, tuple[Any, Any, Any]] = {}

    async def start(self, events: ProducerEvents | None = None) -> None:
        self._events = events
        if self.latency > 0:
            self._server = threading.Thread(
                target=self._serve, name="synthetic-server", daemon=True
            )
            self._server.start()
        if events is not None:
            events.producer_state("up", f"synthetic dumps, hidden {self.hidden}, {self.dtype}")

    def submit(self, request: Request) -> None:
        if self.latency <= 0:
            self._pool.submit(self._write, request)
            return
        with self._cond:
            self._queue.append(request)
            self._cond.notify()

    def _serve(self) -> None:
        """The modelled server: one batch per ``latency`` seconds, dumps written after it."""
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                batch, self._queue = self._queue[: self.batch], self._queue[self.batch :]
            time.sleep(self.latency)
            for r in batch:
                self._write(r)

    def _write(self, r: Request) -> None:
        key = tuple(r.input_ids)
        template = self._templates.get(key) if self.link else None
        if template is not None:
            final = dump_path(self.dump_dir, r.rid)
            os.link(template, final)  # the complete file under its final name, at once
            self._done += 1
            return
        parts = None
        if self.layout == "sample":
            parts = constant_dump(r.rid, r.input_ids, self.hidden, self.layers, self.dtype)
        if parts is not None:
            path = write_parts(self.dump_dir, r.rid, parts)
        else:
            path = self._write_with_torch(r)
        if self.link and key not in self._templates:
            # The daemon deletes the dump; a link of it under a name of its own stays.
            keep = os.path.join(
                os.path.dirname(path), f".template-{os.getpid()}-{next(self._names)}"
            )
            os.link(path, keep)
            with self._cond:
                self._templates.setdefault(key, keep)
        self._done += 1

    def _write_with_torch(self, r: Request) -> str:
        """The dump of a dtype :func:`constant_dump` does not know, made by torch."""
        import torch

        _one_intra_op_thread()
        ids = torch.tensor(r.input_ids, dtype=torch.int64)
        aux, hid, scales = self._states(len(r.input_ids))
        return write_dump(
            self.dump_dir, r.rid, ids, aux, hid, self.layers, scales, layout=self.layout
        )

    def _states(self, t: int) -> tuple[Any, Any, Any]:
        """Constant states of ``t`` tokens in the job's storage format (fp8's with their
        scales, as the HF workers dump them: :func:`storedtype.to_stored`), made once per
        length: a server's states arrive by DMA, not by a CPU filling them, so only the
        dump's own write is this producer's work."""
        import torch

        _one_intra_op_thread()

        hit = self._cache.get(t)
        if hit is None:
            name = self.dtype if self.dtype != "auto" else "float32"
            fmt = storedtype.FORMATS.get(name)
            dtype = torch.float32 if fmt is not None else getattr(torch, name)
            aux = torch.full((t, len(self.layers) * self.hidden), 0.5, dtype=dtype)
            hid = torch.full((t, self.hidden), 0.25, dtype=dtype)
            scales = None
            if fmt is not None:
                (aux, aux_s), (hid, hid_s) = (storedtype.to_stored(x, fmt) for x in (aux, hid))
                scales = (aux_s, hid_s) if aux_s is not None and hid_s is not None else None
            with self._cond:
                if len(self._cache) >= 16:  # a few lengths: a benchmark's, not a dataset's
                    self._cache.pop(next(iter(self._cache)))
                hit = self._cache[t] = (aux, hid, scales)
        return hit

    def window(self) -> int:
        return self._window

    def health(self) -> ProducerHealth:
        return ProducerHealth(
            name="synthetic",
            up=True,
            latency_s=self.latency,
            detail={"dumps": float(self._done), "uptime_s": time.monotonic() - self._t0},
        )

    async def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        await asyncio.to_thread(self._pool.shutdown, True)
        with self._cond:
            kept, self._templates = self._templates, {}
        for keep in kept.values():
            with contextlib.suppress(OSError):
                os.unlink(keep)


#: The synthetic states' bytes by storage format, without torch: aux 0.5 and hidden 0.25
#: (little-endian), and for fp8 what :func:`storedtype.to_stored` makes of them: every value
#: 448 (e4m3fn 0x7E) with a row's scale amax / 448 (hidden's, aux's: the records' order). A
#: test holds them to the torch path's.
CONSTANTS: dict[str, tuple[str, bytes, bytes, tuple[float, float] | None]] = {
    "float32": ("float32", struct.pack("<f", 0.5), struct.pack("<f", 0.25), None),
    "bfloat16": ("bfloat16", b"\x00\x3f", b"\x80\x3e", None),
    "float16": ("float16", b"\x00\x38", b"\x00\x34", None),
    "fp8": ("float8_e4m3fn", b"\x7e", b"\x7e", (0.25 / 448, 0.5 / 448)),
}


def constant_dump(
    rid: str, ids: list[int], hidden: int, layers: list[int], fmt: str
) -> list[bytes] | None:
    """The synthetic producer's v2 dump (:mod:`eagle3d.remote.dumpfile`) of ``ids``, made
    without torch (the states of :data:`CONSTANTS`); None for a format it lacks."""
    known = CONSTANTS.get("float32" if fmt == "auto" else fmt)
    if known is None:
        return None
    dtype, aux_value, hid_value, scales = known
    t, n = len(ids), len(layers)
    spec = fp8_spec(t, hidden, n) if scales else states_spec(t, hidden, n, dtype)
    plan = samplefile.plan(spec)
    end = trailer(rid, layers, dtype, t, hidden, True)
    if end is None:
        return None
    buf = bytearray(plan.total)
    mv = memoryview(buf)
    samplefile.fill(plan, mv)
    (ids_at, n_ids), _mask, (hid_at, n_hid), (aux_at, n_aux), *scale_slots = plan.slots
    mv[ids_at : ids_at + n_ids] = array("q", ids).tobytes()
    mv[hid_at : hid_at + n_hid] = hid_value * (n_hid // len(hid_value))
    mv[aux_at : aux_at + n_aux] = aux_value * (n_aux // len(aux_value))
    for (at, size), scale in zip(scale_slots, scales or (), strict=True):
        mv[at : at + size] = struct.pack("<f", scale) * t
    samplefile.seal(plan, mv)
    return [bytes(buf), end]


@functools.cache
def _one_intra_op_thread() -> None:
    """Give torch one intra-op thread, once: this producer runs inside the daemon's
    process, whose tensor work stays on one thread (OpenMP's spinning pool would take the
    cores the commits use; :meth:`eagle3d.store.committer.Committer._one_torch_thread`)."""
    import torch

    torch.set_num_threads(1)
