"""The producer seam's shared parts: the grace for dumps a producer wrote and nobody saw."""

from __future__ import annotations

from eagle3d.produce.base import DUMP_GRACE_S, DumpGrace


def test_a_written_dump_never_seen_is_late_once_after_the_grace() -> None:
    g = DumpGrace()
    g.written("lost", 100.0)
    assert g.late(100.0 + DUMP_GRACE_S) == []  # the grace itself is still on time
    assert g.late(100.0 + DUMP_GRACE_S + 0.1) == ["lost"]
    assert g.late(100.0 + 10 * DUMP_GRACE_S) == []  # reported once


def test_either_word_may_come_first() -> None:
    g = DumpGrace(grace=5.0)
    g.arrived("early", 0.0)  # the dump landed before the producer said so (the usual order)
    g.written("early", 1.0)
    g.written("later", 1.0)
    g.arrived("later", 2.0)
    assert g.awaiting == [] and g.arrived_early == []
    assert g.late(100.0) == []


def test_forgotten_requests_owe_nothing_and_stale_sightings_are_dropped() -> None:
    g = DumpGrace(grace=5.0)
    g.written("failed", 0.0)
    g.forget("failed")  # failed or cancelled after the producer's word
    g.arrived("orphan", 0.0)  # seen, never reported: its producer died first
    assert g.arrived_early == ["orphan"]
    assert g.late(6.0) == []
    assert g.arrived_early == []  # forgotten after the grace, so it cannot pile up
    g.written("orphan", 7.0)  # a report that comes after all is awaited afresh
    assert g.late(13.0) == ["orphan"]
