#!/usr/bin/env python3
"""One commit thread's CPU per committed byte, by the calls it spends it in.

``Committer.commit_files`` (the daemon's fast path: all of a v2 dump but its states' blocks
read into the thread's buffer, its ids checked, its headers, mask and CRC fields put there,
written with ``O_DIRECT`` from the buffer with the states' blocks spliced from the dump
between, or with ``--pages mapped`` from a private mapping; with ``--layout safetensors`` a v1 dump read into its slot, checked for NaN/Inf and
CRC'd in cache-sized chunks, written with ``O_DIRECT``; then fdatasync'ed, renamed) over
``--samples`` dumps of ``--tokens`` x h``--hidden`` bfloat16 states (3 aux
layers) in /dev/shm, batches of 8, on this thread; each call of interest wrapped to add
its ``thread_time`` to a counter, "rest" the Python around them. The dumps are hard links
of one file (its pages stay in memory; the daemon reads every dump once, cold).

    .venv/bin/python bench/commit_calls.py [--samples 300] [--tokens 400] [--hidden 2048]
        [--layout sample|safetensors]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import mmap
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scratch import fresh_fs, scratch

ROOT = Path(__file__).resolve().parent.parent
SYSCALLS = (
    "pwrite",
    "splice",
    "fdatasync",
    "preadv",
    "fsync",
    "open",
    "rename",
    "close",
    "ftruncate",
)


class _Mmap:
    """The ``mmap`` module as the splice sees it, its ``mmap`` counted."""

    def __init__(self, counted: Callable[..., Any]) -> None:
        self.mmap = counted

    def __getattr__(self, name: str) -> Any:
        return getattr(mmap, name)


class _Os:
    """The ``os`` module as a store module sees it, with some calls counted."""

    def __init__(self, counted: dict[str, Callable[..., Any]]) -> None:
        self._counted = counted

    def __getattr__(self, name: str) -> Any:
        return self._counted.get(name) or getattr(os, name)


def _timed(f: Callable[..., Any], key: str, acc: collections.Counter[str]) -> Callable[..., Any]:
    def call(*a: Any, **k: Any) -> Any:
        t = time.thread_time()
        try:
            return f(*a, **k)
        finally:
            acc[key] += time.thread_time() - t

    return call


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--dir", default=str(ROOT / "bench"), help="where the output goes (its disk)")
    p.add_argument(
        "--dump-area",
        default="/dev/shm",
        help="where the dumps go: a tmpfs (mounted with huge=within_size for 2 MiB pages)",
    )
    p.add_argument("--layout", default="sample", choices=("sample", "safetensors"))
    p.add_argument(
        "--pages",
        default="spliced",
        choices=("spliced", "mapped"),
        help="a v2 dump's unchanged pages: spliced into the write, or written from the mapping",
    )
    p.add_argument(
        "--fresh-fs",
        action="store_true",
        help="the output on a new journaled ext4 in --dir (root; see scratch.fresh_fs)",
    )
    a = p.parse_args()
    from eagle3d.remote import samplefile
    from eagle3d.store import committer, directio, splice

    acc: collections.Counter[str] = collections.Counter()
    fake = _Os({n: _timed(getattr(os, n), n, acc) for n in SYSCALLS})
    for mod in (committer, splice, directio):
        mod.os = fake  # type: ignore[attr-defined]
    splice.finite = _timed(splice.finite, "NaN/Inf check", acc)  # type: ignore[assignment]
    splice.crc32 = _timed(splice.crc32, "CRC-32", acc)
    samplefile.crc32 = _timed(samplefile.crc32, "CRC-32 (seal)", acc)
    splice.mmap = _Mmap(_timed(mmap.mmap, "mmap", acc))  # type: ignore[assignment]
    splice.read_trailer = _timed(splice.read_trailer, "trailer", acc)
    splice._same_layout = _timed(splice._same_layout, "headers compared", acc)
    splice.Staged.close = _timed(splice.Staged.close, "staged close", acc)  # type: ignore[method-assign]
    from eagle3d.remote import storedtype
    from eagle3d.store.sizing import file_bytes_at_most

    size = 2 * a.samples * file_bytes_at_most(a.tokens, a.hidden, 3, storedtype.get("bfloat16"))
    disk = fresh_fs(a.dir, size + (2 << 30)) if a.fresh_fs else contextlib.nullcontext(a.dir)
    with disk as parent, scratch("bench-commit-calls-", a.dump_area, str(parent)) as (shm, out):
        cpu, gb = measure(a, shm, out, acc)
    print(f"{a.samples} samples, {gb:.2f} GB: {cpu:.3f} CPU-s, {cpu / gb:.3f} CPU-s/GB")
    for k, v in acc.most_common():
        print(f"  {k:16s} {v / gb:.3f} CPU-s/GB")
    print(f"  {'rest (Python)':16s} {(cpu - sum(acc.values())) / gb:.3f} CPU-s/GB")
    return 0


def measure(
    a: argparse.Namespace, shm: str, out: str, acc: collections.Counter[str]
) -> tuple[float, float]:
    """(CPU seconds, GB) of committing ``a.samples`` dumps made in ``shm`` into ``out``."""
    import torch
    from eagle3d.remote import storedtype
    from eagle3d.remote.dumpfile import write_dump
    from eagle3d.store import committer

    layers, t = [1, 2, 3], a.tokens
    ids = torch.randint(7, 500, (t,))
    aux = torch.randn(t, 3 * a.hidden).to(torch.bfloat16)
    hid = torch.randn(t, a.hidden).to(torch.bfloat16)
    one = write_dump(shm, "template", ids, aux, hid, layers, layout=a.layout)
    for i in range(a.samples):
        os.link(one, f"{shm}/d{i}.e3dump")
    c = committer.Committer(out, store=storedtype.get("bfloat16"), writer="archive", splice=True)
    c.splice_pages = a.pages == "spliced"
    c.warm_up()
    gc.freeze()  # as the daemon does after its start: its collections skip what is loaded
    acc.clear()
    sent, mask = ids.tolist(), [1] * t
    t0 = time.thread_time()
    for b in range(0, a.samples, 8):
        batch = [(i, sent, mask, f"{shm}/d{i}.e3dump") for i in range(b, min(a.samples, b + 8))]
        bad = [r for r in c.commit_files(batch, a.hidden, layers) if isinstance(r, Exception)]
        assert not bad, bad
    cpu = time.thread_time() - t0
    c.rows.close()  # its folders' descriptors: the output's filesystem may be unmounted
    return cpu, a.samples * committed_bytes(out, one) / 1e9


def committed_bytes(out: str, dump: str) -> int:
    """A committed sample file's size (the dumps are alike): not the dump's, which has a
    trailer (v2) or another layout (v1)."""
    for root, _dirs, files in os.walk(out):
        for f in files:
            if f.endswith(".ckpt"):
                return os.path.getsize(os.path.join(root, f))
    raise FileNotFoundError(f"no sample file under {out} (dump {dump})")


if __name__ == "__main__":
    sys.exit(main())
