"""The recorder: the only path to the journal, from any thread, with one error policy.

The loop thread (every record of the ledger's effects, stats, producer events) and the
commit threads (their batches of ``sample_saved``) append through one :class:`Recorder`.
When the journal refuses a record there is one policy, wherever it happened:

* an environment errno (full, unwritable, failing: :func:`eagle3d.core.envfault.env_errno`)
  while the journal is still open (a failed write is cut back to the last good frame):
  the run pauses on the journal, and resumes when a probe write there succeeds;
* anything else, or a journal closed by a failed fdatasync (the kernel may have dropped
  what it said it wrote; it cannot be trusted again in this process): the run stops, and a
  restart replays what is durable.

The recorder only reports (a :class:`~eagle3d.run.inbox.JournalFault` through ``report``,
which the loop hands to the ledger); the caller learns that its record is not in the
journal from the return value. Once the output is lost nothing is appended at all.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from eagle3proto import events as ev
from eagle3proto.fileops import OsFileOps
from eagle3proto.journal import JournalError, JournalWriter

from eagle3d.core.envfault import env_errno
from eagle3d.remote import faults
from eagle3d.run.diskguard import Reserve
from eagle3d.run.inbox import JournalFault


class FaultFileOps(OsFileOps):
    """Journal file operations with the whitebox kill points that live inside an append."""

    def write(self, fd: int, data: bytes | memoryview) -> int:
        if len(data) > 16 and faults.hit("kill:mid_frame") is not None:
            # The write's last frame loses its last bytes. Half the write ended exactly
            # between two frames when it held two of the same size, and tore nothing.
            os.write(fd, bytes(data)[: len(data) - 8])
            os._exit(137)
        return super().write(fd, data)

    def fdatasync(self, fd: int) -> None:
        faults.kill_point("after_append_before_sync")
        super().fdatasync(fd)


class Recorder:
    """Appends to ``journal``; reports each refusal through ``report`` (any thread)."""

    def __init__(
        self, journal: JournalWriter, report: Callable[[JournalFault], None], reserve: Reserve
    ) -> None:
        self.journal = journal
        self.report = report
        self.reserve = reserve
        self.lost = ""  # the output is not where it was: nothing more is journaled

    def append(self, event: ev.Event) -> bool:
        """Whether ``event`` is in the journal (durable, for a durable kind)."""
        return self.append_many([event])

    def append_many(self, events: list[ev.Event]) -> bool:
        """Append ``events`` as consecutive records with one write and at most one sync;
        all of them are in the journal, or none."""
        if self.lost:
            return False
        try:
            self.journal.append_many(events)
        except JournalError as e:
            open_ = self.journal.segment()[1] >= 0
            self.report(JournalFault(e.errno or 0, str(e), env_errno(e.errno) and open_))
            return False
        return True

    def append_paused(self, event: ev.RunState) -> bool:
        """The paused state, which must reach the journal even when its own disk is full:
        the reserve is given back for it."""
        if self.append(event):
            return True
        return self.reserve.release() and self.append(event)

    def lose(self, what: str) -> None:
        self.lost = what

    def close(self) -> None:
        """Sync and close; a journal nobody can see any more is abandoned unsynced."""
        if self.lost:
            self.journal.abandon()
            return
        with contextlib.suppress(JournalError):
            self.journal.close()
