"""The daemon's one way in: typed messages from every thread, handled on the loop thread.

Everything from outside the loop arrives here: the feeder's rows, the dump watcher's
arrivals, the producer's reports, the commit threads' outcomes, the recorder's journal
faults, every journal record to publish (the journal's listener), and signals. A message is
put from any thread and handled on the loop thread, in the order put; whatever is put while
the loop is busy is handled in one burst, with one wakeup of the loop (each wakeup of the
loop thread is CPU taken from a CPU producer beside it). Every message is typed: the union
:data:`InboxMsg`, which :meth:`eagle3d.run.pipeline.Pipeline.dispatch` matches exhaustively.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeAlias

import msgspec
from eagle3proto import events as ev

from eagle3d.core import messages as m
from eagle3d.core.messages import Committed, Fed, FeedFailed

__all__ = [
    "Committed",
    "DumpArrived",
    "Fed",
    "FeedFailed",
    "Inbox",
    "InboxMsg",
    "JournalFault",
    "ProducerPort",
    "Signalled",
]


class DumpArrived(msgspec.Struct, tag=True, frozen=True):
    """A complete dump appeared in the dump area (the watcher, or its periodic scan)."""

    path: str


class JournalFault(msgspec.Struct, tag=True, frozen=True):
    """The journal refused a record. ``pause``: an environment errno on a journal still
    open (the run pauses on it); otherwise nothing can cure it and the run stops."""

    errno: int
    message: str
    pause: bool


class Signalled(msgspec.Struct, tag=True, frozen=True):
    signum: int  # SIGTERM or SIGINT: stop


#: Everything the inbox carries: the ledger's own messages (from the feeder, the producer,
#: the commit threads, the daemon's start), what the shell must look at first (a dump's
#: size, the journal's fault, a signal's name), and every journal record to publish.
InboxMsg: TypeAlias = m.Msg | DumpArrived | JournalFault | Signalled | ev.Event


class Inbox:
    """Messages put from any thread reach ``handle(messages)`` on the loop, in order
    (those put before :meth:`open` are handled once it is open)."""

    def __init__(self, handle: Callable[[list[InboxMsg]], None]) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle = handle
        self._lock = threading.Lock()
        self._items: list[InboxMsg] = []
        self._scheduled = False

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Handle messages on ``loop`` from now on."""
        with self._lock:
            self._loop = loop
            waiting = bool(self._items) and not self._scheduled
            self._scheduled = self._scheduled or waiting
        if waiting:
            loop.call_soon_threadsafe(self._drain)

    def put(self, msg: InboxMsg) -> None:
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
        self._put(m.RequestFailed(rid, error, message, retryable))

    def producer_state(self, state: str, message: str = "") -> None:
        self._put(m.ProducerReport(state, message))

    def requests_started(self, rids: list[str]) -> None:
        self._put(m.Started(list(rids)))
