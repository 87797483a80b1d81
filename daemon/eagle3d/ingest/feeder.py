"""The feeder thread: streams the shard's dataset rows and tokenizes the pending ones.

Each row becomes a :class:`~eagle3d.core.sample.Sample` (or a ``Rejected`` one, with the
reason), handed to the daemon through ``put`` in dataset order, then ``Ended``. At most
``capacity`` items are handed over and not yet taken (:meth:`Feeder.taken`, the ledger's
``Taken`` effect): the thread blocks meanwhile, so a slow producer never makes it read the
whole dataset into memory. A slot is held by this thread, and an item crosses exactly once
or not at all (the daemon's inbox never drops what is put).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from eagle3d.core.sample import PENDING, Ended, Rejected, Sample

log = logging.getLogger("eagle3d")


class Feeder:
    """Feeds ``put`` from a thread; ``status`` says which rows are still pending."""

    def __init__(
        self,
        *,
        model: str,
        dataset: str,
        fmt: Any,
        shard_index: int,
        shard_count: int,
        status: bytearray,
        max_length: int,
        on_overflow: str,
        put: Callable[[Sample | Rejected | Ended], None],
        failed: Callable[[str, bool], None],
        capacity: int,
        pin: Any = None,
        max_line: int = 64 << 20,
        skip_to: tuple[int, int] | None = None,
        journal_dir: str = "",
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self.model = model
        self.journal_dir = journal_dir  # where the tokenizer is kept for the next start
        self.dataset = dataset
        self.fmt = fmt
        self.shard = (shard_index, shard_count)
        self.status = status
        self.max_length = max_length
        self.on_overflow = on_overflow
        self.put = put
        self.pin = pin  # the dataset as pinned at the start: rows are read through it
        self.max_line = max_line
        self.skip_to = skip_to  # (row, byte offset) of the first pending row: read from there
        self.failed = failed
        self._capacity = capacity
        self._room = threading.Semaphore(capacity)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="feeder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def widen(self, capacity: int) -> None:
        """Allow ``capacity`` items ahead if that is more than now (the window is known)."""
        for _ in range(capacity - self._capacity):
            self._room.release()
        self._capacity = max(self._capacity, capacity)

    def taken(self) -> None:
        """The daemon took one item: room for another."""
        self._room.release()

    def hand(self, item: Sample | Rejected | Ended, poll: float = 0.5) -> bool:
        """Hand ``item`` over once there is room; False, without it, once stopped."""
        while not self._stop.is_set():
            if self._room.acquire(timeout=poll):
                self.put(item)
                return True
        return False

    def _run(self) -> None:
        from eagle3d.ingest.pin import DatasetChanged

        try:
            self._feed()
        except DatasetChanged as e:  # not a failure of the feeder: the run must stop (exit 6)
            self.failed(str(e), True)
        except Exception as e:  # a dataset or tokenizer that fails mid-way stops the run
            log.exception("the feeder failed")
            self.failed(f"{type(e).__name__}: {e}", False)

    def _feed(self) -> None:
        from eagle3d.ingest.chat import encoder
        from eagle3d.ingest.dataformats import BadSample, iter_rows, parse_row, unit

        jdir = self.journal_dir
        kept = (jdir,) if jdir else ()
        enc = encoder(self.model, self.max_length, self.on_overflow, kept=kept, keep=jdir)
        status = self.status
        rows = iter_rows(self.dataset, self.fmt, *self.shard, self.pin, self.max_line, self.skip_to)
        for idx, raw in rows:
            if self._stop.is_set():
                return
            if idx >= len(status) or status[idx] != PENDING:
                continue  # saved, failed for good, or a blank line
            item: Sample | Rejected
            try:
                t = enc.encode(parse_row(idx, raw))
                item = Sample(
                    idx,
                    list(t.input_ids),
                    list(t.loss_mask),
                    bool(t.truncated),
                    full_length=int(t.full_length),
                    length_estimated=t.estimated,
                )
            except BadSample as bad:
                bad.unit = unit(self.fmt)
                item = Rejected(idx, bad.error, str(bad))
            if not self.hand(item):
                return
        self.hand(Ended())
