"""The daemon's state checkpoints (:mod:`eagle3proto.checkpoint`): resuming from one, and
writing them as the journal grows.

The writer folds the journal's published records into a resume fold of its own (a copy of
the one the start replayed), so that what it writes is exactly the fold of the journal up to
the position it names, whatever the ledger's live status says in between.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from eagle3proto import checkpoint, reducer
from eagle3proto import events as ev
from eagle3proto.checkpoint import Checkpointer, Position

from eagle3d.core.resume import ResumeFold

log = logging.getLogger("eagle3d")


def restore(resume: ResumeFold, jdir: str) -> Position | None:
    """Load the shard's checkpoint into ``resume``; its position (the replay goes on from
    there), or None when the whole journal must be replayed (logged, with why)."""
    loaded = checkpoint.load(jdir)
    ck = loaded.checkpoint
    if ck is None:
        log.log(logging.INFO if loaded.missing else logging.WARNING, "%s", loaded.note)
        return None
    why = resume.restore(ck.state, ck.extra)
    if why:
        log.warning(
            "checkpoint %s ignored: %s; the whole journal is read", checkpoint.path_in(jdir), why
        )
        return None
    log.info("resuming from the checkpoint at record %d; replaying what follows", ck.position.seq)
    return ck.position


class Checkpoints:
    """The journal's listener and position hook that keep checkpoints written."""

    def __init__(self, jdir: str, publish: Callable[[ev.Event], None]) -> None:
        self._publish = publish
        self._fold: ResumeFold | None = None
        # EAGLE3D_CHECKPOINT_EVERY=RECORDS: for tests and benchmarks that need one sooner.
        records = int(os.environ.get("EAGLE3D_CHECKPOINT_EVERY") or checkpoint.EVERY_RECORDS)
        self.writer = Checkpointer(jdir, self._apply, self._snapshot, every_records=records)

    def listener(self, e: ev.Event) -> None:
        self.writer.on_event(e)
        self._publish(e)

    def on_position(self, pos: Position) -> None:
        self.writer.on_position(pos)

    def seed(self, resume: ResumeFold) -> None:
        """The start's replay is done: fold on from a copy of it."""
        self._fold = resume.copy()
        self.writer.seed(resume.state.seq)

    def _apply(self, e: ev.Event) -> None:
        assert self._fold is not None
        self._fold.apply(e)

    def _snapshot(self) -> tuple[reducer.ShardState, bytes]:
        assert self._fold is not None
        return self._fold.state, self._fold.extra()

    def close(self) -> None:
        self.writer.close(final=True)
        if self.writer.error:
            log.warning("%s", self.writer.error)
