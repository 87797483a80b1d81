"""The fault-injection switchboard (``EAGLE3D_FAULT``), pure."""

from __future__ import annotations

import pytest
from eagle3d.remote import faults


def test_specs_parse_into_faults() -> None:
    got = faults.parse("kill:after_rename:3, worker_slow:300,bad_dump:nan@/tmp/m")
    assert got["kill:after_rename"].n == 3
    assert got["worker_slow"].n == 300
    assert (got["bad_dump"].arg, got["bad_dump"].n, got["bad_dump"].marker) == ("nan", 1, "/tmp/m")


@pytest.mark.parametrize("spec", ["kill:nowhere", "bad_dump:purple", "gremlins:1"])
def test_unknown_specs_are_refused_by_name(spec: str) -> None:
    with pytest.raises(ValueError, match="EAGLE3D_FAULT"):
        faults.parse(spec)


def test_hit_fires_on_the_nth_time_and_armed_counts_nothing(monkeypatch) -> None:
    monkeypatch.setattr(faults, "_faults", faults.parse("worker_exit:2,worker_slow:50"))
    assert faults.armed("worker_slow") is not None and faults.armed("worker_hang") is None
    assert faults.armed("worker_slow").seen == 0  # type: ignore[union-attr]
    assert faults.hit("worker_exit") is None
    assert faults.hit("worker_exit") is not None
    assert faults.hit("worker_exit") is None  # once only
