"""SVG snapshots of the monitor with a frozen clock (pytest-textual-snapshot).

Update after an intended visual change with ``pytest tests/test_tui_snapshots.py
--snapshot-update`` and review the SVG diff; never edit the SVGs by hand.
"""

from __future__ import annotations

from eagle3proto import events as ev
from eagle3proto import reducer
from test_tui_app import SIZE, T0, live_row, make_app


def _add(row, *events: ev.Event) -> None:  # type: ignore[no-untyped-def]
    s = row.state
    for e in events:
        e.seq, e.run = s.seq + 1, "r"
        reducer.apply(s, e)


def test_running_single_shard(snap_compare) -> None:
    assert snap_compare(make_app([live_row()]), terminal_size=SIZE)


def test_disconnected_with_last_known_numbers(snap_compare) -> None:
    row = live_row(with_gpus=False)
    row.conn, row.error, row.retry_at = (
        "disconnected",
        "socket /run/e.sock: Connection refused",
        T0 + 4,
    )
    assert snap_compare(make_app([row]), terminal_size=SIZE)


def test_stale_socket_and_disk_running_out(snap_compare) -> None:
    row = live_row(free=50 * 10**9)
    row.last_msg = T0 - 42
    assert snap_compare(make_app([row]), terminal_size=SIZE)


def test_fleet_of_three_shards(snap_compare) -> None:
    rows = [live_row(f"node{i} shard-{i}-of-3", saved=100 * (i + 1)) for i in range(3)]
    rows[2].alive, rows[2].conn, rows[2].source = False, "journal", "journal"
    assert snap_compare(make_app(rows), terminal_size=SIZE)


def test_frozen_screen_then_help(snap_compare) -> None:
    assert snap_compare(make_app([live_row()]), press=["p", "question_mark"], terminal_size=SIZE)


def test_narrow_terminal_keeps_the_verdict_and_counters_on_top(snap_compare) -> None:
    assert snap_compare(make_app([live_row()]), terminal_size=(80, 24))


def test_paused_on_a_full_disk_with_a_frozen_eta(snap_compare) -> None:
    row = live_row(free=100 << 20)
    _add(row, ev.RunState(ts=T0 - 20, state="paused", reason="disk full writing to /data/out"))
    assert snap_compare(make_app([row]), terminal_size=SIZE)


def test_loading_the_model(snap_compare) -> None:
    row = live_row(saved=0, failed=0)
    s = row.state
    assert s is not None
    s.state, s.state_reason, s.state_since, s.up_ts = (
        "loading",
        "loading model /models/Llama-3.1-70B (hf, device cuda)",
        T0 - 48,
        0.0,
    )
    assert snap_compare(make_app([row]), terminal_size=SIZE)


def test_producer_down_and_a_gpu_xid(snap_compare) -> None:
    row = live_row()
    assert row.state is not None and row.state.stats is not None
    g = row.state.stats.gpus[1]
    g.xid_errors, g.last_xid, g.last_xid_ts, g.ecc_errors = 1, 79, T0 - 90, 2
    g.throttle, g.power_limit_w = ["hw_slowdown"], 700.0
    _add(
        row,
        ev.ProducerEvent(
            ts=T0 - 75, state="down", message="http://10.0.0.5:30000 unreachable: ConnectError"
        ),
    )
    assert snap_compare(make_app([row]), terminal_size=SIZE)


def test_daemon_gone_shows_last_seen_readings(snap_compare) -> None:
    row = live_row()
    row.alive, row.conn, row.source = False, "journal", "journal"
    assert snap_compare(make_app([row]), terminal_size=(130, 42))
