"""The feeder-to-dispatcher hand-off: each item arrives exactly once, in order, bounded."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from eagle3d.handoff import Coalesced, Handoff


def _feed(h: Handoff[int], n: int, stop: threading.Event, sent: list[bool]) -> None:
    for i in range(n):
        sent.append(h.put(i, stop, poll=0.0005))


def test_every_item_arrives_once_in_order_while_puts_keep_timing_out() -> None:
    # Capacity 1, a poll far shorter than the consumer's work, and a loop kept busy between
    # gets as the dispatcher keeps it (journal append, pipe write): the thread's waits time
    # out again and again, each a chance to hand an item over twice. The replaced
    # run_coroutine_threadsafe-with-timeout put duplicated 340 of these 400 items.
    async def main() -> tuple[list[int], list[bool]]:
        h: Handoff[int] = Handoff(asyncio.get_running_loop(), 1)
        stop, sent = threading.Event(), []
        t = threading.Thread(target=_feed, args=(h, 400, stop, sent))
        t.start()
        got = []
        for _ in range(400):
            got.append(await h.get())
            time.sleep(0.001)  # synchronous work on the loop thread
            await asyncio.sleep(0)
            time.sleep(0.001)
        await asyncio.sleep(0.05)
        assert h.waiting() == 0  # nothing more came
        t.join(5)
        return got, sent

    got, sent = asyncio.run(main())
    assert got == list(range(400))
    assert sent == [True] * 400


def test_puts_block_at_capacity() -> None:
    async def main() -> int:
        h: Handoff[int] = Handoff(asyncio.get_running_loop(), 3)
        stop, sent = threading.Event(), []
        t = threading.Thread(target=_feed, args=(h, 10, stop, sent), daemon=True)
        t.start()
        await asyncio.sleep(0.3)
        waiting = h.waiting()
        stop.set()
        t.join(5)
        assert not t.is_alive()
        return waiting

    assert asyncio.run(main()) == 3


def test_stop_ends_a_blocked_put_without_handing_the_item_over() -> None:
    async def main() -> tuple[bool, float, int]:
        h: Handoff[str] = Handoff(asyncio.get_running_loop(), 1)
        stop = threading.Event()
        assert h.put("first", stop)
        result: list[bool] = []
        t0 = time.monotonic()
        t = threading.Thread(target=lambda: result.append(h.put("second", stop, poll=0.05)))
        t.start()
        await asyncio.sleep(0.2)
        stop.set()
        await asyncio.to_thread(t.join, 5)
        await asyncio.sleep(0.05)
        return result[0], time.monotonic() - t0, h.waiting()

    ok, took, waiting = asyncio.run(main())
    assert ok is False
    assert took < 2.0
    assert waiting == 1  # only "first"


def test_a_closed_loop_refuses_the_item() -> None:
    loop = asyncio.new_event_loop()
    h: Handoff[int] = Handoff(loop, 1)
    loop.close()
    assert h.put(1, threading.Event()) is False


def test_capacity_must_be_positive() -> None:
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError, match="capacity"):
            Handoff(loop, 0)
    finally:
        loop.close()


def test_coalesced_delivers_every_item_once_in_order_in_bursts() -> None:
    async def main() -> list[list[tuple[int, int]]]:
        loop = asyncio.get_running_loop()
        deliveries: list[list[tuple[int, int]]] = []
        c: Coalesced[tuple[int, int]] = Coalesced(loop, deliveries.append)
        lock = threading.Lock()  # puts in one global order, from four threads

        def put(k: int) -> None:
            for i in range(500):
                with lock:
                    c.put((k, i))

        threads = [threading.Thread(target=put, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()  # blocking the loop: every put happens while it cannot deliver
        await asyncio.sleep(0)
        return deliveries

    deliveries = asyncio.run(main())
    items = [x for d in deliveries for x in d]
    assert sorted(items) == sorted((k, i) for k in range(4) for i in range(500))
    for k in range(4):  # each thread's items in the order it put them
        assert [i for kk, i in items if kk == k] == list(range(500))
    assert len(deliveries) == 1  # the whole burst took one wakeup of the loop


def test_coalesced_put_after_the_loop_closed_is_a_no_op() -> None:
    loop = asyncio.new_event_loop()
    got: list[list[int]] = []
    c: Coalesced[int] = Coalesced(loop, got.append)
    loop.close()
    c.put(1)  # no exception: nobody is left to deliver to
    c.put(2)
    assert got == []
