"""The one daemon harness: datasets (cut from the demo, or generated), running the real daemon,
reading its journal, checking its output.

Every run is a real ``python -m eagle3d run`` subprocess on the tiny model. The checks use the
crash loop's independent checker (:mod:`crashcheck`) and ``eagle3d verify``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crashcheck
from eagle3proto import events as ev
from eagle3proto import paths
from eagle3proto.journalread import iter_events

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "daemon" / "eagle3d" / "data" / "demo.jsonl"


#: Demo lines that must fail: bad JSON, an unknown role, no turns.
MALFORMED_DEMO_LINES = (41, 142, 263)


def dataset(path: Path, n: int, malformed: bool = True) -> tuple[set[int], set[int]]:
    """The first ``n`` demo lines (plus, by default, the demo's three malformed lines) at
    ``path``; returns (valid ids, malformed ids) as the crash-loop classifier sees them."""
    lines = DEMO.read_text(encoding="utf-8").splitlines()
    picked = lines[:n] + ([lines[i] for i in MALFORMED_DEMO_LINES] if malformed else [])
    path.write_text("\n".join(picked) + "\n", encoding="utf-8")
    bad = {i for i, ln in enumerate(picked) if crashcheck.expected_malformed(ln)}
    return set(range(len(picked))) - bad, bad


#: The daemon's environment: offline, and no tokenizer threads beside the workers.
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def env_without_faults(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in ENV.items() if k != "EAGLE3D_FAULT"}
    env.update(extra)
    return env


#: The fault tests' datasets carry the demo's three malformed lines among 3 to 60 good ones
#: on purpose (up to 50 %): over the daemon's default --max-failed-fraction (5 %), which
#: would make a finished run exit 9. A test of that threshold passes its own value.
FAILED_FRACTION = ("--max-failed-fraction", "0.5")


def run_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "eagle3d",
        "run",
        "--model",
        str(model),
        "--dataset",
        str(data),
        "--output",
        str(out),
        "--dump-dir",
        f"{out}.dumps",
        "--socket",
        f"{out}.sock",
        *FAILED_FRACTION,
        *extra,
    ]


def run(
    model: Path,
    data: Path,
    out: Path,
    *extra: str,
    fault: str = "",
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the daemon to its end; ``fault`` sets ``EAGLE3D_FAULT``."""
    e = env_without_faults() if env is None else env
    if fault:
        e["EAGLE3D_FAULT"] = fault
    return subprocess.run(
        run_args(model, data, out, *extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=e,
        start_new_session=True,
    )


def start(
    model: Path,
    data: Path,
    out: Path,
    *extra: str,
    fault: str = "",
    log: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start the daemon in a session of its own, its output to ``log`` (default
    ``OUT.log``, see :func:`log_of`); ``env`` adds to its environment."""
    e = env_without_faults(**(env or {}))
    if fault:
        e["EAGLE3D_FAULT"] = fault
    logf = open(log or f"{out}.log", "wb")  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen(
            run_args(model, data, out, *extra),
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=e,
            start_new_session=True,
        )
    finally:
        logf.close()


@contextlib.contextmanager
def reaped(proc: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    """A daemon started by :func:`start`, killed with its whole process group (workers
    included) if the block leaves it running, so a failed test leaves no processes behind."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def verify(out: Path) -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-m", "eagle3d", "verify", "--output", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    rep: dict[str, Any] = json.loads(r.stdout)
    rep["_rc"] = r.returncode
    return rep


def check(out: Path) -> Any:
    """The independent check (``crashcheck.Check``)."""
    return crashcheck.check_output(str(out))


def records(out: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """Every record of every shard, read by the independent reader."""
    recs: list[dict[str, Any]] = []
    for jdir in crashcheck.journal_dirs(str(out)):
        recs += crashcheck.read_journal(jdir).records
    return [r for r in recs if kind is None or r.get("kind") == kind]


def assert_complete(out: Path, valid: set[int], malformed: set[int]) -> Any:
    """The job finished consistently: every valid sample saved once, the rest failed."""
    c = check(out)
    assert not c.bad, c.bad
    assert c.saved == valid, (sorted(valid - c.saved), sorted(c.saved - valid))
    assert c.failed == malformed
    assert not c.leftovers and c.temp_files == 0
    assert c.finished
    rep = verify(out)
    assert rep["_rc"] == 0 and rep["ok"] and rep["checked"] == len(valid), rep
    return c


def exit_code(proc: subprocess.Popen[bytes], timeout: float, log: Path) -> int:
    """``proc``'s exit status; a daemon still running after ``timeout`` seconds fails the test
    with the end of its log (a bare ``TimeoutExpired`` says nothing of where it stood)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"still running after {timeout} s; its log ends:\n{log.read_text()[-4000:]}"
        ) from None


def wait_for(pred: Any, timeout: float, what: str, step: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def log_of(out: Path) -> str:
    """What a daemon started by :func:`start` for ``out`` has printed so far."""
    try:
        return Path(f"{out}.log").read_text(errors="replace")
    except FileNotFoundError:
        return ""


def conversations(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` varied multi-turn conversations in the three accepted chat formats."""
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "the",
        "model",
        "computes",
        "hidden",
        "states",
        "for",
        "every",
        "token",
    ]
    out: list[dict[str, Any]] = []
    for i in range(n):
        turns = 1 + (i + seed) % 3
        msgs: list[dict[str, str]] = []
        if i % 4 == 0:
            msgs.append({"role": "system", "content": "You are terse."})
        for t in range(turns):
            k = 3 + (i * 7 + t * 5 + seed) % 40
            msgs.append(
                {"role": "user", "content": " ".join(words[(i + j) % len(words)] for j in range(k))}
            )
            msgs.append(
                {"role": "assistant", "content": f"answer {i}.{t}: " + " ".join(words[: 2 + k % 9])}
            )
        if i % 3 == 0:
            out.append({"messages": msgs})
        elif i % 3 == 1:
            out.append({"conversations": msgs})
        else:
            share = {"system": "system", "user": "human", "assistant": "gpt"}
            out.append(
                {"conversations": [{"from": share[m["role"]], "value": m["content"]} for m in msgs]}
            )
    return out


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """Write rows; a str row is written verbatim (for malformed lines)."""
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def events(output: Path, shard: paths.Shard | None = None) -> list[ev.AnyEvent]:
    evs, rep = iter_events(paths.journal_dir(str(output), shard or paths.Shard()))
    assert not rep.stopped_early, rep.problems
    return evs


def wait_for_saved(output: Path, n: int, proc: subprocess.Popen[str], timeout: float = 90) -> None:
    """Wait until the journal holds at least ``n`` saved records (or the process ends)."""
    deadline = time.monotonic() + timeout
    jdir = paths.journal_dir(str(output), paths.Shard())
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.isdir(jdir):
            evs, _ = iter_events(jdir)
            if sum(isinstance(e, ev.SampleSaved) for e in evs) >= n:
                return
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} samples saved in {timeout} s (exit {proc.poll()})")


def thread_names(pid: int) -> set[str]:
    """The kernel names of process ``pid``'s live threads (what ``top -H`` shows)."""
    names = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            names.add((task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return names
