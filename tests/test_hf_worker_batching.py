"""The HF worker's batch rule (:func:`eagle3d.producers.hf_worker.next_batch`), pure."""

from __future__ import annotations

import random

from eagle3d.producers.hf_worker import MIN_FILL, next_batch


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
