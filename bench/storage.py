"""Storage figures of issue #21: what fp8 files weigh and cost, and what ``plan`` foresees.

Five parts, each with its baseline in the same run:

* ``bytes``: bytes per token of the sample files the commit writes, bfloat16 against fp8,
  at a real model's shape (H=4096, three captured layers; T=256 and 1024) and on the tiny
  model's demo run (H=64, where ids and mask weigh more);
* ``error``: fp8's error per tensor against the bfloat16 states: the demo run's fp8 files
  read back with :func:`eagle3d.reader.load_sample` against its bfloat16 files (the same
  forward), and the quantization alone on heavy-tailed states (a few "massive activation"
  channels per token, as real LLMs have), one scale per token (the format) and one per
  captured layer (the finer granularity not taken);
* ``cpu``: the commit thread's CPU per sample (``Committer.commit_files`` in batches of 8
  from bfloat16 dumps in /dev/shm, thread CPU time) storing fp8 against storing bfloat16,
  interleaved rounds;
* ``plan``: ``eagle3d plan --json`` before ``eagle3d run`` on the demo dataset with the tiny
  model, bfloat16 and fp8, against what the run then wrote (``du`` of the output, and the
  journal's file bytes), exact and sampled;
* ``plan-time``: ``eagle3d plan`` on a 100,000-line dataset (the demo's conversations
  repeated), with its default sample and tokenizing every row, against reading and parsing
  the same lines alone.

    flock /tmp/eagle3d-bench.lock .venv/bin/python bench/storage.py [PART ...] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
LAYERS = [2, 16, 29]


def eagle3d(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [sys.executable, "-m", "eagle3d", *args], env=ENV, capture_output=True, text=True
    )
    if check and r.returncode != 0:
        raise SystemExit(f"eagle3d {args[0]} exited {r.returncode}:\n{r.stderr[-3000:]}")
    return r


def demo_dataset() -> str:
    from importlib import resources

    return str(resources.files("eagle3d").joinpath("data/demo.jsonl"))


def run_job(model: Path, out: Path, dtype: str, dataset: str) -> None:
    shutil.rmtree(out, ignore_errors=True)
    eagle3d(
        "run",
        "--model",
        str(model),
        "--dataset",
        dataset,
        "--output",
        str(out),
        "--dump-dir",
        str(out) + "-dumps",
        "--socket",
        str(out) + ".sock",
        "--store-dtype",
        dtype,
    )


def saved(out: Path) -> list[Any]:
    from eagle3d.store import catalog

    return list(catalog.read(str(out)).entries)


def du(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def apparent(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def dumps_of(shm: str, tokens: int, hidden: int, n: int) -> list[str]:
    import torch
    from eagle3d.remote.dumpfile import write_dump

    g = torch.Generator().manual_seed(tokens)
    aux = torch.randn(tokens, 3 * hidden, generator=g).to(torch.bfloat16)
    hid = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    ids = torch.arange(tokens)
    return [write_dump(shm, f"t{tokens}-{i}", ids, aux, hid, LAYERS) for i in range(n)]


def commit_batch(c: Any, paths: list[str], tokens: int, hidden: int) -> list[Any]:
    from eagle3d.store.committer import Committed

    ids, mask = list(range(tokens)), [1] * tokens
    done = c.commit_files([(i, ids, mask, p) for i, p in enumerate(paths)], hidden, LAYERS)
    assert all(isinstance(r, Committed) for r in done), done
    return list(done)


def part_bytes(base: Path, demo: dict[str, Path]) -> list[str]:
    from eagle3d.remote import storedtype
    from eagle3d.store.committer import Committer

    rows = ["| sample | bfloat16 B/token | fp8 B/token | fp8 / bfloat16 |", "|---|---|---|---|"]
    shm = tempfile.mkdtemp(prefix="bench-storage-", dir="/dev/shm")
    try:
        for tokens in (256, 1024):
            paths = dumps_of(shm, tokens, 4096, 1)
            per: dict[str, float] = {}
            for name in ("bfloat16", "fp8"):
                out = base / f"bytes-{name}"
                c = Committer(str(out), store=storedtype.get(name))
                (r,) = commit_batch(c, paths, tokens, 4096)
                per[name] = os.path.getsize(out / r.relpath) / tokens
                shutil.rmtree(out)
            rows.append(
                f"| T={tokens}, H=4096, 3 layers (files the commit wrote) | {per['bfloat16']:,.1f}"
                f" | {per['fp8']:,.1f} | **{per['fp8'] / per['bfloat16']:.3f}** |"
            )
            for p in paths:
                os.unlink(p)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    per = {}
    for name, out in demo.items():
        entries = saved(out)
        per[name] = sum(e.bytes for e in entries) / sum(e.tokens for e in entries)
    rows.append(
        f"| the demo run ({len(saved(demo['bfloat16']))} samples, tiny model H=64, journal bytes)"
        f" | {per['bfloat16']:,.1f} | {per['fp8']:,.1f} | {per['fp8'] / per['bfloat16']:.3f} |"
    )
    return rows


def errors(ref: Any, got: Any) -> tuple[float, float]:
    """(relative norm, max abs error / max |ref|) of ``got`` against ``ref``."""
    r, g = ref.float(), got.float()
    d = (g - r).abs()
    return float(d.norm() / r.norm()), float(d.max() / r.abs().max())


def part_error(demo: dict[str, Path]) -> list[str]:
    import torch
    from eagle3d.reader import load_sample
    from eagle3d.store import catalog, fp8

    rows = [
        "| states | tensor | relative norm error, median (worst) | max error / max abs, median (worst) |",
        "|---|---|---|---|",
    ]
    cat = {k: catalog.read(str(v)) for k, v in demo.items()}
    bf = {e.idx: e for e in cat["bfloat16"].entries}
    got: dict[str, list[tuple[float, float]]] = {}
    for e in cat["fp8"].entries:
        if e.idx not in bf:
            continue
        a = load_sample(cat["bfloat16"].path(bf[e.idx]))
        b = load_sample(cat["fp8"].path(e))
        for key in ("hidden_state", "aux_hidden_state"):
            got.setdefault(key, []).append(errors(a[key], b[key]))
        for groups in (1, 3):  # the format, and one scale per captured layer
            q, s = fp8.quantize(a["aux_hidden_state"], groups)
            deq = fp8.dequantize(q, s, torch.float32)
            got.setdefault(f"groups {groups}", []).append(errors(a["aux_hidden_state"], deq))

    def cell(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 100:.2f} % ({max(xs) * 100:.2f} %)"

    n = len(got["hidden_state"])
    for key in ("hidden_state", "aux_hidden_state"):
        xs = got[key]
        rows.append(
            f"| the demo run's fp8 files read back (bf16) against its bf16 files, {n} samples "
            f"| `{key}` | {cell([x[0] for x in xs])} | {cell([x[1] for x in xs])} |"
        )
    for groups, what in ((1, "one scale per token (the format)"), (3, "one per captured layer")):
        xs = got[f"groups {groups}"]
        rows.append(
            f"| the demo run's bf16 states quantized (float32 result), {what} "
            f"| `aux_hidden_state` | {cell([x[0] for x in xs])} | {cell([x[1] for x in xs])} |"
        )
    # Heavy-tailed rows: N(0, 1) with 2 of every 4096 channels at 1,000x in each layer.
    g = torch.Generator().manual_seed(0)
    per_layer = []
    for _ in range(3):
        x = torch.randn(1024, 4096, generator=g)
        x[:, torch.randint(0, 4096, (2,), generator=g)] *= 1000.0
        per_layer.append(x)
    aux = torch.cat(per_layer, dim=1).to(torch.bfloat16)
    for groups, what in ((1, "one scale per token (the format)"), (3, "one per captured layer")):
        q, s = fp8.quantize(aux, groups)
        deq = fp8.dequantize(q, s, torch.float32)
        whole = errors(aux, deq)
        # The error on the ordinary channels (all but the outliers), the ones that lose
        # digits when a row's scale is set by an outlier.
        mask = aux.float().abs() < 100
        rel = float(((deq - aux.float()) * mask).norm() / (aux.float() * mask).norm())
        rows.append(
            f"| heavy-tailed T=1024 x 3x4096 (2 channels per layer at 1,000x), {what} "
            f"| `aux_hidden_state` | {whole[0] * 100:.2f} % (ordinary channels: {rel * 100:.2f} %)"
            f" | {whole[1] * 100:.2f} % |"
        )
    return rows


def part_cpu(base: Path, rounds: int) -> list[str]:
    import torch
    from eagle3d.remote import storedtype
    from eagle3d.store.committer import Committer

    torch.set_num_threads(1)  # as in the daemon's commit threads
    rows = [
        "| sample | bfloat16 ms CPU per sample | fp8 | fp8 / bfloat16 (each round) |",
        "|---|---|---|---|",
    ]
    shm = tempfile.mkdtemp(prefix="bench-storage-", dir="/dev/shm")
    try:
        for tokens, hidden, batches in ((400, 128, 12), (1024, 4096, 3)):
            paths = dumps_of(shm, tokens, hidden, 8)
            got: dict[str, list[float]] = {"bfloat16": [], "fp8": []}
            for r in range(rounds):
                order = ("bfloat16", "fp8") if r % 2 == 0 else ("fp8", "bfloat16")
                for name in order:
                    out = base / f"cpu-{name}"
                    c = Committer(str(out), store=storedtype.get(name))
                    c.warm_up()
                    commit_batch(c, paths, tokens, hidden)  # warm: directories, buffers
                    cpu = 0.0
                    for _ in range(batches):
                        t = time.thread_time()
                        commit_batch(c, paths, tokens, hidden)
                        cpu += time.thread_time() - t
                    got[name].append(cpu / (batches * len(paths)) * 1000)
                    shutil.rmtree(out)
            each = [f / b for f, b in zip(got["fp8"], got["bfloat16"], strict=True)]
            mb = tokens * hidden * 4 * 2 / 1e6
            rows.append(
                f"| T={tokens}, H={hidden} ({mb:.1f} MB of bf16 states) "
                f"| {statistics.median(got['bfloat16']):.2f} | {statistics.median(got['fp8']):.2f} "
                f"| **{statistics.median(each):.2f}** ({', '.join(f'{x:.2f}' for x in each)}) |"
            )
            for p in paths:
                os.unlink(p)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return rows


def plan_json(model: Path, out: Path, dtype: str, dataset: str, *extra: str) -> dict[str, Any]:
    r = eagle3d(
        "plan",
        "--model",
        str(model),
        "--dataset",
        dataset,
        "--output",
        str(out),
        "--store-dtype",
        dtype,
        "--json",
        *extra,
    )
    result: dict[str, Any] = json.loads(r.stdout)
    return result


def part_plan(model: Path, base: Path, demo: dict[str, Path]) -> list[str]:
    rows = [
        "| store dtype | plan (how) | planned bytes | written (`du`; apparent) | plan / du |",
        "|---|---|---|---|---|",
    ]
    for dtype, out in demo.items():
        fresh = base / f"fresh-{dtype}"
        written, app = du(out), apparent(out)
        files = sum(e.bytes for e in saved(out))
        for how, extra in (("every row", ()), ("a sample of 50 rows", ("--sample", "50"))):
            p = plan_json(model, fresh, dtype, demo_dataset(), *extra)
            note = ""
            if extra:
                note = f", 95 % bound ±{p['bound_bytes']:,}"
            else:
                assert p["shards"][0]["files_bytes"] == files, (p, files)
                note = ", sample files exact"
            rows.append(
                f"| {dtype} | {how}{note} | {p['bytes']:,} | {written:,}; {app:,} "
                f"| **{p['bytes'] / written:.3f}** |"
            )
    return rows


def part_plan_time(model: Path, base: Path, rounds: int) -> list[str]:
    from eagle3d.ingest.dataformats import BadSample, detect, iter_rows, parse_row

    lines = Path(demo_dataset()).read_text().splitlines()
    big = base / "plan-100k.jsonl"
    with open(big, "w") as f:
        for i in range(100_000):
            f.write(lines[i % len(lines)] + "\n")
    got: dict[str, list[float]] = {"read": [], "default": [], "all": []}
    for _ in range(rounds):
        t = time.perf_counter()
        fmt = detect(str(big))
        n = 0
        for idx, raw in iter_rows(str(big), fmt):
            try:
                parse_row(idx, raw)
                n += 1
            except BadSample:
                pass
        got["read"].append(time.perf_counter() - t)
        assert n > 0
        for key, extra in (("default", ()), ("all", ("--sample", "0"))):
            t = time.perf_counter()
            p = plan_json(model, base / "plan-out", "bfloat16", str(big), *extra)
            got[key].append(time.perf_counter() - t)
            assert p["rows"] == 100_000, p["rows"]
    med = {k: statistics.median(v) for k, v in got.items()}
    return [
        "| command | seconds (median) | against reading and parsing the lines |",
        "|---|---|---|",
        f"| reading and parsing the 100,000 lines in one process (baseline) | {med['read']:.1f} | 1.00 |",
        f"| `eagle3d plan --json` (default: a sample of 20,000 rows tokenized) | {med['default']:.1f} | {med['default'] / med['read']:.1f} |",
        f"| `eagle3d plan --json --sample 0` (every row tokenized) | {med['all']:.1f} | {med['all'] / med['read']:.1f} |",
    ]


def main() -> int:
    parts = ("bytes", "error", "cpu", "plan", "plan-time")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("parts", nargs="*", choices=(*parts, []), default=list(parts))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=str(Path(__file__).resolve().parent))
    a = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-storage-", dir=a.dir))
    try:
        model = base / "tiny-model"
        eagle3d("tiny-model", str(model))
        demo: dict[str, Path] = {}
        if {"bytes", "error", "plan"} & set(a.parts):
            for dtype in ("bfloat16", "fp8"):
                demo[dtype] = base / f"demo-{dtype}"
                run_job(model, demo[dtype], dtype, demo_dataset())
        for part in a.parts:
            t = time.perf_counter()
            if part == "bytes":
                rows = part_bytes(base, demo)
            elif part == "error":
                rows = part_error(demo)
            elif part == "cpu":
                rows = part_cpu(base, a.rounds)
            elif part == "plan":
                rows = part_plan(model, base, demo)
            else:
                rows = part_plan_time(model, base, max(1, a.rounds // 2))
            print(f"\n{part} ({time.perf_counter() - t:.0f} s)\n", flush=True)
            print("\n".join(rows), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
