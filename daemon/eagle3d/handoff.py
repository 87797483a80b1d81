"""A bounded hand-off of items from one thread to an asyncio loop (the feeder to the dispatcher).

The feeder thread tokenizes the dataset and must block when the dispatcher is behind; the
dispatcher awaits items on the loop. Capacity is a :class:`threading.Semaphore` held by the
thread, and an item crosses with ``call_soon_threadsafe``, so a put either happens once or not
at all. The obvious alternative, ``run_coroutine_threadsafe(queue.put(item))`` with a timeout
and a retry, is wrong: when the timeout fires just after the put completed but before its
result reached the thread, the cancel succeeds, the retry puts the item a second time, and the
daemon sent the same sample twice (seen in the systemd end-to-end test: the run never ended).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Handoff(Generic[T]):
    """At most ``capacity`` items waiting; :meth:`put` from a thread, :meth:`get` on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self._loop = loop
        self._room = threading.Semaphore(capacity)
        self._items: asyncio.Queue[T] = asyncio.Queue()

    def put(self, item: T, stop: threading.Event, poll: float = 0.5) -> bool:
        """Block until there is room, then hand ``item`` over exactly once.

        Returns False, without handing it over, once ``stop`` is set (checked every ``poll``
        seconds while waiting) or when the loop is closed.
        """
        while not stop.is_set():
            if not self._room.acquire(timeout=poll):
                continue
            try:
                self._loop.call_soon_threadsafe(self._items.put_nowait, item)
            except RuntimeError:  # the loop is closed: the run is over
                return False
            return True
        return False

    async def get(self) -> T:
        """The next item, in the order they were put; frees one place for the thread."""
        item = await self._items.get()
        self._room.release()
        return item

    def waiting(self) -> int:
        """Items handed over and not yet taken (call on the loop thread)."""
        return self._items.qsize()


class Coalesced(Generic[T]):
    """Items put from any thread reach ``deliver(items)`` on the loop, in the order put, with
    one wakeup of the loop for whatever was put meanwhile rather than one per item.

    Bursts are the rule here (a producer's batch of dumps lands at once, a commit batch
    publishes its records at once), and each ``call_soon_threadsafe`` wakes the loop thread:
    on a CPU producer that is CPU taken from the forward beside it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[list[T]], None]):
        self._loop = loop
        self._deliver = deliver
        self._lock = threading.Lock()
        self._items: list[T] = []
        self._scheduled = False

    def put(self, item: T) -> None:
        """Queue ``item`` (any thread); a no-op once the loop is closed."""
        with self._lock:
            self._items.append(item)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody is left to deliver to
            with self._lock:
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        self._deliver(items)
