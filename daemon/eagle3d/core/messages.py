"""What the ledger is told: one small type per kind of message, and their union :data:`Msg`.

:meth:`eagle3d.core.ledger.Ledger.handle` takes one of these with the time and answers with
:mod:`eagle3d.core.effects`. Those that come from another thread (the feeder, the producer's
callbacks, the commit threads) cross it as they are (msgspec structs, frozen); the shell
makes the rest from what it saw (a dump's size, a probe write's result, a signal's name).

The run's lifecycle, from the journal's replay on, is told here too: :class:`Replayed`
(nothing left to do?), :class:`ProducerStarting`, :class:`Announced` (``run_started`` is in
the journal), :class:`ProducerUp` or :class:`ProducerFailed`, :class:`Stop` (a signal, at any
stage), :class:`LastReading` (the run finishes).
"""

from __future__ import annotations

import msgspec
from eagle3proto import events as ev

from eagle3d.core.envfault import EnvFault
from eagle3d.core.outcome import AnyOutcome
from eagle3d.core.pauses import ProbeResult
from eagle3d.core.sample import Ended, Rejected, Sample


class Message(msgspec.Struct, tag=True, frozen=True):
    """Base of the ledger's messages."""


# -- the run's lifecycle ----------------------------------------------------------------------


class Replayed(Message, frozen=True):
    """The journal is replayed: a shard with nothing left to do finishes here (and says so
    once: ``finished_last``, the journal's last session ended with ``run_finished``)."""

    finished_last: bool


class ProducerStarting(Message, frozen=True):
    """The producer ``backend``'s start began (a model load: ``phase`` ``loading``;
    ``what``: in words)."""

    backend: str
    phase: str
    what: str


class Announced(Message, frozen=True):
    """``run_started`` is in the journal: the producer's reports may follow it."""


class ProducerUp(Message, frozen=True):
    """The producer is up and takes ``window`` requests (``backend``: its name)."""

    backend: str
    window: int


class ProducerFailed(Message, frozen=True):
    """The producer's start failed (``message``: why, in words; ``code``: the exit status)."""

    message: str
    code: int


class ProducerReport(Message, frozen=True):
    """The producer's own report: ``state`` up, down, restarting or waiting."""

    state: str
    message: str = ""


class Stop(Message, frozen=True):
    """A signal (``why``: its name) asks the run to stop, at whatever stage it is."""

    why: str


class Hangup(Message, frozen=True):
    """SIGHUP: probe the paused areas now instead of at the next interval."""


class LastReading(Message, frozen=True):
    """The last ``stats`` record before ``run_finished`` is taken (or gave up): finish."""


# -- the samples --------------------------------------------------------------------------------


class Fed(Message, frozen=True):
    """The feeder's next item: a tokenized row, a rejected one, or the shard's end."""

    item: Sample | Rejected | Ended


class Started(Message, frozen=True):
    """The producer began computing these requests: they no longer wait in the window."""

    rids: list[str]


class Dumped(Message, frozen=True):
    """A complete dump of ``rid`` appeared (``size`` None: gone before it was read)."""

    rid: str
    path: str
    size: int | None


class RequestFailed(Message, frozen=True):
    """The producer says a request will produce no dump."""

    rid: str
    error: str
    message: str
    retryable: bool


class Committed(Message, frozen=True):
    """A commit thread's batch: each request id with what its commit came to."""

    results: dict[str, AnyOutcome]


class FeedFailed(Message, frozen=True):
    """The feeder could not go on (its tokenizer, the dataset file); ``changed``: the
    dataset is not what the run pinned at its start (stop with exit 6)."""

    message: str
    changed: bool = False


class DatasetChanged(Message, frozen=True):
    """The dataset is not the file the run pinned at its start (``what``: how, naming it)."""

    what: str


# -- the clock and the environment --------------------------------------------------------------


class Tick(Message, frozen=True):
    """The 1 s tick (``producer_up``: the producer's health now)."""

    producer_up: bool


class DumpArea(Message, frozen=True):
    """The dump area's free space, read now."""

    free: int


class Pause(Message, frozen=True):
    """A write to ``fault.area`` was refused by the environment."""

    fault: EnvFault


class Probed(Message, frozen=True):
    """What came of the probe writes a :class:`~eagle3d.core.effects.Probe` asked for."""

    results: list[ProbeResult]
    force: bool = False


class Refused(Message, frozen=True):
    """The journal refused ``event`` (the recorder reported why)."""

    event: ev.Event


class JournalFailed(Message, frozen=True):
    """The journal failed in a way no pause can cure."""

    message: str


class Lose(Message, frozen=True):
    """The output is not where it was opened (removed, moved, replaced)."""

    what: str


#: The run's lifecycle.
Lifecycle = (
    Replayed
    | ProducerStarting
    | Announced
    | ProducerUp
    | ProducerFailed
    | ProducerReport
    | Stop
    | Hangup
    | LastReading
)

#: The samples, the clock and the environment.
Work = (
    Fed
    | Started
    | Dumped
    | RequestFailed
    | Committed
    | FeedFailed
    | DatasetChanged
    | Tick
    | DumpArea
    | Pause
    | Probed
    | Refused
    | JournalFailed
    | Lose
)

#: Every message the ledger takes.
Msg = Lifecycle | Work
