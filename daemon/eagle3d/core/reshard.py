"""Another shard count on an output that already holds journals (resharding). Pure.

A job may change its shard count N between runs (8 nodes yesterday, 5 today; an array cut
by preemption). A shard ``I/N`` of the new layout takes exactly the rows ``idx % N == I``
that no journal of another layout has settled (saved, or failed for good: only a sample's
own data fails it for good, so a second layout would fail it again); what other layouts
settled stays theirs, so each sample's outcome is in exactly one journal and every reader
sums journals without counting a sample twice.

It may start only while no daemon of another layout can still write: each of their journals
must be closed, i.e. its lock free and its last session ended with ``run_stopped`` or
``run_finished``, or ended by a death with nothing in flight (a sample sent or committing by
a dead daemon may still have a file renamed into place that only its own next start
accounts for). :class:`OtherJournal` folds one such journal; :func:`refusal` is the rule;
:func:`settle` marks this shard's rows settled elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle3proto import events as ev
from eagle3proto import reducer
from eagle3proto.paths import Shard

from eagle3d.core.envfault import recorded_failure_is_environment
from eagle3d.core.sample import PENDING, SKIPPED


@dataclass(slots=True)
class OtherJournal:
    """One journal of another layout, folded (the latest record of a sample wins, as in
    :class:`~eagle3d.core.resume.ResumeFold`)."""

    shard: Shard
    locked: bool = False  # a live process holds its lock
    owner: str = ""  # what its lock file says ("pid N on HOST")
    state: reducer.ShardState = field(default_factory=reducer.new_state)
    saved: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    last_started: ev.RunStarted | None = None

    def sink(self, batch: list[ev.AnyEvent]) -> None:
        reducer.apply_all(self.state, batch)
        saved, failed = self.saved, self.failed
        for e in batch:
            if isinstance(e, ev.SampleSaved):
                saved.add(e.idx)
                failed.discard(e.idx)
            elif isinstance(e, ev.SampleFailed):
                if e.idx in saved:
                    continue
                if e.retry or recorded_failure_is_environment(e.error, e.message):
                    failed.discard(e.idx)
                else:
                    failed.add(e.idx)
            elif isinstance(e, ev.SampleInvalid):
                saved.discard(e.idx)
            elif isinstance(e, ev.RunStarted):
                self.last_started = e

    @property
    def in_flight(self) -> int:
        """Samples sent or committing when the journal ends (0 after a clean end)."""
        return self.state.in_flight + self.state.committing

    @property
    def ended_cleanly(self) -> bool:
        return self.state.state in ("stopped", "finished")


def refusal(shard: Shard, others: list[OtherJournal]) -> str:
    """Why shard ``shard`` may not start over these journals of other layouts ('' when it
    may): a live daemon, or a dead one with samples in flight."""
    live = [o for o in others if o.locked]
    if live:
        who = ", ".join(f"{o.shard.name} ({o.owner or 'owner unknown'})" for o in live)
        return (
            f"a daemon of the {live[0].shard.count}-shard layout is running: {who}; this run"
            f" asks for shard {shard.index}/{shard.count}. Change N only between runs: stop"
            " or wait for every daemon of the other layout (the lock of each shard is free"
            " when it has ended)"
        )
    dead = [o for o in others if not o.ended_cleanly and o.in_flight]
    if dead:
        o = dead[0]
        return (
            f"{o.shard.name} ended without run_stopped or run_finished (a daemon killed or"
            f" lost) with {o.in_flight} sample(s) in flight; only its own next start accounts"
            f" for them. Run it once more (--shard {o.shard.index}/{o.shard.count}, or the"
            f" {o.shard.count}-task array) and stop it (SIGTERM) or let it finish, then"
            f" start shard {shard.index}/{shard.count}"
        )
    return ""


def settle(status: bytearray, shard: Shard, others: list[OtherJournal]) -> int:
    """Mark this shard's pending rows that another layout settled as not this shard's
    (``SKIPPED``: never fed, not in its total); returns how many."""
    n = 0
    size = len(status)
    for o in others:
        for idx in (*o.saved, *o.failed):
            if idx < size and shard.owns(idx) and status[idx] == PENDING:
                status[idx] = SKIPPED
                n += 1
    return n


__all__ = ["OtherJournal", "refusal", "settle"]
