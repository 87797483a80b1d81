"""The ledger's rules, in-process: scenario tables of events and the effects they must give.

Each scenario is a list of steps ``(event, expected effects)``. An event is a line of a small
language (below); the expected effects are the ledger's answer, summarised and in order:

* ``send 3`` (a request for sample 3; ``send 3#2`` for its second counted attempt),
  ``commit 3``, ``cancel 3``, ``remove 3`` (its dump), ``orphan``,
* ``failed 3 <error> retry|final|env`` (its ``sample_failed`` record: retried, failed for
  good, or the environment's and counting no attempt),
* ``paused <area>``, ``resumed``, ``draining``, ``stopped``, ``finish`` (ask for the last
  reading), ``finished`` (the ``run_finished`` record), ``stopfeed``, ``done <code>``.

Records of ``sample_sent`` / ``sample_dumped``, logs, notifications and the feeder's slots
are left out of the summary (each is checked once, in its own test below). A step ``check
k=v ...`` asserts the ledger's state instead. Time starts at 0; ``tick S`` moves it.

Events: ``feed A B ...``, ``reject A``, ``end``, ``start A ...``, ``dump A [bytes]``,
``vanish A`` (its dump gone before it was read), ``late A`` (a dump of A's previous send),
``save A [bytes]``, ``commit A <Outcome> [errno]``, ``fail A <Error> retry|final [message]``,
``free N`` (the dump area's free bytes), ``tick S [down]``, ``pause <area> <errno>``,
``probe ok|no [free] [force]``, ``refuse`` (the journal refuses the last failure recorded),
``stop``, ``finish``, ``lose``, ``jfail``.

The lifecycle (a driver made with ``up=False`` starts right after the journal's replay):
``replayed [finished]``, ``starting`` (the producer's start began), ``announced``
(``run_started`` is journaled), ``report <state>`` (the producer's own), ``up N`` (the
producer is up, window N), ``startfail``, ``hup``; their effects: ``ready`` (sd_notify),
``state <s>`` (a ``run_state`` record), ``producer <s>`` (a ``producer`` record),
``running N``, ``probe`` / ``probe now``.
"""

from __future__ import annotations

import errno
import logging
from typing import Any

import pytest
from eagle3d.core import effects as fx
from eagle3d.core import messages as m
from eagle3d.core import outcome as oc
from eagle3d.core.envfault import DUMPS, JOURNAL, OUTPUT, EnvFault
from eagle3d.core.ledger import Ledger, ProbeResult, Rules
from eagle3d.core.sample import FAILED, PENDING, SAVED, Ended, Rejected, Sample
from eagle3proto import events as ev

PREFIX = "abcd1234-0-"
AREAS = {"output": OUTPUT, "journal": JOURNAL, "dumps": DUMPS}


class Driver:
    """Feeds a ledger the events of a scenario, as the shell would, and summarises."""

    def __init__(
        self, n: int = 10, tokens: int = 10, up: bool = True, done: str = "", **rules: Any
    ) -> None:
        rules.setdefault("window", 2)
        rules.setdefault("dump_dir", "/dumps")
        self.tokens = tokens
        status = bytearray(n)
        for i, c in enumerate(done):  # what the replayed journal says: s saved, f failed
            status[i] = {"s": SAVED, "f": FAILED}[c]
        self.ledger = Ledger(
            status,
            range(n),
            n,
            Rules(**rules),
            rid_prefix=PREFIX,
            session=1,
            bytes_per_token=100.0,
        )
        self.now = 0.0
        self.last: list[fx.Effect] = []
        self.records: list[ev.Event] = []
        self.sent: dict[int, list[str]] = {}  # idx -> the rids of its sends
        self.pending_out: list[fx.Effect] = []
        if up:  # the run as the scenarios of the samples begin: announced, the producer up
            self.ledger.handle(m.Announced(), 0.0)
            self.ledger.handle(m.ProducerUp("synthetic", rules["window"]), 0.0)

    def run(self, line: str) -> list[str]:
        words = line.split()
        op, args = words[0], words[1:]
        if op == "check":
            self.check(dict(a.split("=") for a in args))
            return []
        if op == "tick":
            self.now += float(args[0])
        self.pending_out = []
        msg = self.message(op, args)
        self.last = self.pending_out + self.ledger.handle(msg, self.now)
        return self.summary(self.last)

    def message(self, op: str, args: list[str]) -> m.Msg:
        """The message a step stands for (every step goes through the one way in)."""
        match op:
            case "end":
                return m.Fed(Ended())
            case "stop":
                return m.Stop("SIGTERM")
            case "finish":
                return m.LastReading()
            case "lose":
                return m.Lose("the output directory /out was removed during the run")
            case "jfail":
                return m.JournalFailed("journal write failed: [Errno 9] Bad file descriptor")
            case "replayed":
                return m.Replayed(finished_last="finished" in args)
            case "starting":
                return m.ProducerStarting("hf", "loading", "loading model /m (hf, device cpu)")
            case "announced":
                return m.Announced()
            case "hup":
                return m.Hangup()
            case "startfail":
                return m.ProducerFailed("producer hf failed to start: boom", 5)
            case "up":
                return m.ProducerUp("synthetic", int(args[0]))
        if op == "feed":
            return self.feed([int(a) for a in args])
        if op == "reject":
            return m.Fed(Rejected(int(args[0]), "bad_json", f"line {args[0]}: bad JSON"))
        if op == "start":
            return m.Started([self.rid(int(a)) for a in args])
        if op in ("dump", "vanish", "late"):
            i = int(args[0])
            rid = self.sent[i][-2] if op == "late" else self.rid(i)
            size = None if op == "vanish" else int(args[1]) if len(args) > 1 else 1000
            return m.Dumped(rid, f"/dumps/{rid}.e3dump", size)
        if op == "save":
            nbytes = int(args[1]) if len(args) > 1 else 2000
            return m.Committed({self.rid(int(args[0])): oc.Saved("rows/x", nbytes, "crc32:0")})
        if op == "commit":
            return m.Committed({self.rid(int(args[0])): self.outcome(args[1:])})
        if op == "fail":
            i, error, how = int(args[0]), args[1], args[2]
            message = " ".join(args[3:]) or "it failed"
            return m.RequestFailed(self.rid(i), error, message, how == "retry")
        if op == "report":
            return m.ProducerReport(args[0], " ".join(args[1:]))
        return self.environment(op, args)

    def feed(self, idx: list[int]) -> m.Msg:
        """Every row but the last goes in at once; the last is the step's message."""
        for i in idx[:-1]:
            self.pending_out += self.ledger.handle(m.Fed(self.row(i)), self.now)
        return m.Fed(self.row(idx[-1]))

    def row(self, i: int) -> Sample:
        return Sample(i, list(range(self.tokens)), [1] * self.tokens)

    def environment(self, op: str, args: list[str]) -> m.Msg:
        led = self.ledger
        if op == "free":
            return m.DumpArea(int(args[0]))
        if op == "tick":
            return m.Tick(producer_up="down" not in args)
        if op == "pause":
            return m.Pause(EnvFault(AREAS[args[0]], "/out", int(args[1])))
        if op == "probe":
            ok, force = args[0] == "ok", "force" in args
            free = int(next((a for a in args[1:] if a.isdigit()), 10**12))
            results = [ProbeResult(p, ok, free) for p in led.probes_due(self.now, force=True)]
            return m.Probed(results, force)
        if op == "refuse":
            failed = [r for r in self.records if isinstance(r, ev.SampleFailed)]
            return m.Refused(failed[-1])
        raise ValueError(f"unknown step {op!r}")

    def rid(self, idx: int) -> str:
        return self.sent[idx][-1]

    def outcome(self, args: list[str]) -> oc.AnyOutcome:
        kind, message = getattr(oc, args[0]), f"{args[0]} happened"
        if kind is oc.WriteRefused:
            return oc.WriteRefused(int(args[1]), "/out/rows_0-2000", message)
        return kind(message)  # type: ignore[no-any-return]

    def summary(self, effects: list[fx.Effect]) -> list[str]:
        out: list[str] = []
        for e in effects:
            if isinstance(e, fx.Submit):
                r = e.request
                self.sent.setdefault(r.idx, []).append(r.rid)
                out.append(f"send {r.idx}" + (f"#{r.attempt}" if r.attempt > 1 else ""))
            elif isinstance(e, fx.Record):
                self.records.append(e.event)
                out += _record(e.event)
            elif isinstance(e, fx.Commit):
                out.append(f"commit {e.job.idx}")
            elif isinstance(e, fx.Cancel):
                out.append(f"cancel {_idx(e.rid)}")
            elif isinstance(e, fx.RemoveDump):
                out.append(f"remove {_idx(e.path.rsplit('/', 1)[1].removesuffix('.e3dump'))}")
            elif isinstance(e, fx.Orphan):
                out.append("orphan")
            elif isinstance(e, fx.Paused):
                out.append(f"paused {next(k for k, v in AREAS.items() if v == e.fault.area)}")
            elif isinstance(e, fx.Resumed):
                out.append("resumed")
            elif isinstance(e, fx.Finish):
                out.append("finish")
            elif isinstance(e, fx.StopFeed):
                out.append("stopfeed")
            elif isinstance(e, fx.Done):
                out.append(f"done {e.code}")
            else:
                out += _lifecycle(e)
        return out

    def check(self, want: dict[str, str]) -> None:
        led = self.ledger
        saved, failed = led.counts()
        got = {
            "saved": saved,
            "failed": failed,
            "inflight": len(led.inflight),
            "requeue": len(led.requeue),
            "retry": len(led.retry_commits),
            "queue": len(led.queue),
            "unrecorded": len(led.unrecorded),
            "paused": bool(led.paused),
            "stopping": bool(led.stopping),
            "done": led.done,
            "code": led.exit_code,
            "pending": sum(1 for i in led.ids if led.status[i] == PENDING),
        }
        for k, v in want.items():
            expected: object = v == "yes" if v in ("yes", "no") else int(v)
            assert got[k] == expected, f"{k}: {got[k]} != {v} ({got})"


def _idx(rid: str) -> int:
    return int(rid.removeprefix(PREFIX).split("-")[1])


def _lifecycle(e: fx.Effect) -> list[str]:
    if isinstance(e, fx.NotifyReady):
        return ["ready"]
    if isinstance(e, fx.Running):
        return [f"running {e.window}"]
    if isinstance(e, fx.Probe):
        return ["probe" + (" now" if e.force else "")]
    return []


def _record(e: ev.Event) -> list[str]:
    if isinstance(e, ev.SampleFailed):
        how = "env" if e.environment else ("retry" if e.retry else "final")
        return [f"failed {e.idx} {e.error} {how}"]
    if isinstance(e, ev.RunState):
        return ["draining" if e.state == "draining" else f"state {e.state}"]
    if isinstance(e, ev.ProducerEvent):
        return [f"producer {e.state}"]
    if isinstance(e, ev.RunStopped):
        return ["stopped"]
    if isinstance(e, ev.RunFinished):
        return ["finished"]
    return []


def play(steps: list[tuple[str, str]], **settings: Any) -> Driver:
    d = Driver(**settings)
    for line, want in steps:
        got = d.run(line)
        expected = [w.strip() for w in want.split(",") if w.strip()]
        assert got == expected, f"after {line!r}: {got} != {expected}"
    return d


# -- the window ---------------------------------------------------------------------------------

# fmt: off
WINDOW = {
    "a window of 2: two sent, one more per dump": ({"window": 2}, [
        ("feed 0 1 2 3", "send 0, send 1"),
        ("dump 0", "commit 0, send 2"),
        ("save 0", ""),
        ("dump 1", "commit 1, send 3"),
        ("check inflight=3 queue=0", ""),
    ]),
    "a request the producer started no longer waits in the window": ({"window": 2}, [
        ("feed 0 1 2 3 4", "send 0, send 1"),
        ("start 0 1", "send 2, send 3"),
        ("start 2", "send 4"),
    ]),
    "at most three windows in flight, committing included": ({"window": 1}, [
        ("feed 0 1 2 3 4", "send 0"),
        ("start 0", "send 1"),
        ("start 1", "send 2"),
        ("start 2", ""),
        ("dump 0", "commit 0"),
        ("save 0", "send 3"),
    ]),
    "the dump area's free space sizes the window": ({"window": 8}, [
        # 10 tokens at 100 bytes each: 1,000 bytes a dump; 80 % of 5,000 bytes is planned.
        ("free 5000", ""),
        ("feed 0 1 2 3 4 5", "send 0, send 1, send 2, send 3"),
        ("free 100000", "send 4, send 5"),
    ]),
    "one request always goes, however full the dump area": ({"window": 8}, [
        ("free 0", ""),
        ("feed 0 1", "send 0"),
        ("dump 0", "commit 0, send 1"),
    ]),
    "samples sent again go before the next rows": ({"window": 2}, [
        ("feed 0 1 2", "send 0, send 1"),
        ("fail 0 BadDump retry", "failed 0 BadDump retry, send 0#2"),
        ("dump 1", "commit 1, send 2"),
    ]),
    "a rejected row fails for good without a request": ({"window": 2}, [
        ("reject 0", "failed 0 bad_json final"),
        ("feed 1", "send 1"),
        ("check failed=1 inflight=1", ""),
    ]),
}
# fmt: on


@pytest.mark.parametrize(("settings", "steps"), WINDOW.values(), ids=WINDOW.keys())
def test_window(settings: dict[str, Any], steps: list[tuple[str, str]]) -> None:
    play(steps, **settings)


# -- attempts ---------------------------------------------------------------------------------

# fmt: off
ATTEMPTS = {
    "the sample's own failure is retried, then failed for good": ({"max_attempts": 2}, [
        ("feed 0 1", "send 0, send 1"),
        ("dump 0", "commit 0"),
        ("commit 0 BadDump", "remove 0, failed 0 BadDump retry, send 0#2"),
        ("dump 0", "commit 0"),
        ("commit 0 BadDump", "remove 0, failed 0 BadDump final"),
        ("check failed=1 inflight=1 requeue=0", ""),
    ]),
    "a failure the producer calls final is final at once": ({"max_attempts": 2}, [
        ("feed 0", "send 0"),
        ("fail 0 HTTP400 final too long", "failed 0 HTTP400 final"),
        ("check failed=1 inflight=0", ""),
    ]),
    "a worker killed from outside counts no attempt": ({"max_attempts": 2}, [
        ("feed 0", "send 0"),
        ("fail 0 ProducerCrashed retry worker 7 exited with code -15", "failed 0 ProducerCrashed env, send 0"),
        ("fail 0 ProducerCrashed retry worker 8 exited with code -9", "failed 0 ProducerCrashed env, send 0"),
        ("fail 0 ProducerCrashed retry worker 9 exited with code 1, computing a batch of 2: each is sent again alone", "failed 0 ProducerCrashed env, send 0"),
        ("fail 0 ProducerCrashed retry worker 9 exited with code 1, computing this sample alone", "failed 0 ProducerCrashed retry, send 0#2"),
    ]),
    "no live worker counts no attempt": ({"max_attempts": 2}, [
        ("feed 0", "send 0"),
        ("fail 0 ProducerDown retry no live worker", "failed 0 ProducerDown env, send 0"),
    ]),
    "a dump gone before it was read is resent, uncounted": ({"max_attempts": 2}, [
        ("feed 0", "send 0"),
        ("vanish 0", "failed 0 DumpLost env, send 0"),
        ("dump 0", "commit 0"),
        ("commit 0 DumpLost", "failed 0 DumpLost env, send 0"),
    ]),
    "a row directory removed under a commit is made again once": ({"max_attempts": 3}, [
        ("feed 0", "send 0"),
        ("dump 0", "commit 0"),
        ("commit 0 DirGone", "commit 0"),
        ("commit 0 DirGone", "failed 0 CommitError retry, send 0#2"),
    ]),
    "writing that fails for another reason is the sample's attempt": ({"max_attempts": 3}, [
        ("feed 0", "send 0"),
        ("dump 0", "commit 0"),
        ("commit 0 WriteFailed", "remove 0, failed 0 CommitError retry, send 0#2"),
        ("dump 0", "commit 0"),
        ("commit 0 Internal", "remove 0, failed 0 InternalError retry, send 0#3"),
    ]),
    "every send has its own request id; a late dump of an earlier one is an orphan": ({"max_attempts": 2}, [
        ("feed 0", "send 0"),
        ("fail 0 Aborted retry", "failed 0 Aborted retry, send 0#2"),
        ("late 0", "orphan"),
        ("dump 0", "commit 0"),
        ("dump 0", ""),  # the same dump seen again (the 5 s scan): nothing twice
    ]),
    "a saved sample's dump seen by a scan before the reaper removed it is no orphan": ({}, [
        ("feed 0 1", "send 0, send 1"),
        ("dump 0", "commit 0"),
        ("save 0", ""),  # its dump goes to the reaper
        ("dump 0", ""),  # the scan raced the reaper: its dump, not an orphan
        ("tick 60", ""),
        ("dump 0", ""),
        ("tick 61", ""),
        ("dump 0", "orphan"),  # the reaper had its chance and the dump is still there
    ]),
}
# fmt: on


@pytest.mark.parametrize(("settings", "steps"), ATTEMPTS.values(), ids=ATTEMPTS.keys())
def test_attempts(settings: dict[str, Any], steps: list[tuple[str, str]]) -> None:
    play(steps, **settings)


def test_request_ids_name_run_shard_session_sample_and_send() -> None:
    d = play([("feed 7", "send 7"), ("fail 7 Aborted retry", "failed 7 Aborted retry, send 7#2")])
    assert d.sent[7] == [f"{PREFIX}1-7-1", f"{PREFIX}1-7-2"]
    assert d.ledger.owns(d.sent[7][0]) and not d.ledger.owns("ffff0000-1-1-7-1")
    assert d.ledger.dumped("ffff0000-1-1-7-1", "/dumps/x.e3dump", 10, 0.0) == []  # another shard's


# -- timeouts -----------------------------------------------------------------------------------

# fmt: off
TIMEOUTS = {
    "no dump within the request timeout: cancelled and retried": ({"request_timeout": 10.0, "max_attempts": 2}, [
        ("feed 0 1", "send 0, send 1"),
        ("tick 5", ""),
        ("dump 1", "commit 1"),
        ("tick 6", "cancel 0, failed 0 Timeout retry, send 0#2"),
        ("tick 11", "cancel 0, failed 0 Timeout final"),
    ]),
    "a started request times out too": ({"request_timeout": 10.0, "max_attempts": 2}, [
        ("feed 0", "send 0"),
        ("start 0", ""),
        ("tick 11", "cancel 0, failed 0 Timeout retry, send 0#2"),
    ]),
    "while the producer is down the clocks start again": ({"request_timeout": 10.0, "max_attempts": 2}, [
        ("feed 0", "send 0"),
        ("tick 8 down", ""),
        ("tick 8 down", ""),
        ("tick 8", ""),
        ("tick 3", "cancel 0, failed 0 Timeout retry, send 0#2"),
    ]),
    "a committing sample never times out": ({"request_timeout": 10.0, "max_attempts": 2}, [
        ("feed 0", "send 0"),
        ("dump 0", "commit 0"),
        ("tick 60", ""),
        ("save 0", ""),
    ]),
}
# fmt: on


@pytest.mark.parametrize(("settings", "steps"), TIMEOUTS.values(), ids=TIMEOUTS.keys())
def test_timeouts(settings: dict[str, Any], steps: list[tuple[str, str]]) -> None:
    play(steps, **settings)


# -- pause and resume ------------------------------------------------------------------------

# fmt: off
PAUSES = {
    "a full output pauses; the commit waits and goes again on resume": ({"max_attempts": 2}, [
        ("feed 0 1 2 3", "send 0, send 1"),
        ("dump 0", "commit 0, send 2"),
        ("commit 0 WriteRefused 28", "paused output"),
        ("dump 1", "commit 1"),  # what is in flight still arrives, and is tried
        ("commit 1 WriteRefused 28", ""),  # the same area: no second pause record
        ("check paused=yes retry=2 inflight=3 queue=1", ""),
        ("probe no", ""),
        ("probe ok 1000", ""),  # a probe write went through, but no room for the sample
        ("probe ok", "resumed, commit 0, commit 1, send 3"),
        ("save 0", ""),
        ("save 1", ""),
        ("check saved=2 paused=no retry=0", ""),
    ]),
    "permission denied pauses; the probe alone decides": ({"max_attempts": 2}, [
        ("feed 0", "send 0"),
        ("dump 0", "commit 0"),
        ("commit 0 WriteRefused 13", "paused output"),
        ("probe ok 0", "resumed, commit 0"),
    ]),
    "a full dump area pauses, the sample waits uncounted and goes first on resume": ({"max_attempts": 2}, [
        ("feed 0 1 2", "send 0, send 1"),
        ("fail 0 DumpWriteError retry writing the dump failed: ENOSPC: No space left on device", "failed 0 DumpWriteError env, paused dumps"),
        ("dump 1", "commit 1"),
        ("check paused=yes requeue=1", ""),
        ("probe ok", "resumed, send 0, send 2"),
    ]),
    "a dump missing while the dump area was full is the area's fault, later the sample's": ({"max_attempts": 2}, [
        ("free 1000", ""),  # under 1 MiB: full
        ("feed 0 1", "send 0"),
        ("fail 0 DumpMissing retry no dump arrived", "failed 0 DumpMissing env, paused dumps"),
        ("free 100000000", ""),
        ("probe ok", "resumed, send 0, send 1"),
        ("tick 61", ""),
        ("fail 0 DumpMissing retry no dump arrived", "failed 0 DumpMissing retry, send 0#2"),
    ]),
    "the journal's own disk: the recorder's report pauses; refused commits wait": ({"max_attempts": 2}, [
        ("feed 0 1", "send 0, send 1"),
        ("dump 0", "commit 0"),
        ("pause journal 28", "paused journal"),
        ("commit 0 NotRecorded", ""),
        ("check retry=1", ""),
        ("probe ok", "resumed, commit 0"),
    ]),
    "two areas paused: the run resumes when both are back": ({"max_attempts": 2}, [
        ("feed 0 1", "send 0, send 1"),
        ("dump 0", "commit 0"),
        ("commit 0 WriteRefused 28", "paused output"),
        ("fail 1 DumpWriteError retry ENOSPC", "failed 1 DumpWriteError env"),
        ("check paused=yes requeue=1 retry=1", ""),
        ("probe ok", "resumed, commit 0, send 1"),
    ]),
    "a failure the journal refused is not counted, and is recorded after the resume": ({"max_attempts": 2}, [
        ("reject 3", "failed 3 bad_json final"),
        ("pause journal 28", "paused journal"),
        ("refuse", ""),
        ("check failed=0 unrecorded=1", ""),
        ("end", ""),
        ("check done=no", ""),
        ("probe ok", "resumed, failed 3 bad_json final, finish"),
        ("check failed=1 unrecorded=0", ""),
    ]),
    "nothing is sent while paused; fed rows wait": ({"max_attempts": 2}, [
        ("feed 0", "send 0"),
        ("dump 0", "commit 0"),
        ("commit 0 WriteRefused 5", "paused output"),
        ("feed 1 2", ""),
        ("check queue=2", ""),
    ]),
}
# fmt: on


@pytest.mark.parametrize(("settings", "steps"), PAUSES.values(), ids=PAUSES.keys())
def test_pauses(settings: dict[str, Any], steps: list[tuple[str, str]]) -> None:
    play(steps, **settings)


def test_probes_wait_their_interval_unless_forced() -> None:
    d = play(
        [
            ("feed 0", "send 0"),
            ("dump 0", "commit 0"),
            ("commit 0 WriteRefused 28", "paused output"),
        ]
    )
    led = d.ledger
    assert led.probes_due(0.5) == []  # probed every 2 s
    (probe,) = led.probes_due(2.5)
    assert (probe.area, probe.directory) == (OUTPUT, "/out/rows_0-2000")
    assert probe.need == 1 << 20  # room for the largest waiting sample, at least 1 MiB
    assert led.probes_due(2.6) == [] and len(led.probes_due(2.6, force=True)) == 1
    # A forced probe that fails says why; an unforced one stays quiet.
    out = led.probed([ProbeResult(probe, False, 0, "EACCES: Permission denied")], 3.0, force=True)
    assert [e.message for e in out if isinstance(e, fx.Log)] == [
        "still paused: disk full (ENOSPC) writing to the output /out/rows_0-2000: WriteRefused"
        " happened (EACCES: Permission denied)"
    ]
    assert led.probed([ProbeResult(probe, False, 0, "x")], 3.0) == []


# -- stop, end, and what the base's integration bug taught --------------------------------------

# fmt: off
ENDINGS = {
    "the run finishes when the feed ended and nothing is in flight": ({}, [
        ("feed 0 1", "send 0, send 1"),
        ("end", ""),
        ("dump 0", "commit 0"),
        ("save 0", ""),
        ("dump 1", "commit 1"),
        ("save 1", "finish"),
        ("finish", "finished, done 0"),
    ]),
    "every sample failed: exit 9": ({}, [
        ("reject 0", "failed 0 bad_json final"),
        ("reject 1", "failed 1 bad_json final"),
        ("end", "finish"),
        ("finish", "finished, done 9"),
    ]),
    "requeue after the end of input: the last sample, missing while the dump area was full": ({"window": 1}, [
        ("free 1000", ""),
        ("feed 0 1", "send 0"),
        ("end", ""),
        ("dump 0", "commit 0, send 1"),
        ("save 0", ""),
        ("fail 1 DumpMissing retry no dump arrived", "failed 1 DumpMissing env, paused dumps"),
        ("check requeue=1 done=no", ""),
        ("free 100000000", ""),
        ("probe ok", "resumed, send 1"),
        ("dump 1", "commit 1"),
        ("save 1", "finish"),
    ]),
    "requeue after the end of input, no pause": ({}, [
        ("feed 0", "send 0"),
        ("end", ""),
        ("fail 0 ProducerDown retry no live worker", "failed 0 ProducerDown env, send 0"),
        ("dump 0", "commit 0"),
        ("save 0", "finish"),
    ]),
    "a stop drains what is in flight, sends nothing more, and is resumable": ({}, [
        ("feed 0 1 2", "send 0, send 1"),
        ("stop", "stopfeed, draining"),
        ("dump 0", "commit 0"),
        ("save 0", ""),
        ("fail 1 BadDump retry", "failed 1 BadDump env, stopped, done 0"),
        ("check saved=1 failed=0 stopping=yes done=yes", ""),
    ]),
    "a stop with nothing in flight stops at once": ({}, [
        ("stop", "stopfeed, draining, stopped, done 0"),
    ]),
    "a second stop abandons what is in flight": ({}, [
        ("feed 0 1", "send 0, send 1"),
        ("stop", "stopfeed, draining"),
        ("stop", "stopped, done 0"),
        ("dump 0", "orphan"),  # an abandoned request's dump: removed, and journaled
    ]),
    "the drain's deadline abandons what is in flight": ({}, [
        ("feed 0", "send 0"),
        ("stop", "stopfeed, draining"),
        ("tick 30", ""),
        ("tick 31", "stopped, done 0"),
    ]),
    "a stop during a pause drops what waits for it (pending for the next run)": ({"window": 1}, [
        ("feed 0 1 2", "send 0"),
        ("dump 0", "commit 0, send 1"),
        ("commit 0 WriteRefused 28", "paused output"),
        ("fail 1 DumpWriteError retry ENOSPC", "failed 1 DumpWriteError env"),
        ("check retry=1 requeue=1 queue=1", ""),
        ("stop", "stopfeed, draining, stopped, done 0"),
        ("check pending=10 inflight=0 retry=0 requeue=0", ""),
    ]),
    "pause, then resume with uncounted failures, then a stop": ({}, [
        ("feed 0 1", "send 0, send 1"),
        ("fail 0 DumpWriteError retry ENOSPC", "failed 0 DumpWriteError env, paused dumps"),
        ("fail 1 ProducerCrashed retry exited with code -15", "failed 1 ProducerCrashed env"),
        ("check requeue=2", ""),
        ("probe ok", "resumed, send 0, send 1"),
        ("stop", "stopfeed, draining"),
        ("vanish 0", "failed 0 DumpLost env"),
        ("dump 1", "commit 1"),
        ("save 1", "stopped, done 0"),
    ]),
    "the output lost: exit 4 at once, nothing more journaled, never finished": ({}, [
        ("feed 0 1", "send 0, send 1"),
        ("end", ""),
        ("dump 0", "commit 0"),
        ("commit 0 OutputGone", "stopfeed, done 4"),
        ("fail 1 BadDump retry", ""),
        ("finish", ""),
        ("lose", ""),
    ]),
    "a dump that breaks the capture contract: exit 8 at once, no sample charged": ({}, [
        ("feed 0 1", "send 0, send 1"),
        ("dump 0", "commit 0"),
        ("commit 0 ContractBroken", "remove 0, stopfeed, stopped, done 8"),
        ("check failed=0 saved=0 pending=10 inflight=0 code=8", ""),
        ("fail 1 BadDump retry", ""),
        ("finish", ""),
    ]),
    "a journal failure no pause can cure: exit 1 at once": ({}, [
        ("feed 0", "send 0"),
        ("jfail", "stopfeed, done 1"),
        ("stop", ""),
    ]),
}
# fmt: on


@pytest.mark.parametrize(("settings", "steps"), ENDINGS.values(), ids=ENDINGS.keys())
def test_endings(settings: dict[str, Any], steps: list[tuple[str, str]]) -> None:
    play(steps, **settings)


# -- the lifecycle, from the journal's replay on -------------------------------------------------

LIFECYCLE = {
    "a replayed shard with nothing pending finishes at once": (
        {"n": 2, "done": "ss"},
        [
            ("replayed", "finished, ready, done 0"),
            ("check done=yes code=0", ""),
        ],
    ),
    "a finish already journaled is not journaled twice": (
        {"n": 2, "done": "ss"},
        [
            ("replayed finished", "ready, done 0"),
        ],
    ),
    "a replayed shard whose samples all failed exits 9 again": (
        {"n": 2, "done": "ff"},
        [
            ("replayed finished", "ready, done 9"),
        ],
    ),
    "a replayed shard with rows left goes on": (
        {"n": 2, "done": "s"},
        [
            ("replayed", ""),
            ("check done=no pending=1", ""),
        ],
    ),
    "the producer's reports wait for run_started": (
        {},
        [
            ("starting", "state loading"),
            ("report restarting worker 0 exited", ""),
            ("announced", "producer restarting"),
            ("report up", "producer up"),
        ],
    ),
    "rows fed before the producer is up wait, and go once it is": (
        {},
        [
            ("announced", ""),
            ("feed 0 1 2", ""),
            ("check queue=3 inflight=0", ""),
            ("up 2", "ready, state running, running 2, send 0, send 1"),
        ],
    ),
    "what came before the producer was up is handled once it is, in order": (
        {},
        [
            ("feed 0", ""),
            ("pause journal 28", ""),
            ("check paused=no", ""),
            ("up 2", "ready, state running, running 2, send 0, paused journal"),
        ],
    ),
    "a signal before run_started stops at once and journals nothing": (
        {},
        [
            ("feed 0", ""),
            ("stop", "stopfeed, done 0"),
            ("stop", ""),
            ("up 2", ""),  # a producer up after the stop starts nothing
            ("check stopping=yes done=yes inflight=0", ""),
        ],
    ),
    "a signal while the producer starts: run_stopped, exit 0": (
        {},
        [
            ("announced", ""),
            ("starting", "state loading"),
            ("stop", "stopfeed, stopped, done 0"),
        ],
    ),
    "a producer that fails to start stops the run with its exit status": (
        {},
        [
            ("announced", ""),
            ("startfail", "stopfeed, stopped, done 5"),
            ("up 2", ""),
        ],
    ),
    "a journal failure before the run: exit 1 at once": (
        {},
        [
            ("jfail", "stopfeed, done 1"),
        ],
    ),
    "SIGHUP: nothing to probe before the run, the paused areas at once during it": (
        {},
        [
            ("hup", ""),
            ("announced", ""),
            ("up 1", "ready, state running, running 1"),
            ("hup", ""),
            ("feed 0", "send 0"),
            ("dump 0", "commit 0"),
            ("commit 0 WriteRefused 28", "paused output"),
            ("hup", "probe now"),
        ],
    ),
    "a tick while paused asks for the probe writes when they are due": (
        {"up": True},
        [
            ("feed 0", "send 0"),
            ("dump 0", "commit 0"),
            ("commit 0 WriteRefused 28", "paused output"),
            ("tick 1", ""),
            ("tick 1.5", "probe"),
        ],
    ),
}


@pytest.mark.parametrize(("settings", "steps"), LIFECYCLE.values(), ids=LIFECYCLE.keys())
def test_lifecycle(settings: dict[str, Any], steps: list[tuple[str, str]]) -> None:
    play(steps, **{"up": False, **settings})


# -- each detail the summary leaves out, once -------------------------------------------------


def test_records_and_effects_in_full() -> None:
    d = Driver(n=3, window=2)
    led = d.ledger
    effects = led.fed(Sample(1, [5, 6, 7], [0, 1, 1], truncated=True), 2.0)
    assert effects[0] == fx.Taken()
    rec, submit = effects[1:]
    assert isinstance(rec, fx.Record) and isinstance(submit, fx.Submit)
    assert rec.event == ev.SampleSent(idx=1, rid=f"{PREFIX}1-1-1", attempt=1, tokens=3)
    assert (submit.request.input_ids, submit.request.sent_at) == ([5, 6, 7], 2.0)
    seen, dumped, commit = led.dumped(f"{PREFIX}1-1-1", "/dumps/a.e3dump", 600, 3.0)
    assert seen == fx.SeenDump(f"{PREFIX}1-1-1")
    assert isinstance(dumped, fx.Record) and dumped.event == ev.SampleDumped(
        idx=1, rid=f"{PREFIX}1-1-1", bytes=600
    )
    assert isinstance(commit, fx.Commit) and commit.job.dump_path == "/dumps/a.e3dump"
    assert led.bytes_per_token == 200.0  # the first dump replaces the estimate
    assert led.committed(commit.job.rid, oc.Saved("r", 900, "c"), 4.0) == []
    assert led.status[1] == SAVED and led.last_progress == 4.0 and led.largest_sample == 900


def test_a_failed_attempt_is_logged_with_its_reason() -> None:
    d = Driver(n=1, max_attempts=1)
    d.run("feed 0")
    d.run("fail 0 BadDump retry NaN in hidden_state")
    logs = [(e.level, e.message) for e in d.last if isinstance(e, fx.Log)]
    assert logs == [
        (
            logging.WARNING,
            "sample 0 failed for good after 1 attempt(s): BadDump: NaN in hidden_state",
        )
    ]
    assert d.ledger.status[0] == FAILED and d.ledger.last_progress == 0.0


def test_a_pause_is_said_and_journaled_once() -> None:
    d = Driver()
    d.run("feed 0 1")
    out = d.ledger.pause(EnvFault(JOURNAL, "/out/.eagle3d/journal", errno.ENOSPC), 1.0)
    assert [type(e) for e in out] == [fx.Log, fx.Paused]
    assert d.ledger.paused.startswith("disk full (ENOSPC) writing to the journal")
    assert d.ledger.phase == "paused" and d.ledger.idle
    assert d.ledger.pause(EnvFault(OUTPUT, "/out", errno.EACCES), 1.5) == []  # already paused


def test_a_row_handed_over_twice_is_refused_loudly() -> None:
    d = Driver()
    d.run("feed 0")
    out = d.ledger.fed(Sample(0, [1], [1]), 0.0)
    assert [e.message for e in out if isinstance(e, fx.Log)] == [
        "sample 0 handed over while already in flight; ignored"
    ]
    assert len(d.ledger.inflight) == 1


def test_the_watchdogs_view() -> None:
    d = Driver()
    assert d.ledger.idle  # nothing in flight before the feed ended: waiting for rows
    d.run("feed 0")
    assert not d.ledger.idle and d.ledger.phase == "running"
    d.run("end")
    d.run("stop")
    assert d.ledger.phase == "draining"


def _logs(effects: list[fx.Effect]) -> list[str]:
    return [e.message for e in effects if isinstance(e, fx.Log)]


def test_the_lifecycles_words_and_records() -> None:
    d = Driver(n=2, up=False)
    d.run("announced")
    d.run("stop")
    assert _logs(d.last) == ["SIGTERM before the pipeline started: stopping"]
    assert d.records == [ev.RunStopped(reason="signal SIGTERM while starting", exit_code=0)]
    assert fx.NotifyStopping() in d.last
    d = Driver(n=2, up=False)
    d.run("startfail")
    assert _logs(d.last) == ["producer hf failed to start: boom"]
    d = Driver(n=2, up=False)
    d.run("up 3")
    assert _logs(d.last) == ["producer synthetic up; window 3; dumps in /dumps"]
    assert d.ledger.rules.window == 3
    d = Driver(n=2, up=False)
    d.run("jfail")
    assert _logs(d.last) == [
        "journal failure before the run started: journal write failed: [Errno 9] Bad file descriptor"
    ]


def test_one_finish_wording_whether_finished_now_or_before() -> None:
    d = Driver(n=2, window=2)
    for line in ("feed 0", "end", "reject 1", "dump 0", "save 0", "finish"):
        d.run(line)
    now = _logs(d.last)
    d = Driver(n=2, up=False, done="sf")
    d.run("replayed")
    before = _logs(d.last)
    assert now == ["finished: saved 1 / 2 (50 %), 1 failed", now[1]]
    assert before == ["nothing to do: job already " + now[0], now[1]]
    assert now[1].startswith("too many samples failed: 1 of 2 sample(s) failed for good")
