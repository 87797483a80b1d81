"""The health judgement and the exit-code policy, as pure functions of (rows, now)."""

from __future__ import annotations

import pytest
from eagle3proto import events as ev
from eagle3proto import reducer
from eagle3top.model import Row, health, worst
from eagle3top.report import CRITICAL, OK, UNKNOWN, WARNING, Report

NOW = 1_800_000_000.0


def state(events: list[ev.Event]) -> reducer.ShardState:
    s = reducer.new_state()
    for i, e in enumerate(events):
        e.seq = i
        reducer.apply(s, e)
    return s


def running(last_save_ago: float = 1.0, started_ago: float = 600.0, extra=()) -> reducer.ShardState:  # type: ignore[no-untyped-def]
    evs: list[ev.Event] = [ev.RunStarted(ts=NOW - started_ago, total=100)]
    evs.append(
        ev.SampleSaved(ts=NOW - last_save_ago, idx=0, path="p", bytes=10, tokens=1, checksum="")
    )
    evs.extend(extra)
    return state(evs)


def row(s: reducer.ShardState | None, alive: bool | None = True) -> Row:
    return Row(label="s0", state=s, alive=alive, conn="live")


@pytest.mark.parametrize(
    ("r", "word", "code"),
    [
        (row(running()), "running", OK),
        (row(running(last_save_ago=200)), "stalled", WARNING),  # also silent for 200 s
        (row(running(last_save_ago=200, extra=[ev.Stats(ts=NOW - 1)])), "stalled", WARNING),
        (
            row(running(extra=[ev.RunState(ts=NOW, state="paused", reason="disk full")])),
            "stalled",
            CRITICAL,
        ),
        (
            row(running(extra=[ev.RunState(ts=NOW, state="paused", reason="operator")])),
            "stalled",
            WARNING,
        ),
        (row(running(), alive=False), "down", CRITICAL),
        (
            row(running(extra=[ev.RunStopped(ts=NOW, reason="signal")]), alive=False),
            "stopped",
            WARNING,
        ),
        (
            row(running(extra=[ev.RunStopped(ts=NOW, reason="x", exit_code=4)]), alive=False),
            "stopped",
            CRITICAL,
        ),
        (row(running(extra=[ev.RunFinished(ts=NOW)]), alive=False), "finished", OK),
        (row(None), "unknown", UNKNOWN),
        (row(state([ev.RunStarted(ts=NOW - 5, total=10)])), "running", OK),
    ],
    ids=[
        "ok",
        "stalled",
        "stalled-but-alive",
        "paused-disk",
        "paused",
        "down",
        "stopped",
        "failed",
        "finished",
        "unknown",
        "just-started",
    ],
)
def test_health_and_exit_code(r: Row, word: str, code: int) -> None:
    assert health(r, NOW).state == word
    assert Report.judge([r], NOW).exit_code == code


def test_failures_rising_is_a_warning_only_while_recent() -> None:
    fail = ev.SampleFailed(ts=NOW - 60, idx=5, error="E")
    assert Report.judge([row(running(extra=[fail]))], NOW).exit_code == WARNING
    old = ev.SampleFailed(ts=NOW - 3600, idx=5, error="E")
    assert Report.judge([row(running(extra=[old]))], NOW).exit_code == OK
    retried = ev.SampleFailed(ts=NOW - 60, idx=5, error="E", retry=True)
    assert Report.judge([row(running(extra=[retried]))], NOW).exit_code == OK
    # A steady trickle (1 in 500) is not "rising"; 6 in 500 is.
    saves = [
        ev.SampleSaved(
            ts=NOW - 250 + i * 0.5, idx=100 + i, path="p", bytes=1, tokens=1, checksum=""
        )
        for i in range(499)
    ]
    one = row(running(extra=[*saves, fail]))
    assert Report.judge([one], NOW).exit_code == OK
    fails = [ev.SampleFailed(ts=NOW - 10, idx=900 + k, error="E") for k in range(6)]
    six = row(running(extra=[*saves, *fails]))
    r = Report.judge([six], NOW)
    assert r.exit_code == WARNING and "6 of the last 506 samples failed" in r.messages[0]


def test_severity_order_and_text() -> None:
    assert Report.judge([], NOW).exit_code == UNKNOWN
    down, unknown = row(running(), alive=False), row(None)
    assert Report.judge([unknown, row(running())], NOW).exit_code == UNKNOWN
    r = Report.judge([unknown, down], NOW)
    assert r.exit_code == CRITICAL
    assert str(r).splitlines()[0] == "CRITICAL"
    assert worst(["running", "finished"]) == "running"
    assert worst(["finished", "stopped"]) == "stopped"
    assert worst(["running", "down", "stalled"]) == "down"


def _finished(saved: int, failed: int, code: int) -> reducer.ShardState:
    evs: list[ev.Event] = [ev.RunStarted(ts=NOW - 60, total=saved + failed)]
    evs += [
        ev.SampleSaved(ts=NOW - 30, idx=i, path="p", bytes=10, tokens=1, checksum="")
        for i in range(saved)
    ]
    evs += [ev.SampleFailed(ts=NOW - 30, idx=saved + i, error="bad_json") for i in range(failed)]
    evs.append(ev.RunFinished(ts=NOW - 1, saved=saved, failed=failed, exit_code=code))
    return state(evs)


@pytest.mark.parametrize(
    ("s", "code", "needle"),
    [
        (_finished(0, 218, 9), CRITICAL, "finished with 218 of 218 samples failed (0 saved)"),
        (_finished(10, 3, 9), WARNING, "finished with 3 of 13 samples failed (10 saved)"),
        (_finished(297, 3, 0), OK, ""),
        (
            running(
                extra=[
                    ev.RunState(
                        ts=NOW,
                        state="paused",
                        reason="permission denied (EACCES) writing to the output /o",
                    )
                ]
            ),
            CRITICAL,
            "permission denied",
        ),
    ],
)
def test_finished_with_failures_and_unwritable_pauses(
    s: reducer.ShardState, code: int, needle: str
) -> None:
    rep = Report.judge([row(s, alive=s.state != "finished")], NOW)
    assert rep.exit_code == code, rep.messages
    assert not needle or any(needle in m for m in rep.messages), rep.messages


def test_percent_counts_saved_only() -> None:
    v = reducer.view(_finished(0, 218, 9), NOW)
    assert v.percent == 0.0 and v.failed == 218 and v.remaining == 0
