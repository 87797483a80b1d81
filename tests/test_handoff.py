"""The feeder-to-loop hand-off and the inbox: each item arrives exactly once, in order,
bounded by the feeder's slots; bursts reach the loop with one wakeup."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from eagle3d.ingest.feeder import Feeder
from eagle3d.run.inbox import Fed, Inbox


def _feeder(capacity: int, put: object) -> Feeder:
    return Feeder(
        model="unused",
        dataset="unused",
        fmt=None,
        shard_index=0,
        shard_count=1,
        status=bytearray(),
        max_length=16,
        on_overflow="truncate",
        put=put,  # type: ignore[arg-type]
        failed=lambda why: None,
        capacity=capacity,
    )


def _feed(f: Feeder, items: list[object], sent: list[bool], poll: float = 0.0005) -> None:
    for i in items:
        sent.append(f.hand(i, poll=poll))  # type: ignore[arg-type]


def _wire(capacity: int, take: bool, work: float = 0.0) -> tuple[Feeder, Inbox, list[object]]:
    """A feeder whose items cross the inbox to the loop; ``take``: the loop frees a slot per
    item (the ledger's ``Taken``), after ``work`` seconds of synchronous work."""
    got: list[object] = []
    feeder: Feeder | None = None

    def handle(msgs: list[object]) -> None:
        for m in msgs:
            assert isinstance(m, Fed)
            got.append(m.item)
            if work:
                time.sleep(work)  # the loop thread busy (journal append, pipe write)
            if take:
                assert feeder is not None
                feeder.taken()

    inbox = Inbox(handle)
    feeder = _feeder(capacity, lambda item: inbox.put(Fed(item)))
    return feeder, inbox, got


async def _until(cond: object, timeout: float = 10.0) -> None:
    t0 = time.monotonic()
    while not cond() and time.monotonic() - t0 < timeout:  # type: ignore[operator]
        await asyncio.sleep(0.001)


def test_every_item_arrives_once_in_order_while_puts_keep_timing_out() -> None:
    # Capacity 1, a poll far shorter than the consumer's work, and a loop kept busy between
    # items as the daemon keeps it: the thread's waits time out again and again, each a
    # chance to hand an item over twice (a run_coroutine_threadsafe-with-timeout put
    # duplicated 340 of these 400 items).
    async def main() -> tuple[list[object], list[bool]]:
        feeder, inbox, got = _wire(1, take=True, work=0.001)
        inbox.open(asyncio.get_running_loop())
        sent: list[bool] = []
        t = threading.Thread(target=_feed, args=(feeder, list(range(400)), sent))
        t.start()
        await _until(lambda: len(got) >= 400)
        await asyncio.sleep(0.05)
        await asyncio.to_thread(t.join, 5)
        return got, sent

    got, sent = asyncio.run(main())
    assert got == list(range(400))  # nothing more came, nothing twice
    assert sent == [True] * 400


def test_puts_block_at_capacity() -> None:
    async def main() -> int:
        feeder, inbox, got = _wire(3, take=False)
        inbox.open(asyncio.get_running_loop())
        sent: list[bool] = []
        t = threading.Thread(target=_feed, args=(feeder, list(range(10)), sent), daemon=True)
        t.start()
        await _until(lambda: len(got) >= 3)  # then the fourth waits: nothing frees a slot
        waiting = len(got)
        feeder.stop()
        await asyncio.to_thread(t.join, 5)
        assert not t.is_alive()
        assert sent == [True] * 3 + [False] * 7  # the fourth waited, and none went after the stop
        return waiting

    assert asyncio.run(main()) == 3


def test_widen_makes_room_for_the_window() -> None:
    async def main() -> int:
        feeder, inbox, got = _wire(2, take=False)
        inbox.open(asyncio.get_running_loop())
        sent: list[bool] = []
        t = threading.Thread(target=_feed, args=(feeder, list(range(10)), sent), daemon=True)
        t.start()
        await _until(lambda: len(got) >= 2)
        feeder.widen(5)
        feeder.widen(3)  # narrower than now: no change
        await _until(lambda: len(got) >= 5)
        feeder.stop()
        await asyncio.to_thread(t.join, 5)
        return len(got)

    assert asyncio.run(main()) == 5


def test_stop_ends_a_blocked_put_without_handing_the_item_over() -> None:
    async def main() -> tuple[bool, float, list[object]]:
        feeder, inbox, got = _wire(1, take=False)
        inbox.open(asyncio.get_running_loop())
        assert feeder.hand("first")  # type: ignore[arg-type]
        result: list[bool] = []
        t0 = time.monotonic()
        t = threading.Thread(target=lambda: result.append(feeder.hand("second", poll=0.05)))  # type: ignore[arg-type]
        t.start()
        await asyncio.sleep(0.2)
        feeder.stop()
        await asyncio.to_thread(t.join, 5)
        await asyncio.sleep(0.05)
        return result[0], time.monotonic() - t0, got

    ok, took, got = asyncio.run(main())
    assert ok is False
    assert took < 2.0
    assert got == ["first"]


def test_a_closed_loop_takes_no_message_and_raises_nothing() -> None:
    loop = asyncio.new_event_loop()
    got: list[list[object]] = []
    inbox = Inbox(got.append)
    inbox.open(loop)
    loop.close()
    inbox.put(1)  # no exception: nobody is left to handle it
    inbox.put(2)
    assert got == []


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        _feeder(0, lambda item: None)


def test_the_inbox_delivers_every_message_once_in_order_in_bursts() -> None:
    async def main() -> list[list[object]]:
        deliveries: list[list[object]] = []
        inbox = Inbox(deliveries.append)
        inbox.open(asyncio.get_running_loop())
        lock = threading.Lock()  # puts in one global order, from four threads

        def put(k: int) -> None:
            for i in range(500):
                with lock:
                    inbox.put((k, i))

        threads = [threading.Thread(target=put, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()  # blocking the loop: every put happens while it cannot deliver
        await asyncio.sleep(0)
        return deliveries

    deliveries = asyncio.run(main())
    items = [x for d in deliveries for x in d]
    assert sorted(items) == sorted((k, i) for k in range(4) for i in range(500))  # type: ignore[type-var]
    for k in range(4):  # each thread's messages in the order it put them
        assert [i for kk, i in items if kk == k] == list(range(500))  # type: ignore[misc]
    assert len(deliveries) == 1  # the whole burst took one wakeup of the loop


def test_messages_put_before_the_inbox_opens_are_handled_once_it_does() -> None:
    async def main() -> list[list[object]]:
        deliveries: list[list[object]] = []
        inbox = Inbox(deliveries.append)
        inbox.put("early")  # a signal during the journal replay, say
        inbox.put("early too")
        await asyncio.sleep(0.01)
        assert deliveries == []
        inbox.open(asyncio.get_running_loop())
        inbox.put("after")
        await asyncio.sleep(0.01)
        return deliveries

    assert [x for d in asyncio.run(main()) for x in d] == ["early", "early too", "after"]
