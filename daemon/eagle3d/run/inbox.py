"""The daemon's one way in: typed messages from every thread, handled on the loop thread.

Everything from outside the loop arrives here: the feeder's rows, the dump watcher's
arrivals, the producer's reports, the commit threads' outcomes, the recorder's journal
faults, every journal record to publish (the journal's listener), and signals. A message is
put from any thread and handled on the loop thread, in the order put; whatever is put while
the loop is busy is handled in one burst, with one wakeup of the loop (each wakeup of the
loop thread is CPU taken from a CPU producer beside it).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from eagle3d.core.outcome import AnyOutcome


class Fed(msgspec.Struct, tag=True):
    """The feeder's next item: a :class:`~eagle3d.core.sample.Sample`, a ``Rejected`` row,
    or ``Ended``."""

    item: Any


class DumpArrived(msgspec.Struct, tag=True):
    """A complete dump appeared in the dump area (the watcher, or its periodic scan)."""

    path: str


class RequestFailed(msgspec.Struct, tag=True):
    rid: str
    error: str
    message: str
    retryable: bool


class ProducerState(msgspec.Struct, tag=True):
    state: str  # up | down | restarting | waiting
    message: str


class RequestsStarted(msgspec.Struct, tag=True):
    rids: list[str]


class Committed(msgspec.Struct, tag=True):
    """A commit thread's batch: each sample with its outcome."""

    results: list[tuple[Any, AnyOutcome]]


class JournalFault(msgspec.Struct, tag=True):
    """The journal refused a record. ``pause``: an environment errno on a journal still
    open (the run pauses on it); otherwise nothing can cure it and the run stops."""

    errno: int
    message: str
    pause: bool


class Signalled(msgspec.Struct, tag=True):
    signum: int  # SIGTERM or SIGINT: stop


class Hangup(msgspec.Struct, tag=True):
    """SIGHUP: probe the paused areas now."""


class FeedFailed(msgspec.Struct, tag=True):
    """The feeder could not go on (its tokenizer, the dataset file); ``changed``: the
    dataset is not what the run pinned at its start (stop with exit 6)."""

    message: str
    changed: bool = False


class Inbox:
    """Messages put from any thread reach ``handle(messages)`` on the loop, in order
    (those put before :meth:`open` are handled once it is open)."""

    def __init__(self, handle: Callable[[list[object]], None]) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle = handle
        self._lock = threading.Lock()
        self._items: list[object] = []
        self._scheduled = False

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Handle messages on ``loop`` from now on."""
        with self._lock:
            self._loop = loop
            waiting = bool(self._items) and not self._scheduled
            self._scheduled = self._scheduled or waiting
        if waiting:
            loop.call_soon_threadsafe(self._drain)

    def put(self, msg: object) -> None:
        """Queue ``msg`` (any thread); a no-op once the loop is closed."""
        with self._lock:
            self._items.append(msg)
            if self._scheduled or self._loop is None:
                return
            self._scheduled = True
            loop = self._loop
        try:
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody is left to handle it
            with self._lock:
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        self._handle(items)


class ProducerPort:
    """The producer's callbacks (:class:`eagle3d.produce.base.ProducerEvents`) as messages."""

    def __init__(self, inbox: Inbox) -> None:
        self._put = inbox.put

    def request_failed(self, rid: str, error: str, message: str, retryable: bool) -> None:
        self._put(RequestFailed(rid, error, message, retryable))

    def producer_state(self, state: str, message: str = "") -> None:
        self._put(ProducerState(state, message))

    def requests_started(self, rids: list[str]) -> None:
        self._put(RequestsStarted(list(rids)))
