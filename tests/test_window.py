"""The daemon's window with a producer that says when it starts a batch (the HF worker).

Requests the worker has started computing no longer count against the window, so the daemon
sends their replacements while the batch runs and the worker's batcher chooses from a full
window, as the bare forward loop of the benchmark does (before, the pool was short by the
running batch and the demo set's batches held 70 % real tokens instead of 78 %).
"""

from __future__ import annotations

from pathlib import Path

import runkit


def test_started_requests_are_replaced_while_their_batch_runs(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    valid, malformed = runkit.dataset(data, 40, malformed=False)
    window = 4
    r = runkit.run(
        tiny_model_dir,
        data,
        out,
        "--concurrency",
        str(window),
        "--batch-tokens",
        "4096",
        # A rest after each batch keeps its dumps waiting long enough to be counted.
        fault="worker_slow:200",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    runkit.assert_complete(out, valid, malformed)
    # Requests sent and not yet dumped, along the journal: with started requests replaced
    # this exceeds the window (the running batch plus a full window waiting), and the
    # daemon's bound of three windows in flight still holds.
    outstanding, most = set(), 0
    for rec in runkit.records(out):
        if rec["kind"] == "sample_sent":
            outstanding.add(rec["rid"])
        elif rec["kind"] == "sample_dumped":
            outstanding.discard(rec["rid"])
        most = max(most, len(outstanding))
    assert window < most <= 3 * window, most
