"""Helpers for tests that run the real ``eagle3d`` daemon as a process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from eagle3proto import events as ev
from eagle3proto import paths
from eagle3proto.journalread import iter_events

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


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


def run_args(model: Path, dataset: Path, output: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "eagle3d",
        "run",
        "--model",
        str(model),
        "--dataset",
        str(dataset),
        "--output",
        str(output),
        "--dump-dir",
        str(output.parent / (output.name + "-dumps")),
        "--socket",
        str(output.parent / (output.name + ".sock")),
        # Datasets here carry a few malformed lines on purpose (up to 10 %): more than the
        # daemon's default --max-failed-fraction (5 %), which would make the run exit 9.
        "--max-failed-fraction",
        "0.5",
        *extra,
    ]


def run(
    model: Path, dataset: Path, output: Path, *extra: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        run_args(model, dataset, output, *extra),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start(
    model: Path, dataset: Path, output: Path, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        run_args(model, dataset, output, *extra),
        env={**ENV, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


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
