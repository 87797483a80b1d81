"""What the ledger asks the shell to do: one small type per kind of effect.

The ledger never acts; every answer it gives is a list of these, carried out in order by
:meth:`eagle3d.run.pipeline.Pipeline.carry_out` (a ``match`` over :data:`Effect` that ends in
``assert_never``: an effect nobody carries out fails ``mypy --strict``), which may feed the
ledger again with what came of them (a record the journal refused, a probe's result).
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3proto import events as ev

from eagle3d.core.envfault import EnvFault
from eagle3d.core.pauses import Probe as ProbeWrite
from eagle3d.core.sample import CommitJob, Request


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
    """Validate and commit ``job``'s dump (on a commit thread); ``forget_dirs``: its row
    directory was removed under the run and must be made again."""

    job: CommitJob
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
class NotifyReady:
    """sd_notify ``READY=1``: the service is up (the producer is, or nothing is left to do)."""


@dataclass(frozen=True, slots=True)
class NotifyStatus:
    """sd_notify ``STATUS=``: ``text``."""

    text: str


@dataclass(frozen=True, slots=True)
class NotifyStopping:
    """sd_notify ``STOPPING=1``."""


@dataclass(frozen=True, slots=True)
class NotifyExtendTimeout:
    """sd_notify ``EXTEND_TIMEOUT_USEC=``: a start that may take long (a model load)."""

    usec: int


@dataclass(frozen=True, slots=True)
class Probe:
    """Make ``probes`` (writes into the paused areas) and tell the ledger what came of them
    (:class:`eagle3d.core.messages.Probed`); ``force``: asked by SIGHUP."""

    probes: list[ProbeWrite]
    force: bool = False


@dataclass(frozen=True, slots=True)
class Running:
    """The producer is up: the pipeline runs with ``window`` requests (the feeder may read
    that far ahead; the dump area is read now)."""

    window: int


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
    """Every sample is done: take a last reading of the producer, then tell the ledger
    (:class:`eagle3d.core.messages.LastReading`)."""


@dataclass(frozen=True, slots=True)
class Done:
    """The run is over; the daemon exits with ``code`` once it has shut down in order."""

    code: int


#: What the samples need: records, requests, commits, dumps, logs, probes, the feed's slots.
SampleEffect = (
    Record | Submit | Cancel | SeenDump | Commit | RemoveDump | Orphan | Log | Probe | Taken
)

#: What the run's state needs: pauses, sd_notify, the run's start and end, the feed's stop.
StateEffect = (
    Paused
    | Resumed
    | NotifyReady
    | NotifyStatus
    | NotifyStopping
    | NotifyExtendTimeout
    | Running
    | StopFeed
    | Finish
    | Done
)

#: Every effect the ledger answers.
Effect = SampleEffect | StateEffect
