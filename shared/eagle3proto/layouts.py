"""An output whose job changed its shard count between runs: which layout is current. Pure.

A shard of a new layout takes only the rows no journal of another layout settled (saved,
or failed for good), and starts only when every daemon of the other layouts has ended
(docs/slurm.md, "Changing N between runs"). So the layout of the newest ``run_started`` in
the output is the current one; a journal of another shard count is *closed*: what it saved
and failed stands, and the rest of its rows went to the current layout. Readers that sum
shards (the monitor, ``verify``) count a closed journal's total as what it settled, so that
no sample is counted twice and the job's total is the sum of its journals'.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from .reducer import ShardState


def current_count(starts: Iterable[tuple[int, float]]) -> int:
    """The shard count of the newest session among ``(shard count, ts of its last
    run_started)`` pairs; 0 when there is none."""
    best, count = -1.0, 0
    for n, ts in starts:
        if ts > best:
            best, count = ts, n
    return count


def closed_by(s: ShardState, current: int) -> int:
    """The shard count that took over the rest of this journal's rows; 0 when its layout is
    the current one (or the journal names none)."""
    if s.job is None or current == 0 or s.job.shard_count == current:
        return 0
    return current


def closed_view(s: ShardState, current: int) -> ShardState:
    """The state of a closed journal as a reader sums it: its total is what it settled, and
    it has ended ("finished"), whatever its last session's end was."""
    out = msgspec.structs.replace(s, total=s.saved + s.failed)
    if out.state != "finished":
        out.state = "finished"
        out.finish_code = 0
    out.state_reason = f"closed: the rest of its rows went to the {current}-shard layout"
    return out


__all__ = ["closed_by", "closed_view", "current_count"]
