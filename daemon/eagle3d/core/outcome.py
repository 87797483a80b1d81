"""What a commit thread's work on one sample came to: typed outcomes, one per sample.

A commit thread returns these (never raises, never returns a tuple of strings) and the
ledger decides what each means for its sample (:meth:`eagle3d.core.ledger.Ledger.committed`).
"""

from __future__ import annotations

import msgspec


class Outcome(msgspec.Struct, tag=True, frozen=True):
    """Base of the commit outcomes."""


class Saved(Outcome, frozen=True):
    """Written, synced and journaled (``sample_saved`` is durable)."""

    relpath: str
    nbytes: int
    checksum: str


class NotRecorded(Outcome, frozen=True):
    """The file was written, but the journal refused its record: committed again after the
    pause the recorder reported (or dropped by the stop it reported)."""

    message: str


class DumpLost(Outcome, frozen=True):
    """The dump was complete and is gone (the dump area was cleaned under the run)."""

    message: str


class BadDump(Outcome, frozen=True):
    """The dump fails validation: the sample's own attempt failed."""

    message: str


class ContractBroken(Outcome, frozen=True):
    """The dump's layers or hidden size are not the job's capture contract: the producer's
    fault (every dump it writes will be alike), never the sample's. The run stops."""

    message: str


class WriteRefused(Outcome, frozen=True):
    """The output refused the write with an environment errno (full, unwritable, failing)."""

    errno: int
    directory: str
    message: str


class DirGone(Outcome, frozen=True):
    """The sample's row directory vanished under the commit (the output itself is intact)."""

    message: str


class OutputGone(Outcome, frozen=True):
    """The output is not where it was opened (removed, moved, replaced): nothing written."""

    message: str


class WriteFailed(Outcome, frozen=True):
    """Writing failed for a reason that is not the environment's."""

    message: str


class Internal(Outcome, frozen=True):
    """A bug in the commit path (its traceback is in the log)."""

    message: str


AnyOutcome = (
    Saved
    | NotRecorded
    | DumpLost
    | BadDump
    | ContractBroken
    | WriteRefused
    | DirGone
    | OutputGone
    | WriteFailed
    | Internal
)
