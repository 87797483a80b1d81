"""File faults for the crash loop (issue 26): what users do to the files around a running job.

``bench/crashloop.py --file-faults F`` injects one of these at a seeded random moment of a run
(after its first new ``sample_saved`` record, plus up to ``--commit-window`` s):

* ``rewritten``: the dataset rewritten in place (same inode) with other content: a line more
  at its top, so that every later line sits one id further (the issue's shifted ids);
* ``truncated``: the dataset cut in the middle of a line;
* ``appended``: lines appended to the dataset;
* ``rows_removed``: a row folder removed (``rm -rf``, atomically: renamed away, then deleted);
* ``worker_oom``: ``EAGLE3D_FAULT=worker_oom:T`` with a random ``T`` above any one sample's
  tokens: a batch of more than ``T`` tokens fails its allocation (a real MemoryError);
* ``clock_forward`` / ``clock_back``: the daemon's wall clock (its workers' too) stepped 1 h
  forward or back, through libfaketime (``FAKETIME_TIMESTAMP_FILE``, re-read on every call;
  the monotonic clock untouched, as a real step leaves it). Never the machine's clock.

The dataset and row-folder faults must stop the run (exit 6 / exit 4) before anything from the
changed content is committed and without ``run_finished``; the loop then does what a user
would (restore the dataset; ``eagle3d verify --repair``) and runs the same command again.
Worker and clock faults must change nothing a check can see: the run goes on, is then killed
as usual or finishes.
"""

from __future__ import annotations

import os
import random
import shutil
from typing import Any

from crashcheck import journal_dirs, read_journal

DATASET = ("rewritten", "truncated", "appended")
STOPPING = (*DATASET, "rows_removed")
KINDS = (*STOPPING, "worker_oom", "clock_forward", "clock_back")
#: The exit status a stopping fault must end the run with.
EXPECTED_EXIT = {"rewritten": 6, "truncated": 6, "appended": 6, "rows_removed": 4}
#: Above the demo dataset's longest sample (865 tokens with the tiny model's tokenizer): a
#: sample alone always fits, a batch of several often does not.
OOM_TOKENS = (900, 1600)
FAKETIME_LIBS = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/faketime/libfaketimeMT.so.1",
    "/usr/local/lib/faketime/libfaketimeMT.so.1",
)


def parse_kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k for k in text.split(",") if k)
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise SystemExit(f"--file-fault-kinds: {sorted(unknown)} not in {', '.join(KINDS)}")
    return kinds


def faketime_lib() -> str:
    for path in FAKETIME_LIBS:
        if os.path.exists(path):
            return path
    raise SystemExit("clock faults need libfaketime (apt-get install faketime)")


def clock_env(stepfile: str) -> dict[str, str]:
    """The environment that puts a daemon's wall clock under ``stepfile``'s offset."""
    with open(stepfile, "w") as f:
        f.write("+0\n")
    return {
        "LD_PRELOAD": faketime_lib(),
        "FAKETIME_TIMESTAMP_FILE": stepfile,
        "FAKETIME_NO_CACHE": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


def step_clock(stepfile: str, kind: str) -> str:
    offset = "+1h" if kind == "clock_forward" else "-1h"
    with open(stepfile, "w") as f:
        f.write(offset + "\n")
    return f"clock stepped {offset}"


def oom_spec(rng: random.Random) -> str:
    return f"worker_oom:{rng.randint(*OOM_TOKENS)}"


def change_dataset(path: str, kind: str, original: bytes, rng: random.Random) -> str:
    """Change the dataset at ``path`` the way ``kind`` says; return what was done."""
    lines = original.splitlines(keepends=True)
    if kind == "rewritten":  # cat other.jsonl > data.jsonl: same inode, other content
        new = lines[rng.randrange(len(lines))] + original
        with open(path, "r+b") as f:
            f.truncate(0)
            f.write(new)
        return f"rewritten in place ({len(new)} bytes, every line one id further)"
    if kind == "truncated":
        cut = rng.randrange(len(original) // 4, len(original) - 2)
        while b"\n" in original[cut - 1 : cut + 1] and cut < len(original) - 2:  # mid-line
            cut += 1
        os.truncate(path, cut)
        return f"truncated to {cut} of {len(original)} bytes (mid-line)"
    more = b"".join(rng.choice(lines) for _ in range(rng.randint(1, 20)))
    with open(path, "ab") as f:
        f.write(more)
    return f"{len(more)} bytes appended"


def restore_dataset(path: str, original: bytes) -> None:
    """What the user does: the original content back, in place."""
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(original)


def remove_rows(output: str, rng: random.Random, n: int) -> str:
    """``rm -rf`` of one row folder, atomically (a tree walk would race with the commits)."""
    rows = sorted(d for d in os.listdir(output) if d.startswith("rows_"))
    if not rows:
        return ""
    victim = rng.choice(rows)
    gone = f"{output}.gone-{n}"
    os.rename(os.path.join(output, victim), gone)
    shutil.rmtree(gone, ignore_errors=True)
    return f"{victim} removed"


def saved_paths(output: str) -> dict[int, str]:
    """Each sample the journal says is saved, with its path (our own reader)."""
    saved: dict[int, str] = {}
    for jdir in journal_dirs(output):
        for rec in read_journal(jdir).records:
            idx = int(rec.get("idx", 0))
            if rec.get("kind") == "sample_saved":
                saved[idx] = str(rec.get("path", ""))
            elif rec.get("kind") == "sample_invalid":
                saved.pop(idx, None)
    return saved


class MixedCheck:
    """Saved samples whose token ids are not those of their line in the original dataset.

    The expected ids come from the daemon's own encoder on the original lines (the check is
    that what is saved under id ``i`` is line ``i`` of the content the job was started on)."""

    def __init__(self, model: str, dataset: bytes) -> None:
        self.model = model
        self.lines = dataset.splitlines()
        self.want: dict[int, list[int]] = {}
        self.enc: Any = None

    def expected(self, idx: int) -> list[int]:
        if idx not in self.want:
            from eagle3d.ingest.dataformats import parse_row

            if self.enc is None:
                from eagle3d.ingest.chat import ChatEncoder
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(self.model, local_files_only=True)
                self.enc = ChatEncoder(tok, max_length=2048)
            row = parse_row(idx, self.lines[idx])
            self.want[idx] = list(self.enc.encode(row).input_ids)
        return self.want[idx]

    def mixed(self, output: str) -> list[str]:
        from eagle3d.reader import load_sample

        bad = []
        for idx, rel in sorted(saved_paths(output).items()):
            path = os.path.join(output, rel)
            if not os.path.exists(path):
                continue  # lost (a removed folder): the checker's count, not this one
            got = load_sample(path)["input_ids"].tolist()
            if idx >= len(self.lines) or got != self.expected(idx):
                bad.append(f"sample {idx}: saved token ids are not line {idx + 1}'s")
        return bad
