"""The daemon's shell in-process: the real pipeline, ledger, journal, commit threads, dump
watcher and synthetic producer, made as the daemon makes them, in one event loop.

Two seams stand in for what is slow or clocked: the test hands rows to the real feeder from
a thread (as its tokenizer would), and the 1 s tick is the message the ticker posts, with a
clock the test moves by hand. sd_notify goes to a real datagram socket the test reads.

Each scenario is a list of steps (a small language, below) and what the journal and
sd_notify must say at the end, the scenario style of ``test_ledger.py``:

A scenario begins as the daemon's start does, with the pipeline of the start (its pieces
not made yet: a signal then is the ledger's to judge); ``assemble`` makes the pieces and the
running pipeline around the same ledger, and moves the inbox to it (as
:func:`eagle3d.run.assemble.assemble` and the daemon do). The steps:

* ``announce`` (``run_started`` is journaled), ``assemble``, ``up`` (the producer started,
  and is up), ``feed A B ...``, ``end``, ``stop`` (SIGTERM), ``tick S`` (the clock moves S
  seconds, then the tick), ``jfull`` (the recorder reports a full journal disk), ``jfail``
  (a journal fault no pause cures), ``lose`` (the output is moved away, then the ticker's
  own tick), ``wait saved N`` / ``wait state S`` / ``wait done``, ``slow`` (the producer
  holds every request: nothing is dumped).

The summary of the journal: the ``run_state`` states, ``stopped`` / ``finished``, ``saved
N``; of sd_notify: its messages' first fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from eagle3d.core import messages as m
from eagle3d.core.ledger import Ledger, Rules
from eagle3d.core.sample import Ended, Sample
from eagle3d.dumps.watcher import DumpWatcher
from eagle3d.ingest.feeder import Feeder
from eagle3d.produce.synthetic import SyntheticProducer
from eagle3d.remote import storedtype
from eagle3d.run import diskguard
from eagle3d.run.commits import Commits, commit_batch
from eagle3d.run.inbox import DumpArrived, Inbox, InboxMsg, JournalFault, ProducerPort, Signalled
from eagle3d.run.orphans import Orphans
from eagle3d.run.pipeline import Outlets, Pipeline, Unmade, Work
from eagle3d.run.reaper import Reaper
from eagle3d.run.recorder import Recorder
from eagle3d.run.ticker import Ticker
from eagle3d.serve.notify import Notifier, WatchdogPolicy
from eagle3d.store.committer import Committer
from eagle3proto import events as ev
from eagle3proto import paths, reducer
from eagle3proto.journal import JournalWriter
from eagle3proto.paths import Shard

HIDDEN, LAYERS, TOKENS = 8, [0, 1, 2], 6
WAIT_S = 30.0  # a deadline for polls, never a duration the test takes


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Shell:
    """One shard's pipeline around a real ledger, journal and producer (see above)."""

    def __init__(self, tmp: Path, n: int, window: int = 2) -> None:
        self.tmp, self.n, self.window = tmp, n, window
        self.output = str(tmp / "out")
        self.dump_dir = str(tmp / "dumps")
        os.makedirs(self.output)
        os.makedirs(self.dump_dir)
        self.jdir = paths.journal_dir(self.output, Shard(0, 1))
        os.makedirs(self.jdir)
        self.clock = Clock()
        self.records: list[ev.Event] = []
        self.code: int | None = None
        self.status = bytearray(n)
        self.inbox = Inbox(self._receive)
        self.notified = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notified.bind(str(tmp / "notify"))
        self.notified.setblocking(False)
        self.closers: list[Callable[[], None]] = [self.notified.close]
        self.notes: list[str] = []

    def _receive(self, msgs: list[InboxMsg]) -> None:
        self.pipeline.receive(msgs)

    def build(self, latency: float) -> None:
        """The journal, the ledger and the pipeline of the start around them, as the
        daemon's replay leaves them (the producer made, not started)."""
        journal = JournalWriter(self.jdir, shard_index=0, shard_count=1, listener=self.inbox.put)
        journal.open()
        reserve = diskguard.Reserve(os.path.join(self.jdir, ".reserve"))
        self.recorder = rec = Recorder(journal, self.inbox.put, reserve)
        self.identity = diskguard.OutputIdentity(self.output, self.jdir, journal.segment)
        self.closers += [self.identity.close, rec.close]
        rules = Rules(window=1, dump_dir=self.dump_dir, drain_timeout=60.0)
        ledger = Ledger(
            self.status,
            range(self.n),
            self.n,
            rules,
            rid_prefix="abcd1234-0-",
            session=1,
            bytes_per_token=100.0,
        )
        self.outlets = Outlets(
            recorder=rec,
            orphans=Orphans(rec),
            notifier=Notifier(str(self.tmp / "notify")),
            publish=self.records.append,
            post=self.inbox.put,
            journal_dir=self.jdir,
            dump_dir=self.dump_dir,
            on_done=self._done,
            clock=self.clock,
        )
        self.pipeline = Pipeline(ledger, self.outlets, Unmade())
        self.producer = SyntheticProducer(
            dump_dir=self.dump_dir,
            hidden_size=HIDDEN,
            aux_layers=LAYERS,
            threads=1,
            latency_s=latency,
        )

    def assemble(self) -> None:
        """Make the pieces and the running pipeline around the same ledger, and move the
        inbox to it, as :func:`eagle3d.run.assemble.assemble` and the daemon do."""
        rec = self.recorder
        committer = Committer(self.output, store=storedtype.get("bfloat16"))
        reaper = Reaper(1 << 30)

        def body(batch: list[Any]) -> list[Any]:
            return commit_batch(batch, committer, rec, self.identity, HIDDEN, LAYERS, reaper)

        commits = Commits(body, self.inbox.put, 1, committer)
        self.feeder = Feeder(
            model="",
            dataset="",
            fmt=None,
            shard_index=0,
            shard_count=1,
            status=self.status,
            max_length=0,
            on_overflow="truncate",
            put=lambda item: self.inbox.put(m.Fed(item)),
            failed=lambda why, changed: self.inbox.put(m.FeedFailed(why, changed)),
            capacity=2,
        )
        self.watcher = DumpWatcher(self.dump_dir, lambda path: self.inbox.put(DumpArrived(path)))
        self.watcher.start()
        self.closers += [reaper.close, commits.close, self.feeder.stop, self.watcher.stop]

        async def last_reading() -> None:
            await self.producer.refresh()

        work = Work(self.producer, commits, self.feeder, last_reading)
        self.pipeline = Pipeline(self.pipeline.ledger, self.outlets, work)

    def _done(self, code: int) -> None:
        if self.code is None:
            self.code = code

    async def step(self, line: str) -> None:
        op, *args = line.split()
        p, now = self.pipeline, self.clock.now
        if op == "announce":
            p.handle(m.Announced(), now)
        elif op == "assemble":
            self.assemble()
        elif op == "up":
            await self.producer.start(ProducerPort(self.inbox))
            self.inbox.put(m.ProducerUp("synthetic", self.window))
        elif op in ("feed", "end"):
            items: list[Sample | Ended] = [
                Sample(int(a), list(range(TOKENS)), [1] * TOKENS) for a in args
            ]
            items += [Ended()] if op == "end" else []
            threading.Thread(target=lambda: [self.feeder.hand(i) for i in items]).start()
        elif op == "stop":
            self.inbox.put(Signalled(signal.SIGTERM))
        elif op == "tick":
            self.clock.now += float(args[0])
            self.inbox.put(m.Tick(True))
        elif op == "jfull":
            self.inbox.put(JournalFault(errno.ENOSPC, "journal: No space left", pause=True))
        elif op == "jfail":
            self.inbox.put(JournalFault(errno.EBADF, "journal: closed", pause=False))
        elif op == "lose":
            os.rename(self.output, self.output + ".moved")
            assert not self._ticker().tick(self.clock.now, 1)  # the ticker's own check
        elif op == "wait":
            await self.wait(args)
        else:
            raise ValueError(f"unknown step {line!r}")
        await asyncio.sleep(0)

    def _ticker(self) -> Ticker:
        return Ticker(
            output=self.output,
            dump_dir=self.dump_dir,
            recorder=self.recorder,
            identity=self.identity,
            state=reducer.new_state(),
            notifier=self.outlets.notifier,
            watchdog=WatchdogPolicy(),
            producer=self.producer,
            ledger=self.pipeline.ledger,
            orphans=self.outlets.orphans,
            watcher=self.watcher,
            post=self.inbox.put,
        )

    async def wait(self, args: list[str]) -> None:
        """Poll until the journal (or the end) says ``args``, with a deadline."""
        what = " ".join(args)
        checks: dict[str, Callable[[], bool]] = {
            "saved": lambda: self.count(ev.SampleSaved) >= int(args[-1]),
            "state": lambda: args[-1] in self.states(),
            "done": lambda: self.code is not None,
        }
        deadline = time.monotonic() + WAIT_S
        while not checks[args[0]]():
            assert time.monotonic() < deadline, f"no {what} within {WAIT_S} s: {self.summary()}"
            await asyncio.sleep(0.005)

    def count(self, kind: type[ev.Event]) -> int:
        return sum(1 for r in self.records if isinstance(r, kind))

    def states(self) -> list[str]:
        return [r.state for r in self.records if isinstance(r, ev.RunState)]

    def summary(self) -> list[str]:
        out: list[str] = []
        for r in self.records:
            if isinstance(r, ev.RunState):
                out.append(r.state)
            elif isinstance(r, ev.RunStopped):
                out.append(f"stopped {r.exit_code}")
            elif isinstance(r, ev.RunFinished):
                out.append(f"finished {r.saved}/{r.failed} {r.exit_code}")
        saved = self.count(ev.SampleSaved)
        return out + ([f"saved {saved}"] if saved else [])

    def notifications(self) -> list[str]:
        out = []
        with contextlib.suppress(BlockingIOError):
            while True:
                out.append(self.notified.recv(4096).decode().split("=")[0])
        return out

    def close(self) -> None:
        for close in reversed(self.closers):
            close()


async def _play(tmp: Path, steps: list[str], n: int, latency: float) -> Shell:
    shell = Shell(tmp, n)
    shell.build(latency)
    shell.inbox.open(asyncio.get_running_loop())
    try:
        for line in steps:
            await shell.step(line)
        await shell.wait(["done"])
        await asyncio.sleep(0)  # the last records reach the listener
        shell.notes = shell.notifications()
    finally:
        await shell.producer.stop()
        shell.close()
    return shell


# fmt: off
SCENARIOS: dict[str, tuple[dict[str, Any], list[str], str, str, int]] = {
    # name: (settings, steps, journal summary, sd_notify, exit status)
    "start to finish": ({"n": 4}, [
        "announce", "assemble", "feed 0 1", "up", "end 2 3", "wait done",
    ], "running, finished 4/0 0, saved 4", "READY", 0),
    "a stop before run_started journals nothing": ({"n": 4}, [
        "stop",
    ], "", "STOPPING", 0),
    "a stop after run_started, before the pieces are made: run_stopped": ({"n": 4}, [
        "announce", "stop",
    ], "stopped 0", "STOPPING", 0),
    "a journal fault before the pieces are made: exit 1, judged by the ledger": ({"n": 4}, [
        "announce", "jfail",
    ], "", "", 1),
    "a stop while the producer starts: run_stopped": ({"n": 4}, [
        "announce", "assemble", "feed 0 1", "stop",
    ], "stopped 0", "STOPPING", 0),
    "a stop while running drains what is in flight": ({"n": 4, "latency": 1000.0}, [
        "announce", "assemble", "up", "feed 0 1 2", "wait state running", "tick 1", "stop",
        "wait state draining", "stop",
    ], "running, draining, stopped 0", "READY, STOPPING", 0),
    "the drain's deadline abandons what is in flight": ({"n": 4, "latency": 1000.0}, [
        "announce", "assemble", "up", "feed 0 1", "wait state running", "tick 1", "stop",
        "wait state draining", "tick 30", "tick 31",
    ], "running, draining, stopped 0", "READY, STOPPING", 0),
    "a full journal pauses the run; a probe resumes it; it finishes": ({"n": 3}, [
        "announce", "assemble", "up", "wait state running", "jfull", "wait state paused",
        "feed 0 1", "tick 1", "tick 2", "wait state running", "end 2", "wait done",
    ], "running, paused, running, finished 3/0 0, saved 3", "READY, STATUS", 0),
    "a stop while paused": ({"n": 3}, [
        "announce", "assemble", "up", "wait state running", "jfull", "wait state paused",
        "feed 0", "stop",
    ], "running, paused, draining, stopped 0", "READY, STATUS, STOPPING", 0),
    "the output lost: exit 4, nothing more journaled": ({"n": 3, "latency": 1000.0}, [
        "announce", "assemble", "up", "feed 0 1", "wait state running", "lose", "end 2",
    ], "running", "READY", 4),
}
# fmt: on


@pytest.mark.parametrize(
    ("settings", "steps", "journal", "notify", "code"), SCENARIOS.values(), ids=SCENARIOS.keys()
)
def test_the_shell(
    tmp_path: Path,
    settings: dict[str, Any],
    steps: list[str],
    journal: str,
    notify: str,
    code: int,
) -> None:
    n, latency = settings["n"], settings.get("latency", 0.0)
    shell = asyncio.run(_play(tmp_path, steps, n, latency))
    assert ", ".join(shell.summary()) == journal
    assert ", ".join(dict.fromkeys(shell.notes)) == notify
    assert shell.code == code
