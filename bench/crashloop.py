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

The checks use their **own reader** (``msgpack`` + ``zlib`` on the raw segment bytes, not
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

Exit status 0 when nothing was lost, duplicated, corrupt or unaccounted and every round ended
consistent; 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "daemon", "eagle3d", "data", "demo.jsonl")

# The on-disk format, restated here from the format description (not imported) so that this
# reader is independent of the daemon's code paths.
SEGMENT_MAGIC = b"E3DJRNL\x00"
HEADER_SIZE = 64
HEADER_BODY = struct.Struct("<8sIIII16sQQ")
FRAME_SEED = zlib.crc32(b"eagle3d-frame-v1")
MAX_RECORD = 8 << 20
GROUP = 2000
KNOWN_ROLES = {"system", "user", "assistant", "human", "gpt", "tool"}
TEMP_RE = re.compile(r"^\.data_(\d+)\.ckpt\.tmp-.+$")
DATA_RE = re.compile(r"^data_(\d+)\.ckpt$")


# -- the independent journal reader ---------------------------------------------------------


@dataclass
class JournalView:
    """What the journal says, read from raw bytes."""

    run_id: str = ""
    records: list[dict[str, Any]] = field(default_factory=list)
    segments: int = 0
    torn_tail: str = ""  # newest segment ends in a torn frame (a crash mid-append)
    problems: list[str] = field(default_factory=list)


def read_journal(jdir: str) -> JournalView:
    """Parse every ``*.e3j`` segment of one shard directory with msgpack and zlib."""
    view = JournalView()
    try:
        names = sorted(n for n in os.listdir(jdir) if n.endswith(".e3j"))
    except FileNotFoundError:
        return view
    expected_seq: int | None = None
    for k, name in enumerate(names):
        last = k == len(names) - 1
        with open(os.path.join(jdir, name), "rb") as f:
            data = f.read()
        view.segments += 1
        if len(data) < HEADER_SIZE:
            view.problems.append(f"{name}: header of {len(data)} bytes")
            break
        body = data[: HEADER_BODY.size]
        (hcrc,) = struct.unpack_from("<I", data, HEADER_BODY.size)
        magic, _ver, _si, _sc, _fl, run, first_seq, _created = HEADER_BODY.unpack(body)
        if magic != SEGMENT_MAGIC or zlib.crc32(body, FRAME_SEED) != hcrc:
            view.problems.append(f"{name}: bad segment header")
            break
        run_hex = run.hex()
        if not view.run_id:
            view.run_id = run_hex
        if run_hex != view.run_id:
            view.problems.append(f"{name}: segment of another run {run_hex}")
            break
        if expected_seq is not None and first_seq != expected_seq:
            view.problems.append(f"{name}: starts at seq {first_seq}, expected {expected_seq}")
            break
        seq = first_seq
        pos = HEADER_SIZE
        while len(data) - pos >= 8:
            crc, n = struct.unpack_from("<II", data, pos)
            end = pos + 8 + n
            if n == 0 or n > MAX_RECORD or end > len(data):
                break
            if zlib.crc32(data[pos + 4 : end], FRAME_SEED) != crc:
                break
            rec = msgpack.unpackb(data[pos + 8 : end], raw=False, strict_map_key=False)
            # Records omit fields equal to their defaults (seq 0, retry false, ...).
            if rec.get("seq", 0) != seq or rec.get("run", "") != view.run_id:
                view.problems.append(f"{name}@{pos}: seq {rec.get('seq', 0)} where {seq} expected")
                break
            view.records.append(rec)
            seq += 1
            pos = end
        expected_seq = seq
        if pos != len(data):
            rest = data[pos:]
            torn = (
                len(rest) < 8
                or not any(rest)
                or pos + 8 + struct.unpack_from("<I", data, pos + 4)[0] > len(data)
            )
            where = f"{name}@{pos}: {len(rest)} bytes after the last valid frame"
            if torn and last:
                view.torn_tail = where
            else:
                view.problems.append(("unrepaired torn tail " if torn else "corrupt ") + where)
                break
    return view


def journal_dirs(output: str) -> list[str]:
    root = os.path.join(output, ".eagle3d", "journal")
    try:
        return [os.path.join(root, n) for n in sorted(os.listdir(root)) if n.startswith("shard-")]
    except FileNotFoundError:
        return []


def file_crc(path: str) -> tuple[int, str]:
    crc = 0
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, f"crc32:{crc:08x}"


def relpath_of(idx: int) -> str:
    g = idx // GROUP * GROUP
    return f"rows_{g}-{g + GROUP}/data_{idx}.ckpt"


# -- the consistency check ------------------------------------------------------------------


@dataclass
class Check:
    """The outcome of checking one output directory."""

    saved: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    files_checked: int = 0
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    unaccounted: list[str] = field(default_factory=list)
    journal: list[str] = field(default_factory=list)
    resent: list[str] = field(default_factory=list)  # sent again with no failure journaled
    leftovers: list[int] = field(default_factory=list)  # renamed, not journaled: redone later
    temp_files: int = 0
    torn_tail: str = ""
    finished: bool = False
    burnt: list[int] = field(
        default_factory=list
    )  # valid samples failed for good (set by the loop)

    @property
    def bad(self) -> list[str]:
        return (
            self.lost + self.duplicated + self.corrupt + self.unaccounted + self.journal
            + self.resent
        )  # fmt: skip


def check_output(output: str) -> Check:
    """Check ``output`` against its journal, from the outside."""
    c = Check()
    saved: dict[int, dict[str, Any]] = {}
    inflight: set[int] = set()
    repaired: set[int] = set()  # taken back by a repair: their files were moved aside
    for jdir in journal_dirs(output):
        view = read_journal(jdir)
        c.journal += [f"{os.path.basename(jdir)}: {p}" for p in view.problems]
        if view.torn_tail:
            c.torn_tail = view.torn_tail
        # idx -> (attempt of its last send, whether a failure with a retry followed it), in
        # this session: a sample is sent again only after a journaled failure of its last
        # send; anything else is a sample sent twice. A counted failure makes the next
        # send attempt n + 1; a failure that was not the sample's own may resend attempt n.
        outstanding: dict[int, tuple[int, bool]] = {}
        for rec in view.records:
            kind = rec.get("kind")
            idx = int(rec.get("idx", 0))
            if kind == "sample_sent":
                attempt = int(rec.get("attempt", 1))
                last = outstanding.get(idx)
                if (last is None and attempt != 1) or (last is not None and not last[1]):
                    c.resent.append(
                        f"sample {idx}: attempt {attempt} sent (seq {rec.get('seq', 0)}) "
                        f"without a failed attempt {attempt - 1} before it"
                    )
                elif last is not None and attempt not in (last[0], last[0] + 1):
                    c.resent.append(f"sample {idx}: attempt {attempt} after attempt {last[0]}")
                outstanding[idx] = (attempt, False)
            elif kind == "sample_failed" and rec.get("retry", False) and idx in outstanding:
                outstanding[idx] = (outstanding[idx][0], True)
            elif kind == "run_started":
                outstanding.clear()
            # The latest record of a sample wins: a retry after a failure for good reopens
            # it (a new eagle3d retrying what an older one wrongly failed), and a repair
            # (sample_invalid) takes a saved sample back.
            if kind == "sample_saved":
                if idx in saved:
                    c.duplicated.append(f"sample {idx} saved twice (seq {rec.get('seq', 0)})")
                saved[idx] = rec
                c.failed.discard(idx)
            elif kind == "sample_invalid":
                saved.pop(idx, None)
                repaired.add(idx)
            elif kind == "sample_failed" and rec.get("retry", False):
                c.failed.discard(idx)
            elif kind == "sample_failed":
                c.failed.add(idx)
            elif kind == "sample_sent":
                inflight.add(idx)
            elif kind == "run_finished":
                c.finished = True
            elif kind == "run_started":
                c.finished = False
    c.saved = set(saved)
    both = c.saved & c.failed
    c.duplicated += [f"sample {i} both saved and failed" for i in sorted(both)]
    for idx, rec in sorted(saved.items()):
        if rec.get("path") != relpath_of(idx):
            c.corrupt.append(f"sample {idx}: record path {rec.get('path')!r}")
            continue
        path = os.path.join(output, rec["path"])
        try:
            size, crc = file_crc(path)
        except FileNotFoundError:
            c.lost.append(f"sample {idx}: {rec['path']} missing")
            continue
        c.files_checked += 1
        if size != rec.get("bytes") or crc != rec.get("checksum"):
            c.corrupt.append(
                f"sample {idx}: {size} bytes {crc}, record says {rec.get('bytes')} "
                f"{rec.get('checksum')}"
            )
    for d in sorted(os.listdir(output)) if os.path.isdir(output) else []:
        if not d.startswith("rows_"):
            continue
        for name in sorted(os.listdir(os.path.join(output, d))):
            if TEMP_RE.match(name):
                c.temp_files += 1
                continue
            m = DATA_RE.match(name)
            if m is None or relpath_of(int(m.group(1))) != f"{d}/{name}":
                c.unaccounted.append(f"{d}/{name}: not a sample file of this layout")
                continue
            idx = int(m.group(1))
            if idx in saved:
                continue
            if (idx in inflight or idx in repaired) and idx not in c.failed:
                c.leftovers.append(idx)
            else:
                c.unaccounted.append(f"{d}/{name}: no record in the journal")
    return c


# -- the dataset and what it should give ----------------------------------------------------


def expected_malformed(line: str) -> bool:
    """Our own reading of which lines must fail (bad JSON, no turns, unknown role)."""
    try:
        d = json.loads(line)
    except ValueError:
        return True
    if not isinstance(d, dict):
        return True
    if "input_ids" in d:
        return not d["input_ids"]
    turns = d.get("conversations", d.get("messages"))
    if not isinstance(turns, list) or not turns:
        return True
    for t in turns:
        role = t.get("role", t.get("from")) if isinstance(t, dict) else None
        if role not in KNOWN_ROLES:
            return True
    return False


def make_dataset(path: str, samples: int, source: str = DEMO) -> tuple[set[int], set[int]]:
    """Write the first ``samples`` lines of ``source`` (cycled); return (valid, malformed)."""
    with open(source, encoding="utf-8") as f:
        lines = [ln.rstrip("\n") for ln in f if ln.strip()]
    out = [lines[i % len(lines)] for i in range(samples)]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")
    bad = {i for i, ln in enumerate(out) if expected_malformed(ln)}
    return set(range(samples)) - bad, bad


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
    examples: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            self.lost + self.duplicated + self.corrupt + self.unaccounted + self.journal_problems
            + self.burnt + self.signal_stops_unclean
        ) == 0 and self.final_problems == 0  # fmt: skip

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

    def log(self, msg: str) -> None:
        if not self.args.quiet:
            print(f"[crashloop {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def build_model(self) -> None:
        if os.path.exists(os.path.join(self.model, "config.json")):
            return
        self.log(f"building the tiny model in {self.model}")
        subprocess.run(
            [sys.executable, "-m", "eagle3d", "tiny-model", self.model, "--layers", "4",
             "--hidden", "64"],
            check=True,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip

    def start(self, output: str, logpath: str) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable, "-m", "eagle3d", "run", "--model", self.model,
            "--dataset", self.dataset, "--output", output,
            "--dump-dir", output + ".dumps", "--socket", output + ".sock",
            *self.args.daemon_arg,
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "EAGLE3D_FAULT"}
        if self.args.fault:
            env["EAGLE3D_FAULT"] = self.args.fault
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
            if finished and self.s.kills >= a.kills:
                break
            if not a.keep:
                shutil.rmtree(output, ignore_errors=True)
                shutil.rmtree(output + ".dumps", ignore_errors=True)
        self.s.seconds = round(time.monotonic() - t0, 1)
        return self.s

    def one_round(self, output: str, rnd: int) -> bool:
        a = self.args
        while True:
            logpath = os.path.join(self.work, f"run-{self.s.runs + 1}.log")
            proc = self.start(output, logpath)
            if self.s.kills >= a.kills:
                final_rc = proc.wait(timeout=a.run_timeout)
                self.s.natural_exits += 1
                c = self.check(output, f"round {rnd} final run")
                if final_rc != 0:
                    self.s.final_problems += 1
                    self.s.examples.append(f"round {rnd}: final run exited {final_rc}")
                self.finish_round(output, c, rnd)
                return True
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
            if rc is not None:
                # The job finished before this kill: check it, and begin a fresh round.
                self.s.natural_exits += 1
                c = self.check(output, f"round {rnd} natural exit")
                if rc != 0:
                    self.s.final_problems += 1
                    self.s.examples.append(f"round {rnd}: run exited {rc}")
                self.finish_round(output, c, rnd)
                return True
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
            self.s.kills_by_phase[phase] = self.s.kills_by_phase.get(phase, 0) + 1
            c = self.check(output, f"kill {self.s.kills}")
            self.log(
                f"kill {self.s.kills}/{a.kills} ({phase} +{delay:.2f}s, "
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
    p.add_argument("--kills", type=int, default=50, help="SIGKILLs in all (default 50)")
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
        for e in s.examples:
            print("  " + e)
    return 0 if s.ok else 1


if __name__ == "__main__":
    sys.exit(main())
