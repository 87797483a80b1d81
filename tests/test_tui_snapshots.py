"""SVG snapshots of the monitor at 120x40 with a frozen clock (pytest-textual-snapshot).

Update after an intended visual change with ``pytest tests/test_tui_snapshots.py
--snapshot-update`` and review the SVG diff; never edit the SVGs by hand.
"""

from __future__ import annotations

from test_tui_app import SIZE, T0, live_row, make_app


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


def test_paused_then_help(snap_compare) -> None:
    assert snap_compare(make_app([live_row()]), press=["p", "question_mark"], terminal_size=SIZE)


def test_narrow_terminal_stacks_the_panels(snap_compare) -> None:
    assert snap_compare(make_app([live_row()]), terminal_size=(80, 24))
