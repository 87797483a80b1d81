"""The producer seam: how the daemon asks for hidden states without trusting the answer.

A producer receives :class:`~eagle3d.core.sample.Request` objects and, for each, eventually drops one dump file
(see :mod:`eagle3d.remote.dumpfile`) named after ``Request.rid`` into the dump directory. The daemon
never takes a producer's word for completion: it watches the dump directory itself, validates
every dump against what it sent, and commits it. A producer reports only what the dump area
cannot show: a request that failed outright, and its own up/down state.

Implementations: :mod:`eagle3d.produce.hf` (Hugging Face model in worker processes),
:mod:`eagle3d.produce.synthetic` and :mod:`eagle3d.produce.sglang` (HTTP client of an SGLang server running our capture hook).
"""

from __future__ import annotations

import abc
from typing import Protocol

from eagle3proto.events import ProducerHealth

from eagle3d.core.sample import Request

# How long after a producer says a request's dump is written it may take to be seen by the
# daemon (inotify, else its 5 s scan of the dump area).
DUMP_GRACE_S = 20.0


class DumpGrace:
    """Requests whose dump the producer says is written and the daemon has not seen.

    Either word may come first: a dump usually lands before the producer's report of it. A
    request reported written whose dump is still unseen ``grace`` seconds later is
    :meth:`late`: its dump was lost (the dump area removed or cleaned under the job, a
    server hook whose write failed), and it is retried then rather than at the request
    timeout (600 s by default). The producer's word only starts this clock; a dump that
    comes after all is an orphan. Time is an argument (monotonic seconds).
    """

    def __init__(self, grace: float = DUMP_GRACE_S) -> None:
        self.grace = grace
        self._awaiting: dict[str, float] = {}  # rid -> when reported written, not yet seen
        self._arrived: dict[str, float] = {}  # rid -> when seen, not yet reported written

    def written(self, rid: str, now: float) -> None:
        """The producer says ``rid``'s dump is in the dump area."""
        if self._arrived.pop(rid, None) is None:
            self._awaiting[rid] = now

    def arrived(self, rid: str, now: float) -> None:
        """The daemon saw ``rid``'s dump."""
        if self._awaiting.pop(rid, None) is None:
            self._arrived[rid] = now

    def forget(self, rid: str) -> None:
        """``rid`` failed or was cancelled: nothing is owed for it."""
        self._awaiting.pop(rid, None)
        self._arrived.pop(rid, None)

    def late(self, now: float) -> list[str]:
        """Requests overdue at ``now``, each returned once. Seen dumps never reported
        written (their producer failed first) are forgotten after the same grace."""
        for rid in [r for r, t in self._arrived.items() if now - t > self.grace]:
            del self._arrived[rid]
        late = [rid for rid, t in self._awaiting.items() if now - t > self.grace]
        for rid in late:
            del self._awaiting[rid]
        return late

    @property
    def awaiting(self) -> list[str]:
        return list(self._awaiting)

    @property
    def arrived_early(self) -> list[str]:
        return list(self._arrived)


class ProducerEvents(Protocol):
    """Callbacks a producer uses to tell the daemon what the dump area cannot show.

    They may be called from any thread; the daemon makes them thread-safe.
    """

    def request_failed(self, rid: str, error: str, message: str, retryable: bool) -> None:
        """The request will produce no dump (bad input, server error, worker crash)."""

    def producer_state(self, state: str, message: str = "") -> None:
        """``up``, ``down`` or ``restarting`` with a human reason."""

    def requests_started(self, rids: list[str]) -> None:
        """The producer began computing these requests (optional: a producer that cannot
        tell, such as a server, never calls it). They stop counting against the window of
        requests waiting at the producer, so its batcher keeps a full pool to choose from."""


class Producer(abc.ABC):
    """Base class of producers. All methods are called from the daemon's event loop."""

    name: str = "producer"

    async def launch(self, events: ProducerEvents) -> None:  # noqa: B027 - optional hook
        """Begin starting, and return at once: what takes long (worker processes loading
        a model) then runs beside the daemon's own start. :meth:`start` follows."""

    @abc.abstractmethod
    async def start(self, events: ProducerEvents) -> None:
        """Start (load the model, connect to the server). Returns once ready for requests."""

    @abc.abstractmethod
    def submit(self, request: Request) -> None:
        """Queue one request. Must not block; failures are reported via ``request_failed``."""

    def cancel(self, rid: str) -> None:  # noqa: B027 - optional hook
        """Forget a request (timed out on the daemon's side). Best effort."""

    def dump_arrived(self, rid: str) -> None:  # noqa: B027 - optional hook
        """The daemon saw the dump of ``rid`` (a producer may stop waiting for it)."""

    @abc.abstractmethod
    def health(self) -> ProducerHealth:
        """Current health, for ``stats`` records."""

    def window(self) -> int:
        """How many requests the daemon may keep in flight."""
        return 64

    def is_stuck(self, now: float) -> bool:
        """True when the producer has work but makes no progress (feeds the watchdog)."""
        return False

    async def refresh(self) -> None:
        """Bring ``health()`` up to date now: the run's last stats record is taken after it."""
        return None  # most producers' health is always current

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop and release everything (worker processes, connections)."""
