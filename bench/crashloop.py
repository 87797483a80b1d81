#!/usr/bin/env python3
"""Crash-loop harness: SIGKILL ``eagle3d run`` at random moments and check the output each time.

A parent process runs ``eagle3d run`` (a real subprocess, the tiny model, a dataset of a few
hundred lines), kills it with SIGKILL after a seeded random delay, checks the output from the
outside, and starts it again: ``--kills N`` times, then it lets the job finish. When a job
finishes before the kills are used up, a fresh output directory starts the next *round*.

With ``--signal-fraction F``, that share of the kills is instead a SIGINT or a SIGTERM to the
daemon's whole process group (its workers included), as a terminal's Ctrl-C, Slurm's
``scancel`` or a container stop deliver them: the daemon must drain and exit 0 by itself,
and no sample may be *burnt* (recorded failed for good although its line is valid).

With ``--file-faults F``, that share of the runs gets a *file fault* instead of a plain kill
(``bench/filefaults.py``, issue 26): the dataset rewritten in place, truncated mid-line or
appended to, or a row folder removed, at a random moment (the daemon frozen with SIGSTOP while
it is done, so that the moment is known to precede any ``run_finished``): the run must stop
with exit 6 / exit 4, nothing from the changed content committed (*mixed*: a saved sample's
token ids that are not those of its line in the original dataset) and no ``run_finished``
while committed files are missing (*false finished*); then the loop restores the dataset or
runs ``eagle3d verify --repair`` and runs the same command again. Or a worker's allocation
failing (``worker_oom``) or the daemon's wall clock stepped 1 h forward or back
(libfaketime): the run goes on to a kill as usual, and every check must hold.

The checks (``tests/crashcheck.py``) use their **own reader** (``msgpack`` + ``zlib`` on the raw segment bytes, not
eagle3proto's code) and the filesystem, after every kill:

* every sample with a ``sample_saved`` record has a complete file whose size and CRC-32
  (``crc32:%08x`` of the whole file) match the record (else *lost* or *corrupt*);
* no sample is saved twice (*duplicated*);
* every ``rows_*/`` entry is accounted for by the journal: a saved sample, or a sample the
  journal shows in flight (a commit that was renamed but not yet journaled, redone on
  resume); temp files ``.data_*.ckpt.tmp-*`` aside (*unaccounted* otherwise);
* the journal is a clean sequence of valid frames, with at most a torn tail in its newest
  segment.

At the end of each round: exactly the valid lines are saved, the malformed ones failed, no
leftover or temp file remains, and ``eagle3d verify`` agrees.

Usage::

    .venv/bin/python bench/crashloop.py --kills 50 --seed 1234 [--samples 300] [--json]

Exit status 0 when nothing was lost, duplicated, corrupt, unaccounted, burnt or mixed, no
run falsely finished, every fault ended its run as it must, and every round ended consistent;
1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)

from crashcheck import (  # the independent checker
    Check,
    check_output,
    journal_dirs,
    make_dataset,
    read_journal,
)
from filefaults import (  # what users do to the files around a run (issue 26)
    DATASET,
    EXPECTED_EXIT,
    KINDS,
    STOPPING,
    MixedCheck,
    change_dataset,
    clock_env,
    oom_spec,
    parse_kinds,
    remove_rows,
    restore_dataset,
    step_clock,
)

# -- the loop -------------------------------------------------------------------------------


@dataclass
class Summary:
    seed: int
    kills_wanted: int
    samples: int
    rounds: int = 0
    runs: int = 0
    kills: int = 0
    kills_daemon_only: int = 0
    kills_process_group: int = 0
    kills_by_phase: dict[str, int] = field(default_factory=dict)
    signals_int: int = 0  # SIGINT to the process group (a terminal's Ctrl-C)
    signals_term: int = 0  # SIGTERM to the process group (scancel, kill -- -PGID)
    signal_stops_unclean: int = 0  # a signalled daemon that did not exit 0 by itself
    burnt: int = 0
    natural_exits: int = 0
    checks: int = 0
    samples_checked: int = 0
    leftovers_redone: int = 0
    temp_files_seen: int = 0
    torn_tails_seen: int = 0
    lost: int = 0
    duplicated: int = 0
    corrupt: int = 0
    unaccounted: int = 0
    journal_problems: int = 0
    final_problems: int = 0
    # --file-faults (bench/filefaults.py)
    file_faults: int = 0
    file_faults_by_kind: dict[str, int] = field(default_factory=dict)
    fault_outcomes: dict[str, int] = field(default_factory=dict)  # "kind: outcome"
    fault_stops: int = 0  # runs a dataset or row-folder fault stopped (count as kills)
    repairs: int = 0  # eagle3d verify --repair after a removed row folder
    mixed: int = 0  # saved token ids that are not those of their line's original content
    false_finished: int = 0  # run_finished recorded while committed files were missing
    fault_problems: int = 0  # a fault that did not end the run as it must
    examples: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            self.lost
            + self.duplicated
            + self.corrupt
            + self.unaccounted
            + self.journal_problems
            + self.burnt
            + self.signal_stops_unclean
            + self.mixed
            + self.false_finished
            + self.fault_problems
        ) == 0 and self.final_problems == 0

    def note(self, msg: str) -> None:
        if len(self.examples) < 20:
            self.examples.append(msg)

    def add(self, c: Check, label: str) -> None:
        self.checks += 1
        self.samples_checked += c.files_checked
        self.temp_files_seen += c.temp_files
        self.torn_tails_seen += bool(c.torn_tail)
        self.lost += len(c.lost)
        self.duplicated += len(c.duplicated)
        self.corrupt += len(c.corrupt)
        self.unaccounted += len(c.unaccounted)
        self.journal_problems += len(c.journal)
        self.burnt += len(c.burnt)
        for msg in [
            *c.bad[:5],
            *(f"sample {i} burnt (valid, failed for good)" for i in c.burnt[:5]),
        ]:
            if len(self.examples) < 20:
                self.examples.append(f"{label}: {msg}")


class CrashLoop:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.work = args.workdir or tempfile.mkdtemp(prefix="eagle3d-crashloop-")
        os.makedirs(self.work, exist_ok=True)
        self.s = Summary(seed=args.seed, kills_wanted=args.kills, samples=args.samples)
        self.dataset = os.path.join(self.work, "data.jsonl")
        self.valid, self.malformed = make_dataset(self.dataset, args.samples)
        self.model = args.model or os.path.join(self.work, "model")
        with open(self.dataset, "rb") as f:
            self.original = f.read()
        self.kinds = parse_kinds(args.file_fault_kinds)
        self.stepfile = os.path.join(self.work, "clock.step")
        self.mixed_check = MixedCheck(self.model, self.original) if args.file_faults else None

    def log(self, msg: str) -> None:
        if not self.args.quiet:
            print(f"[crashloop {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def build_model(self) -> None:
        if os.path.exists(os.path.join(self.model, "config.json")):
            return
        self.log(f"building the tiny model in {self.model}")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "eagle3d",
                "tiny-model",
                self.model,
                "--layers",
                "4",
                "--hidden",
                "64",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )

    def start(self, output: str, logpath: str, fault: str = "") -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable,
            "-m",
            "eagle3d",
            "run",
            "--model",
            self.model,
            "--dataset",
            self.dataset,
            "--output",
            output,
            "--dump-dir",
            output + ".dumps",
            "--socket",
            output + ".sock",
            *self.args.daemon_arg,
        ]
        env = {k: v for k, v in os.environ.items() if k != "EAGLE3D_FAULT"}
        faults = [f for f in self.args.fault.split(",") if f]
        if fault.startswith("clock"):
            # libfaketime (0.9.10) with a true monotonic clock makes time.sleep fail with
            # EINVAL (clock_nanosleep); worker_slow's rest is such a sleep, the daemon has none.
            faults = [f for f in faults if not f.startswith("worker_slow")]
        if fault == "worker_oom":
            faults.append(oom_spec(self.rng))
        if faults:
            env["EAGLE3D_FAULT"] = ",".join(faults)
        if fault.startswith("clock"):
            env.update(clock_env(self.stepfile))
        self.s.runs += 1
        with open(logpath, "wb") as logf:
            return subprocess.Popen(
                cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )

    def check(self, output: str, label: str) -> Check:
        c = check_output(output)
        c.burnt = sorted(c.failed - self.malformed)
        self.s.add(c, label)
        self.s.leftovers_redone += len(c.leftovers)
        return c

    def finish_round(self, output: str, c: Check, rnd: int) -> None:
        """A round ended with a clean exit: everything valid saved, the rest failed."""
        problems = []
        if c.saved != self.valid:
            missing = sorted(self.valid - c.saved)
            extra = sorted(c.saved - self.valid)
            problems.append(f"saved set differs: missing {missing[:10]} extra {extra[:10]}")
        if c.failed != self.malformed:
            problems.append(f"failed {sorted(c.failed)} != malformed {sorted(self.malformed)}")
        if c.leftovers or c.temp_files:
            problems.append(f"{len(c.leftovers)} leftover and {c.temp_files} temp file(s)")
        if not c.finished:
            problems.append("no run_finished record after the last session")
        v = subprocess.run(
            [sys.executable, "-m", "eagle3d", "verify", "--output", output, "--json"],
            capture_output=True,
            text=True,
        )
        try:
            rep = json.loads(v.stdout)
            if v.returncode != 0 or not rep.get("ok") or rep.get("checked") != len(self.valid):
                problems.append(f"verify rc {v.returncode}: {rep.get('problems')}")
        except ValueError:
            problems.append(f"verify rc {v.returncode}: {v.stdout[-300:]} {v.stderr[-300:]}")
        self.s.final_problems += len(problems)
        self.s.examples += [f"round {rnd} final: {p}" for p in problems][:5]
        self.count_mixed(output, f"round {rnd} final")
        self.log(
            f"round {rnd} done: {len(c.saved)} saved, {len(c.failed)} failed, "
            f"{'OK' if not problems else 'PROBLEMS: ' + '; '.join(problems)}"
        )

    def run(self) -> Summary:
        t0 = time.monotonic()
        a = self.args
        self.log(f"seed {a.seed}; {a.kills} kills; {a.samples} samples; work dir {self.work}")
        self.build_model()
        rnd = 0
        while True:
            rnd += 1
            self.s.rounds = rnd
            output = os.path.join(self.work, f"out-{rnd}")
            finished = self.one_round(output, rnd)
            if finished and self.events() >= a.kills:
                break
            if not a.keep:
                shutil.rmtree(output, ignore_errors=True)
                shutil.rmtree(output + ".dumps", ignore_errors=True)
        self.s.seconds = round(time.monotonic() - t0, 1)
        return self.s

    def events(self) -> int:
        """Runs stopped so far: kills and signals, and runs a file fault stopped."""
        return self.s.kills + self.s.fault_stops

    def pick_fault(self) -> str:
        """A file fault for the next run (``--file-faults`` of them), or none."""
        a = self.args
        if not a.file_faults or self.events() >= a.kills or self.rng.random() >= a.file_faults:
            return ""
        return self.rng.choice(self.kinds)

    def one_round(self, output: str, rnd: int) -> bool:
        a = self.args
        while True:
            logpath = os.path.join(self.work, f"run-{self.s.runs + 1}.log")
            fault = self.pick_fault()
            proc = self.start(output, logpath, fault)
            if self.events() >= a.kills:
                final_rc = proc.wait(timeout=a.run_timeout)
                self.natural_end(output, final_rc, rnd, "final run")
                return True
            verdict, rc = ("kill", None)
            if fault:
                verdict, rc = self.file_fault(proc, output, logpath, fault, rnd)
            if verdict == "next":
                continue
            if verdict == "kill":
                rc = self.kill_at_random(proc, output, logpath)
            if rc is not None:
                # The job finished before this kill: check it, and begin a fresh round.
                self.natural_end(output, rc, rnd, "natural exit")
                return True

    def natural_end(self, output: str, rc: int, rnd: int, how: str) -> None:
        self.s.natural_exits += 1
        c = self.check(output, f"round {rnd} {how}")
        if rc != 0:
            self.s.final_problems += 1
            self.s.examples.append(f"round {rnd}: {how} exited {rc}")
        self.finish_round(output, c, rnd)

    def kill_at_random(
        self, proc: subprocess.Popen[bytes], output: str, logpath: str
    ) -> int | None:
        """Kill or signal the run at a random moment; its exit status if it ended first."""
        a = self.args
        whole_group = self.rng.random() < a.group_fraction
        sig = 0
        if self.rng.random() < a.signal_fraction:
            # SIGINT or SIGTERM to the whole group, any time after the daemon is up far
            # enough to have opened its journal (before that there is nothing to lose).
            sig = self.rng.choice([signal.SIGINT, signal.SIGTERM])
            phase, delay = "signal", self.rng.uniform(0.0, a.max_delay)
            # Most while the producer works (samples in flight), some while it starts.
            at = b" up; window " if self.rng.random() < 0.75 else b" shard shard-"
            rc = _wait_log(proc, logpath, at, a.run_timeout)
            if rc is None:
                rc = _wait(proc, delay)
        elif self.rng.random() < a.startup_fraction:
            # A kill while the daemon starts: journal recovery, temp cleanup, orphans.
            phase, delay = "start", self.rng.uniform(0.2, a.startup_window)
            rc = _wait(proc, delay)
        elif self.rng.random() < a.commit_fraction:
            # A kill among commits: wait for this run's first new saved record, then a
            # random moment more (kills of a slow first batch alone would starve the job).
            phase, delay = "commit", self.rng.uniform(0.0, a.commit_window)
            rc = _wait_saved(proc, output, len(check_output(output).saved), a.run_timeout)
            if rc is None:
                rc = _wait(proc, delay)
        else:
            # A kill while it works: wait for the producer, then a random moment more.
            phase, delay = "work", self.rng.uniform(0.0, a.max_delay)
            rc = _wait_ready(proc, logpath, a.run_timeout)
            if rc is None:
                rc = _wait(proc, delay)
        if rc is None:
            self.deliver(proc, output, logpath, sig, whole_group, f"{phase} +{delay:.2f}s")
        return rc

    def deliver(
        self,
        proc: subprocess.Popen[bytes],
        output: str,
        logpath: str,
        sig: int,
        whole_group: bool,
        when: str,
    ) -> None:
        """Send the kill or signal, wait for the daemon to go, and check the output."""
        a = self.args
        if sig:
            os.killpg(proc.pid, sig)
            if sig == signal.SIGINT:
                self.s.signals_int += 1
            else:
                self.s.signals_term += 1
            src = _wait(proc, a.drain_timeout)
            if src != 0:
                self.s.signal_stops_unclean += 1
                self.s.examples.append(
                    f"signal {signal.Signals(sig).name}: daemon exit {src} (log {logpath})"
                )
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        elif whole_group:
            os.killpg(proc.pid, signal.SIGKILL)
            self.s.kills_process_group += 1
        else:
            proc.send_signal(signal.SIGKILL)
            self.s.kills_daemon_only += 1
        proc.wait()
        self.s.kills += 1
        phase = when.split(" ")[0]
        self.s.kills_by_phase[phase] = self.s.kills_by_phase.get(phase, 0) + 1
        c = self.check(output, f"kill {self.s.kills}")
        self.log(
            f"kill {self.s.kills}/{a.kills} ({when}, "
            f"{signal.Signals(sig).name if sig else 'group' if whole_group else 'daemon'}): "
            f"{len(c.saved)} saved, "
            f"{len(c.failed)} failed, {len(c.leftovers)} leftover, {c.temp_files} temp"
            f"{', torn tail' if c.torn_tail else ''}"
            f"{'' if not c.bad else ' PROBLEMS: ' + '; '.join(c.bad[:3])}"
            f"{'' if not c.burnt else f' BURNT: {c.burnt[:10]}'}"
        )
        # An orphaned worker of a daemon-only kill sees its stdin close and exits after
        # its batch; give it a moment so that runs do not pile up on a small machine.
        _reap_group(proc.pid, 5.0)

    # -- file faults (--file-faults; bench/filefaults.py) ------------------------------------

    def outcome(self, kind: str, what: str) -> None:
        key = f"{kind}: {what}"
        self.s.fault_outcomes[key] = self.s.fault_outcomes.get(key, 0) + 1

    def file_fault(
        self, proc: subprocess.Popen[bytes], output: str, logpath: str, kind: str, rnd: int
    ) -> tuple[str, int | None]:
        """Inject ``kind`` at a random moment of this run. Returns ``("next", None)`` when
        it stopped the run as it must (situation restored: run again), ``("kill", None)``
        when the run goes on to a kill as usual, ``("exit", rc)`` when it ended first."""
        a = self.args
        self.s.file_faults += 1
        self.s.file_faults_by_kind[kind] = self.s.file_faults_by_kind.get(kind, 0) + 1
        if kind == "worker_oom":  # armed from the start (EAGLE3D_FAULT): fires on big batches
            self.outcome(kind, "armed; the run went on to a kill or its end")
            return "kill", None
        rc = _wait_saved(proc, output, len(check_output(output).saved), a.run_timeout)
        if rc is None:
            rc = _wait(proc, self.rng.uniform(0.0, a.commit_window))
        if rc is not None:
            self.outcome(kind, "not injected: the run ended first")
            return "exit", rc
        if kind in STOPPING:
            return self.stopping_fault(proc, output, logpath, kind, rnd)
        self.log(f"fault {self.s.file_faults} ({kind}): {step_clock(self.stepfile, kind)}")
        self.outcome(kind, "stepped; the run went on to a kill or its end")
        return "kill", None

    def stopping_fault(
        self, proc: subprocess.Popen[bytes], output: str, logpath: str, kind: str, rnd: int
    ) -> tuple[str, int | None]:
        """A dataset or row-folder fault: the run must stop with its exit code, unmixed and
        not finished; then the user's fix, and the same command runs again."""
        # Frozen while we look and change: no run_finished can slip in between.
        os.killpg(proc.pid, signal.SIGSTOP)
        try:
            what = ""
            if not check_output(output).finished:
                what = self.inject(output, kind)
        finally:
            os.killpg(proc.pid, signal.SIGCONT)
        if not what:
            self.outcome(kind, "not injected: the run had finished")
            return "exit", proc.wait(timeout=self.args.run_timeout)
        rc = _wait(proc, self.args.drain_timeout)
        if rc is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        _reap_group(proc.pid, 5.0)
        self.judge_stop(output, logpath, kind, rc, f"round {rnd} fault {self.s.file_faults}")
        self.log(f"fault {self.s.file_faults} ({kind}: {what}): exit {rc}")
        return "next", None

    def inject(self, output: str, kind: str) -> str:
        if kind == "rows_removed":
            return remove_rows(output, self.rng, self.s.file_faults)
        return change_dataset(self.dataset, kind, self.original, self.rng)

    def judge_stop(self, output: str, logpath: str, kind: str, rc: int, label: str) -> None:
        """The outcome of a stopping fault, then the user's fix and the usual checks."""
        want = EXPECTED_EXIT[kind]
        self.outcome(kind, f"exit {rc}")
        if rc != want:
            self.s.fault_problems += 1
            self.s.note(f"{label}: {kind} ended the run with exit {rc}, not {want} ({logpath})")
        before = check_output(output)
        if before.finished and before.lost:
            self.s.false_finished += 1
            self.s.note(f"{label}: run_finished with {len(before.lost)} committed files gone")
        if kind in DATASET:
            self.count_mixed(output, label)
            restore_dataset(self.dataset, self.original)
        else:
            self.repair(output, label)
        self.s.fault_stops += 1
        self.check(output, label)

    def count_mixed(self, output: str, label: str) -> None:
        if self.mixed_check is None:
            return
        mixed = self.mixed_check.mixed(output)
        self.s.mixed += len(mixed)
        for m in mixed[:3]:
            self.s.note(f"{label}: MIXED {m}")

    def repair(self, output: str, label: str) -> None:
        """What the refusal tells the user to do: ``eagle3d verify --repair``."""
        v = subprocess.run(
            [sys.executable, "-m", "eagle3d", "verify", "--output", output, "--repair"],
            capture_output=True,
            text=True,
        )
        self.s.repairs += 1
        if v.returncode not in (0, 1):
            self.s.fault_problems += 1
            self.s.note(f"{label}: verify --repair exit {v.returncode}: {v.stdout[-300:]}")


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def _wait_ready(proc: subprocess.Popen[bytes], logpath: str, timeout: float) -> int | None:
    """Wait until the daemon logs that its producer is up (timing only, never checked)."""
    return _wait_log(proc, logpath, b" up; window ", timeout)


def _wait_log(
    proc: subprocess.Popen[bytes], logpath: str, needle: bytes, timeout: float
) -> int | None:
    """Wait until the daemon's log holds ``needle`` (timing only, never checked)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rc = proc.poll()
        if rc is not None:
            return rc
        with open(logpath, "rb") as f:
            if needle in f.read():
                return None
        time.sleep(0.1)
    return None


def _wait_saved(
    proc: subprocess.Popen[bytes], output: str, before: int, timeout: float
) -> int | None:
    """Wait until the journal holds more saved records than ``before`` (our own reader)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rc = proc.poll()
        if rc is not None:
            return rc
        n = sum(
            1
            for jdir in journal_dirs(output)
            for r in read_journal(jdir).records
            if r.get("kind") == "sample_saved"
        )
        if n > before:
            return None
        time.sleep(0.05)
    return None


def _reap_group(pgid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--kills",
        type=int,
        default=50,
        help="SIGKILLs (and signals, and runs a file fault stopped) in all (default 50)",
    )
    p.add_argument("--seed", type=int, default=None, help="random seed (printed; default: time)")
    p.add_argument("--samples", type=int, default=300, help="dataset lines (demo.jsonl, cycled)")
    p.add_argument("--model", help="tiny model dir (default: build one in the work dir)")
    p.add_argument("--workdir", help="where outputs and logs go (default: a new temp dir)")
    p.add_argument(
        "--startup-fraction",
        type=float,
        default=0.2,
        help="share of kills aimed at start-up (uniform in 0.2..--startup-window s)",
    )
    p.add_argument("--startup-window", type=float, default=5.0)
    p.add_argument(
        "--commit-fraction",
        type=float,
        default=0.6,
        help="of the other kills, the share aimed at commits: uniform in 0..--commit-window s "
        "after the run's first new saved record",
    )
    p.add_argument("--commit-window", type=float, default=3.0)
    p.add_argument(
        "--max-delay",
        type=float,
        default=6.0,
        help="other kills: uniform in 0..this many s after the producer is up",
    )
    p.add_argument(
        "--group-fraction",
        type=float,
        default=0.5,
        help="share of kills that hit the whole process group (daemon + workers)",
    )
    p.add_argument(
        "--signal-fraction",
        type=float,
        default=0.0,
        help="share of the kills that are a SIGINT or SIGTERM to the whole process group "
        "instead (uniform in 0..--max-delay s after the producer is up, or for a quarter "
        "of them after the journal is open); the daemon must "
        "drain and exit 0, and no valid sample may fail",
    )
    p.add_argument("--drain-timeout", type=float, default=120.0, help="for a signalled daemon")
    p.add_argument(
        "--daemon-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for eagle3d run (repeat: --daemon-arg=--batch-tokens "
        "--daemon-arg=512)",
    )
    p.add_argument("--fault", default="", help="EAGLE3D_FAULT for every run (worker_slow:MS)")
    p.add_argument(
        "--file-faults",
        type=float,
        default=0.0,
        help="share of the runs that get a file fault instead of a plain kill (see "
        "bench/filefaults.py): the dataset rewritten, truncated or appended, a row folder "
        "removed, a worker's allocation failing, the daemon's clock stepped 1 h; a run it "
        "stops counts toward --kills",
    )
    p.add_argument(
        "--file-fault-kinds",
        default=",".join(KINDS),
        help=f"the file faults to draw from (default: all of {','.join(KINDS)})",
    )
    p.add_argument("--run-timeout", type=float, default=600.0)
    p.add_argument("--keep", action="store_true", help="keep each round's output")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.seed is None:
        args.seed = int(time.time()) % 100000
    print(f"crashloop seed {args.seed}", flush=True)
    s = CrashLoop(args).run()
    d = asdict(s)
    d["ok"] = s.ok
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        print(
            f"seed {s.seed}: {s.rounds} round(s), {s.runs} runs, {s.kills} kills "
            f"({s.kills_daemon_only} daemon only, {s.kills_process_group} process group; "
            f"by phase {s.kills_by_phase}), "
            f"{s.signals_int} SIGINT + {s.signals_term} SIGTERM to the group "
            f"({s.signal_stops_unclean} unclean stops), "
            f"{s.checks} checks, {s.samples_checked} sample files checked, "
            f"{s.leftovers_redone} uncommitted leftovers seen, {s.torn_tails_seen} torn tails; "
            f"lost {s.lost} / duplicated {s.duplicated} / corrupt {s.corrupt} / "
            f"unaccounted {s.unaccounted} / burnt {s.burnt} / journal problems {s.journal_problems} / "
            f"final problems {s.final_problems} in {s.seconds:.0f} s: "
            f"{'OK' if s.ok else 'FAILED'}"
        )
        if s.file_faults:
            print(
                f"  file faults {s.file_faults} {s.file_faults_by_kind}: "
                f"{s.fault_stops} runs stopped, {s.repairs} repairs; "
                f"mixed {s.mixed} / false finished {s.false_finished} / "
                f"fault problems {s.fault_problems}; outcomes {s.fault_outcomes}"
            )
        for e in s.examples:
            print("  " + e)
    return 0 if s.ok else 1


if __name__ == "__main__":
    sys.exit(main())
