"""Reducer tests: golden journals (tests/data/golden/) against hand-written snapshots, with a
frozen clock, plus the pure rate/ETA functions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from eagle3proto import reducer, views
from eagle3proto.journalread import replay
from eagle3proto.reducer import Bucket
from eagle3proto.views import eta_seconds, rates, sparkline

GOLDEN = Path(__file__).parent / "data" / "golden"
NAMES = sorted(p.name.removesuffix(".expected.json") for p in GOLDEN.glob("*.expected.json"))


def fold(name: str) -> tuple[reducer.ShardState, list[str]]:
    state = reducer.new_state()
    rep = replay(str(GOLDEN / name), lambda batch: reducer.apply_all(state, batch))
    return state, [p.reason for p in rep.problems]


@pytest.mark.parametrize("name", NAMES)
def test_golden_journal_snapshot(name: str) -> None:
    expected = json.loads((GOLDEN / f"{name}.expected.json").read_text())
    state, problems = fold(name)
    assert problems == expected["problems"]
    v = views.view(state, expected["now"])
    for key, want in expected["view"].items():
        got = getattr(v, key)
        if isinstance(want, float) and got is not None:
            assert got == pytest.approx(want), key
        else:
            assert got == want, key
    for which in ("rate", "rate_1m"):
        for key, want in expected.get(which, {}).items():
            assert getattr(getattr(v, which), key) == pytest.approx(want), f"{which}.{key}"
    assert len(state.errors) == expected["errors"]
    if "unknown_kinds" in expected:
        assert state.unknown_kinds == expected["unknown_kinds"]


def test_golden_set_is_complete() -> None:
    assert {"pipeline", "resume", "failures", "rates", "unknown_kind", "torn"} <= set(NAMES)


def test_snapshot_roundtrip_then_fold_equals_full_fold() -> None:
    """The socket protocol: a subscriber decodes a snapshot and folds the rest onto it."""
    full, _ = fold("resume")
    from eagle3proto.journalread import iter_events

    events, _ = iter_events(str(GOLDEN / "resume"))
    head = reducer.apply_all(reducer.new_state(), events[:7])
    tail_state = reducer.decode_state(reducer.encode_state(head))
    reducer.apply_all(tail_state, events[7:])
    assert reducer.encode_state(tail_state) == reducer.encode_state(full)


def test_time_is_an_argument() -> None:
    state, _ = fold("rates")
    a = views.view(state, 160.0)
    b = views.view(state, 160.0)
    assert a == b
    later = views.view(state, 400.0)  # five minutes of silence later
    assert later.rate.samples_s == 0.0 and later.eta_s is None
    assert later.age_s == pytest.approx(240.5)


def test_rates_ignore_time_before_the_session() -> None:
    hist = [Bucket(t, samples=2, tokens=20, bytes=200) for t in range(1000, 1005)]
    r = rates(hist, now=1005.0, window=60.0, since=1000.0)
    assert r.samples_s == pytest.approx(2.0)
    assert rates(hist, now=1000.5, window=60.0, since=1000.0).samples_s == 0.0  # < 1 s of data


def test_eta() -> None:
    assert eta_seconds(0, 0.0) == 0.0
    assert eta_seconds(10, 0.0) is None
    assert eta_seconds(10, 2.0) == 5.0


def test_sparkline_places_values_by_second() -> None:
    hist = [Bucket(100, samples=3), Bucket(102, samples=5)]
    assert sparkline(hist, now=103.2, seconds=4) == [3, 0, 5, 0]


def test_combine_shards() -> None:
    a, _ = fold("rates")
    b, _ = fold("pipeline")
    va, vb = views.view(a, 160.0, "s0"), views.view(b, 160.0, "s1")
    t = views.combine([va, vb])
    assert t.saved == 63 and t.total == 125 and t.in_flight == 1
    assert t.rate_1m.samples_s == pytest.approx(va.rate_1m.samples_s + vb.rate_1m.samples_s)
    assert t.remaining == 62
