"""The 1 s tick: what must happen on time rather than on an event.

Every second: the output's identity (a removed, moved or replaced output stops the run),
the dataset's (one changed since the start stops it too, exit 6),
the ledger's clocks (request timeouts, the drain's deadline), the probe writes of a pause,
the dump area's free space, the dump watcher's safety net (every 5 s: a lost inotify event,
a removed dump area), a ``stats`` record, sd_notify's STATUS and watchdog, thread names,
and the progress line. While the producer starts, a ``stats`` record a second carries the
workers' memory, which grows while a model load makes progress.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from eagle3proto import events as ev
from eagle3proto import locks, reducer, views

from eagle3d.core import messages as m
from eagle3d.core.ledger import Ledger
from eagle3d.ingest.pin import Pin
from eagle3d.produce.base import Producer
from eagle3d.remote.threadnames import name_threads
from eagle3d.run import diskguard
from eagle3d.run.inbox import DumpArrived, InboxMsg
from eagle3d.run.orphans import Orphans
from eagle3d.run.recorder import Recorder
from eagle3d.serve.notify import Notifier, WatchdogPolicy

if TYPE_CHECKING:
    from eagle3d.dumps.watcher import DumpWatcher
    from eagle3d.serve.progress import ProgressLine
    from eagle3d.serve.telemetry import Telemetry

log = logging.getLogger("eagle3d")

SCAN_EVERY = 5  # ticks between two scans of the dump area


class Ticker:
    """The daemon's clock-driven work beside the running pipeline: what needs the ledger's
    judgement goes to the inbox (``post``) as a message, like every other event; the
    ``ledger`` and the ``orphans`` count are only read (the stats record, STATUS)."""

    def __init__(
        self,
        *,
        output: str,
        dump_dir: str,
        recorder: Recorder,
        identity: diskguard.OutputIdentity,
        state: reducer.ShardState,
        notifier: Notifier,
        watchdog: WatchdogPolicy,
        producer: Producer,
        ledger: Ledger,
        orphans: Orphans,
        watcher: DumpWatcher,
        post: Callable[[InboxMsg], None],
        pin: Pin | None = None,
    ) -> None:
        self.output = output
        self.dump_dir = dump_dir
        self.recorder = recorder
        self.identity = identity
        self.state = state
        self.notifier = notifier
        self.watchdog = watchdog
        self.producer = producer
        self.ledger = ledger
        self.orphans = orphans
        self.watcher = watcher
        self.post = post
        self.pin = pin  # the dataset as pinned at the start, or None
        self._telemetry: Telemetry | None = None
        self._progress: ProgressLine | None = None
        self._boot_id = locks.boot_id()

    def now(self) -> float:
        """The wall time on the session's timeline: the rate, the ETA and the STATUS line
        count boot-clock seconds, whatever the wall clock did since the start."""
        return views.timeline_now(self.state, time.time(), self._boot_id, locks.boottime())

    def stats(self, phase: str, producer_rss: bool = False) -> ev.Stats:
        """One stats record: disk, GPUs, this process, and the producer's health."""
        from eagle3d.serve.telemetry import Telemetry

        if self._telemetry is None:
            self._telemetry = Telemetry(self.output, self.dump_dir)
        stats = self._telemetry.sample(
            producer_health=self.producer.health(),
            inflight=len(self.ledger.inflight),
            orphans=self.orphans.count,
            producer_rss=producer_rss,
        )
        stats.state = phase
        return stats

    async def while_starting(self, phase: str) -> None:
        """A stats record a second while the producer starts (the tick runs only after)."""
        while True:
            await asyncio.sleep(1.0)
            self.recorder.append(self.stats(phase, producer_rss=True))
            self.show()

    async def run(self) -> None:
        n = 0
        while True:
            await asyncio.sleep(1.0)
            n += 1
            if not self.tick(time.monotonic(), n):
                return

    def tick(self, now: float, n: int) -> bool:
        """One tick; False once the run is over (the output was lost)."""
        gone = self.identity.check()
        if gone:
            self.post(m.Lose(gone))
            return False
        changed = self.pin.changed() if self.pin is not None else ""
        if changed:
            self.post(m.DatasetChanged(changed))
            return False
        # The ledger's clocks (timeouts, the drain's deadline, the probes of a pause) and
        # the window asked again (the dump area's room may have grown).
        self.post(m.Tick(self.producer.health().up))
        if n % SCAN_EVERY == 0:
            if self.watcher.rearm():
                log.warning(
                    "dump area %s was removed or replaced: watching it again", self.dump_dir
                )
            for path in self.watcher.scan():
                self.post(DumpArrived(path))  # the safety net for a lost inotify event
        self.recorder.append(self.stats(self.ledger.phase))
        self.heartbeat(now)
        name_threads()  # the commit pool starts its threads as work comes
        self.show()
        return True

    def heartbeat(self, now: float) -> None:
        """sd_notify's STATUS line, and a watchdog ping while the pipeline is alive."""
        from eagle3d.serve.notify import format_status

        led = self.ledger
        view = views.view(self.state, self.now())
        phase = None if led.phase == "running" else led.phase
        self.notifier.status(format_status(view, phase))
        ping = self.watchdog.should_ping(now, led.last_progress, len(led.inflight), led.idle)
        if ping and not self.producer.is_stuck(now):
            self.notifier.watchdog()

    def show(self) -> None:
        """The live progress line on a terminal; a log line every 10 s otherwise."""
        if self._progress is None:
            from eagle3d.serve.progress import ProgressLine

            self._progress = ProgressLine.for_daemon()
        self._progress.update(self.state, self.now())

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close(self.state, self.now())
