"""The HF worker's batch rule (:func:`eagle3d.remote.hf_batching.next_batch`), pure."""

from __future__ import annotations

import random
import threading
import time

import msgspec
from eagle3d.remote import hf_protocol as pr
from eagle3d.remote.hf_batching import MIN_FILL, batch_budget, next_batch
from eagle3d.remote.hf_worker import Worker


def padded(lengths: dict[str, int], batch: list[str]) -> int:
    return len(batch) * max(lengths[r] for r in batch)


def test_empty_pool_gives_an_empty_batch() -> None:
    assert next_batch({}, 4096) == []


def test_the_oldest_request_is_always_in_the_batch_and_the_batch_fits() -> None:
    rng = random.Random(5)
    for _ in range(300):
        lengths = {
            f"r{i}": rng.choice([rng.randint(1, 60), rng.randint(200, 900)]) for i in range(40)
        }
        batch = next_batch(lengths, 2048)
        assert next(iter(lengths)) in batch
        assert len(set(batch)) == len(batch) and set(batch) <= set(lengths)
        assert padded(lengths, batch) <= 2048


def test_a_request_longer_than_the_budget_runs_alone() -> None:
    lengths = {"huge": 5000, "a": 10, "b": 12}
    assert next_batch(lengths, 4096) == ["huge"]
    # ... and it does not block the others once it is not the oldest
    assert "huge" not in next_batch({"a": 10, "huge": 5000, "b": 12}, 4096)


def test_neighbours_in_length_are_taken_not_the_shortest() -> None:
    # The oldest is 100 tokens long: its batch is the other 100s, not the 10s (which would
    # pad to 100 each) and not the 900 (which would pad everything to 900).
    lengths = {"old": 100, "s1": 10, "s2": 10, "m1": 100, "m2": 100, "m3": 100, "l": 900}
    assert sorted(next_batch(lengths, 400)) == ["m1", "m2", "m3", "old"]


def test_an_under_filled_batch_is_marked_down_against_a_fuller_one() -> None:
    # Alone, the 300-token request wastes nothing but fills 300/4096 of the budget; with some
    # of the 250s it pads a little and fills at least MIN_FILL of it: that batch wins.
    lengths = {"old": 300, **{f"x{i}": 250 for i in range(12)}}
    batch = next_batch(lengths, 4096)
    assert "old" in batch and len(batch) > 1
    assert padded(lengths, batch) >= MIN_FILL * 4096


def test_nothing_starves_while_short_requests_keep_arriving() -> None:
    # A stream of short requests with an occasional long one: every request is served within
    # a few batches of its arrival (the oldest always goes next), and the batches stay dense.
    rng = random.Random(1)
    pool: dict[str, int] = {}
    arrived: dict[str, int] = {}
    waits = []
    real = pad = 0
    n = 0
    for step in range(400):
        while len(pool) < 64:
            rid = f"r{n}"
            pool[rid] = rng.randint(700, 900) if n % 17 == 0 else rng.randint(20, 200)
            arrived[rid] = step
            n += 1
        batch = next_batch(pool, 4096)
        real += sum(pool[r] for r in batch)
        pad += padded(pool, batch)
        for r in batch:
            waits.append(step - arrived[r])
            del pool[r]
    assert max(waits) <= 40
    assert real / pad > 0.75


def test_the_last_work_of_a_queue_goes_in_two_lighter_batches() -> None:
    assert batch_budget(10_000, 4096) == 4096  # a queue the daemon keeps full: the budget
    assert batch_budget(4096, 4096) == 4096
    assert batch_budget(3000, 4096) == 1500  # all of it fits in one batch: about half
    assert batch_budget(1200, 4096) == 1024  # never under a quarter of the budget
    assert batch_budget(300, 4096) == 1024  # so a small remainder stays one batch
    # What the half budget does to a drained queue of mixed lengths: two batches of
    # neighbours in length instead of one padded to the longest.
    lengths = {f"r{i}": n for i, n in enumerate([100, 700, 120, 650, 110, 680])}
    first = next_batch(lengths, batch_budget(sum(lengths.values()), 4096))
    assert sorted(lengths[r] for r in first) == [100, 110, 120]


def _to_worker(d: dict[str, object]) -> pr.ToWorker:
    """A message from the daemon, typed as the worker's reader decodes it off the pipe."""
    return msgspec.convert(d, pr.ToWorker)  # type: ignore[arg-type]


def _bare_worker(budget: int) -> Worker:
    """A Worker with its queue and nothing else (no model): for :meth:`Worker.next_rids`."""
    w = Worker.__new__(Worker)
    w.cond = threading.Condition()
    w.pending = {}
    w.alone = set()
    w.closed = False
    w.budget = budget
    return w


def _later(w: Worker, rid: str, delay: float) -> threading.Thread:
    def put() -> None:
        time.sleep(delay)
        w.receive(_to_worker({"op": "req", "rid": rid, "ids": [1] * 50}))

    t = threading.Thread(target=put)
    t.start()
    return t


def test_only_a_worker_that_waited_for_work_lingers_for_more() -> None:
    # Idle, then a request: the burst it starts is waited for (up to the linger), so the
    # second request, 0.2 s later, joins the batch (the budget of 100 then ends the wait).
    w = _bare_worker(100)
    threads = [_later(w, "a", 0.05), _later(w, "b", 0.25)]
    assert w.next_rids(linger=30.0) == (["a", "b"], [[1] * 50, [1] * 50])
    # Work already waiting (a batch just ended): no lingering; "d" comes too late to join.
    w.pending["c"] = [1] * 50
    t = _later(w, "d", 0.25)
    assert w.next_rids(linger=30.0) == (["c"], [[1] * 50])
    for th in [*threads, t]:
        th.join()
    assert list(w.pending) == ["d"]
    w.receive(_to_worker({"op": "stop"}))
    assert w.next_rids() is None  # stopped: no batch, even with work waiting


def test_a_request_marked_alone_is_a_batch_of_its_own() -> None:
    """A request the daemon marks ``alone`` (a worker died computing it among others) is
    computed in a batch of its own; the rest batch as before."""
    w = _bare_worker(budget=1000)
    for rid, alone in (("a", False), ("b", True), ("c", False)):
        w.receive(_to_worker({"op": "req", "rid": rid, "ids": [1] * 50, "alone": alone}))
    assert w.next_rids(linger=0) == (["b"], [[1] * 50])
    batch = w.next_rids(linger=0)
    assert batch is not None and sorted(batch[0]) == ["a", "c"]
