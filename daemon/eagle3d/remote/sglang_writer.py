"""The capture hook's writer side: host tensors in, dump files out, on one background thread.

:class:`DumpAssembler` turns each request's rows of a captured forward into its dump,
assembling chunked prefills; :class:`Writer` drains a bounded queue of forwards into it.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from eagle3d.remote.sglang_rid import (
    Tag,
    describe_error,
    error_reason,
    failure_marker_name,
    ids_digest,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger("eagle3d.remote.sglang_hook")

# The writer side: host tensors in, dump files out (runs on the background thread).


@dataclass(slots=True)
class Segment:
    """One request's rows in a captured forward."""

    tag: Tag
    prefix: int  # tokens already in the KV cache before this forward
    offset: int  # first row in the host tensors
    length: int


@dataclass(slots=True)
class Batch:
    """One forward's capture, on its way to the writer."""

    segments: list[Segment]
    ids: torch.Tensor  # [n] int64, host
    aux: torch.Tensor  # [n, k*H], host
    hidden: torch.Tensor  # [n, H], host
    ready: Any = None  # a CUDA event to wait on, or None for host tensors
    # [n] bool, host: each row's states finite as stored (None: not checked yet)
    finite: torch.Tensor | None = None
    aux_scale: torch.Tensor | None = None  # [n, 1] float32, host: fp8 states' scales
    hidden_scale: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class _Rows:
    """One request's rows of one forward (a chunk of its prefill, or all of it)."""

    ids: torch.Tensor
    aux: torch.Tensor
    hidden: torch.Tensor
    finite: torch.Tensor | None
    aux_scale: torch.Tensor | None
    hidden_scale: torch.Tensor | None


@dataclass(slots=True)
class _Partial:
    filled: int
    parts: list[_Rows] = field(default_factory=list)


class DumpAssembler:
    """Turns segments into dumps; assembles chunked prefills; refuses partial states.

    Each request is handled on its own: a failure (a full dump area, say) loses that one dump,
    is logged with its errno and its request, and leaves a failure marker for the client; the
    other requests of the same forward, and other requests' unfinished chunked prefills, are
    untouched. Pure apart from the ``write`` callable (``eagle3d.remote.dumpfile.write_dump`` by default)
    and the markers, so it is tested directly.
    """

    def __init__(
        self,
        dump_dir: str,
        layers: list[int],
        *,
        write: Any = None,
        max_partials: int = 256,
        radix_cache: bool | None = None,
    ):
        from eagle3d.remote.dumpfile import write_dump

        self.dump_dir = dump_dir
        self.layers = list(layers)
        # 0644: the server may run as another user than the daemon that reads the dump;
        # who reaches it is the dump folder's mode (docs/sglang.md, "Who may read the dumps").
        self.write = write or functools.partial(write_dump, mode=0o644)
        self.max_partials = max_partials
        # Whether the server's radix (prefix) cache is on, when known: with it off, cached
        # tokens at the start of a request can only be an earlier chunk this writer lost.
        self.radix_cache = radix_cache
        self.partials: OrderedDict[str, _Partial] = OrderedDict()
        # Requests whose unfinished chunked prefill was dropped, and why (bounded).
        self.lost: OrderedDict[str, str] = OrderedDict()
        self.written = 0
        self.refused = 0
        self.failed = 0

    def feed(self, batch: Batch) -> None:
        for s in batch.segments:
            sl = slice(s.offset, s.offset + s.length)
            try:
                self._feed_one(s, _rows(batch, sl))
            except Exception as e:  # one request's failure loses its dump, not the batch's
                self._fail(s.tag, e)

    def lose(self, batch: Batch, e: BaseException) -> None:
        """The whole batch never reached the assembler (its device copy failed, say)."""
        for s in batch.segments:
            self._fail(s.tag, e)

    def _key(self, tag: Tag) -> str:
        return f"{tag.send}.{tag.rid}"

    def _fail(self, tag: Tag, e: BaseException) -> None:
        self.failed += 1
        key = self._key(tag)
        if self.partials.pop(key, None) is not None:
            self._mark_lost(key, describe_error(e))
        log.error(
            "eagle3d: the dump of request %s (send %d) was lost: %s (in %s); the client is "
            "told and resends it",
            tag.rid,
            tag.send,
            describe_error(e),
            self.dump_dir,
            exc_info=not isinstance(e, OSError),
        )
        self._marker(tag.rid, error_reason(e))

    def _marker(self, rid: str, reason: str) -> None:
        try:
            fd = os.open(
                os.path.join(self.dump_dir, failure_marker_name(rid, reason)),
                os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC,
                0o644,
            )
            os.close(fd)
        except OSError as e:  # the client still finds the dump missing after its grace
            log.error("eagle3d: could not leave a failure marker for %s: %s", rid, e)

    def _mark_lost(self, key: str, why: str) -> None:
        self.lost[key] = why
        while len(self.lost) > 4 * self.max_partials:
            self.lost.popitem(last=False)

    def _feed_one(self, s: Segment, rows: _Rows) -> None:
        key = self._key(s.tag)
        if s.prefix == 0:
            self.partials.pop(key, None)
            self.lost.pop(key, None)
            part = _Partial(0)
        else:
            found = self.partials.pop(key, None)
            if found is None or found.filled != s.prefix:
                self._refuse_cached(s, key, found)
                return
            part = found
        part.parts.append(rows)
        part.filled += s.length
        if part.filled < s.tag.length:  # chunked prefill: wait for the remaining chunks
            self.partials[key] = part
            while len(self.partials) > self.max_partials:
                old, _ = self.partials.popitem(last=False)
                self._mark_lost(old, f"more than {self.max_partials} unfinished chunked prefills")
                log.error("eagle3d: dropped the unfinished chunked prefill of %s", old)
            return
        self._finish(s.tag, part)

    def _refuse_cached(self, s: Segment, key: str, found: _Partial | None) -> None:
        """A forward of ``s`` starting at token ``s.prefix`` whose earlier tokens we lack."""
        self.refused += 1
        lost = self.lost.pop(key, None)
        if lost is not None or found is not None or self.radix_cache is False:
            if lost is not None:
                why = f"its earlier chunk(s) were dropped: {lost}"
            elif found is not None:
                why = (
                    f"its earlier chunks cover {found.filled} tokens, this one starts at {s.prefix}"
                )
            else:
                why = "its earlier chunk(s) never reached the writer (the radix cache is off)"
            log.error(
                "eagle3d: lost chunk of request %s (chunk at token %d of %d): %s; no dump "
                "written, the client resends it",
                s.tag.rid,
                s.prefix,
                s.tag.length,
                why,
            )
            self._marker(s.tag.rid, "LOST")
            return
        log.error(
            "eagle3d: request %s arrived with %d tokens already cached (a prefix cache hit): "
            "its states for those tokens were not computed, no dump written. Run SGLang with "
            "--disable-radix-cache.",
            s.tag.rid,
            s.prefix,
        )

    def _finish(self, tag: Tag, part: _Partial) -> None:
        ids, aux, hid = (_cat([getattr(r, k) for r in part.parts]) for k in _STATES)
        got = ids_digest(ids.tolist())
        if part.filled != tag.length or got != tag.digest:
            self.refused += 1
            log.error(
                "eagle3d: request %s ran %d ids hashing to %s; the client sent %d ids hashing "
                "to %s: no dump written",
                tag.rid,
                part.filled,
                got,
                tag.length,
                tag.digest,
            )
            return
        from eagle3d.remote import faults

        if faults.hit("hook_drop") is not None:
            log.warning("eagle3d: EAGLE3D_FAULT hook_drop: the dump of %s is dropped", tag.rid)
            return
        scales, finite = _scales(part.parts), _finite(part.parts)
        self.write(self.dump_dir, tag.rid, ids, aux, hid, self.layers, scales, finite=finite)
        self.written += 1


_STATES = ("ids", "aux", "hidden")


def _rows(batch: Batch, sl: slice) -> _Rows:
    """A segment's rows of a batch."""

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[sl]

    return _Rows(
        batch.ids[sl],
        batch.aux[sl],
        batch.hidden[sl],
        cut(batch.finite),
        cut(batch.aux_scale),
        cut(batch.hidden_scale),
    )


def _scales(parts: list[_Rows]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """fp8's scales of a request's rows, chunk after chunk (None: states not scaled)."""
    aux = [r.aux_scale for r in parts if r.aux_scale is not None]
    hid = [r.hidden_scale for r in parts if r.hidden_scale is not None]
    if len(aux) != len(parts) or len(hid) != len(parts):
        return None
    return _cat(aux), _cat(hid)


def _finite(parts: list[_Rows]) -> bool | None:
    """Whether every chunk's rows were checked finite on the device (None: one was not
    checked: the dump writer checks)."""
    checks = [r.finite for r in parts if r.finite is not None]
    if len(checks) != len(parts):
        return None
    return all(bool(c.all()) for c in checks)


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    import torch

    return torch.cat(ts) if len(ts) > 1 else ts[0]


class Writer:
    """One background thread draining a bounded queue of :class:`Batch` into an assembler."""

    def __init__(
        self, assembler: DumpAssembler, max_pending: int = 4, describe: Any = None
    ) -> None:
        self.assembler = assembler
        self.describe = describe  # () -> str: more for the closing log line
        self.queue: queue.Queue[Batch | None] = queue.Queue(maxsize=max(1, max_pending))
        self.errors = 0
        self.thread = threading.Thread(target=self._run, name="eagle3d-dump-writer", daemon=True)
        self.thread.start()
        # On a normal interpreter exit, finish what is queued (bounded) rather than lose dumps
        # of requests already answered.
        atexit.register(self._close_at_exit)

    def _close_at_exit(self) -> None:
        # A logging stream closed before us (a test runner's capture) must not print a
        # "Logging error" traceback for the closing line.
        raising, logging.raiseExceptions = logging.raiseExceptions, False
        try:
            self.close(30.0)
        finally:
            logging.raiseExceptions = raising

    def put(self, batch: Batch) -> None:
        self.queue.put(batch)  # blocks only when max_pending batches are waiting: back-pressure

    def close(self, timeout: float | None = None) -> None:
        if self.thread.is_alive():
            try:
                self.queue.put(None, timeout=timeout)
            except queue.Full:  # a writer stuck on a dead disk: give up, do not hang the exit
                log.error("eagle3d: dump writer stuck for %s s at exit; queued dumps lost", timeout)
                return
            self.thread.join(timeout)
            a = self.assembler
            log.info(
                "eagle3d: dump writer finished: %d written, %d lost, %d refused%s",
                a.written,
                a.failed,
                a.refused,
                f"; {self.describe()}" if self.describe else "",
            )

    def drain(self) -> None:
        """Wait until everything queued so far is written (tests, shutdown)."""
        self.queue.join()

    def _run(self) -> None:
        from eagle3d.remote.threadnames import name_this_thread

        name_this_thread("e3d-dump-writer")  # what top -H shows among the server's threads
        while True:
            batch = self.queue.get()
            try:
                if batch is None:
                    return
                try:
                    if batch.ready is not None:
                        batch.ready.synchronize()
                except Exception as e:  # the device copy failed: every dump of the batch
                    self.errors += 1
                    self.assembler.lose(batch, e)
                    continue
                self.assembler.feed(batch)  # isolates each request's write itself
            except Exception:  # a bug in the assembler: lose this batch, never the server
                self.errors += 1
                log.exception("eagle3d: writing the dumps of a forward failed")
            finally:
                self.queue.task_done()
