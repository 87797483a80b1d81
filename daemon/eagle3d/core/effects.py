"""What the ledger asks the shell to do: one small type per kind of effect.

The ledger never acts; every answer it gives is a list of these, carried out in order by
:class:`eagle3d.run.pipeline.Pipeline` (which may feed the ledger again with what came of
them: a record the journal refused, say).
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3proto import events as ev

from eagle3d.core.envfault import EnvFault
from eagle3d.core.sample import Request, Sample


@dataclass(frozen=True, slots=True)
class Record:
    """Append ``event`` to the journal (through the one recorder)."""

    event: ev.Event


@dataclass(frozen=True, slots=True)
class Submit:
    """Send ``request`` to the producer."""

    request: Request


@dataclass(frozen=True, slots=True)
class Cancel:
    """Tell the producer to forget ``rid`` (it timed out here)."""

    rid: str


@dataclass(frozen=True, slots=True)
class SeenDump:
    """Tell the producer the daemon saw the dump of ``rid`` (it stops waiting for it)."""

    rid: str


@dataclass(frozen=True, slots=True)
class Commit:
    """Validate and commit ``sample``'s dump; ``forget_dirs``: its row directory was
    removed under the run and must be made again."""

    sample: Sample
    forget_dirs: bool = False


@dataclass(frozen=True, slots=True)
class RemoveDump:
    """Remove a dump that will never be committed (it failed validation)."""

    path: str


@dataclass(frozen=True, slots=True)
class Orphan:
    """A dump of this run that no request in flight asked for: remove it and journal it."""

    path: str
    reason: str


@dataclass(frozen=True, slots=True)
class Log:
    level: int  # a logging level
    message: str


@dataclass(frozen=True, slots=True)
class Notify:
    """An sd_notify message: ``method`` of :class:`eagle3d.serve.notify.Notifier`."""

    method: str
    text: str = ""


@dataclass(frozen=True, slots=True)
class Paused:
    """The run pauses on ``fault``: journal ``run_state paused`` (giving back the journal's
    reserve if its own disk is full), and say so."""

    fault: EnvFault


@dataclass(frozen=True, slots=True)
class Resumed:
    """Every paused area takes writes again: journal ``run_state running`` and make the
    journal's reserve again."""

    reason: str


@dataclass(frozen=True, slots=True)
class StopFeed:
    """The feeder stops reading the dataset."""


@dataclass(frozen=True, slots=True)
class Taken:
    """The ledger took one fed item off its queue: the feeder may hand over another."""


@dataclass(frozen=True, slots=True)
class Finish:
    """Every sample is done: take a last reading of the producer, then call
    :meth:`eagle3d.core.ledger.Ledger.finish`."""


@dataclass(frozen=True, slots=True)
class Done:
    """The run is over; the daemon exits with ``code`` once it has shut down in order."""

    code: int


Effect = (
    Record
    | Submit
    | Cancel
    | SeenDump
    | Commit
    | RemoveDump
    | Orphan
    | Log
    | Notify
    | Paused
    | Resumed
    | StopFeed
    | Taken
    | Finish
    | Done
)
