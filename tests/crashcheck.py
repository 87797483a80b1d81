"""The crash loop's independent checker: an output and its journal read from the outside.

It uses its **own reader** (``msgpack`` + ``zlib`` on the raw segment bytes, not eagle3proto's
code) and the filesystem (what each check means: ``bench/crashloop.py``'s docstring). The
crash loop (``bench/crashloop.py``) and the fault tests (``runkit``) import it from here;
nothing under ``tests/`` imports ``bench/``.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zlib
from dataclasses import dataclass, field
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
            self.lost
            + self.duplicated
            + self.corrupt
            + self.unaccounted
            + self.journal
            + self.resent
        )


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
    # Sample files are written under a temp name in the shard's staging folder, then
    # renamed into their row folder (older versions wrote the temp file in the row folder).
    staging = os.path.join(output, ".eagle3d", "staging")
    for shard in sorted(os.listdir(staging)) if os.path.isdir(staging) else []:
        names = os.listdir(os.path.join(staging, shard))
        c.temp_files += sum(1 for name in names if TEMP_RE.match(name))
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
