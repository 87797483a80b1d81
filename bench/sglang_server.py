"""The SGLang path's speed against a real SGLang 0.5.21 server on this CPU (whole processes).

Two servers of the same model and settings (h256/L8 fp32 by default, ``--disable-radix-cache
--enable-metrics``, one started by ``eagle3d serve-sglang`` with the capture hook, one bare
without it) stay up for the whole run; each round times, as whole processes and in an order
that alternates between rounds:

* ``bare``: a minimal client sending the dataset's token ids (the daemon's own encoding) to the
  server **without** the hook, ``max_new_tokens=1``, at the same concurrency: the baseline;
* ``tagged``: the same client sending our rids to the server **with** the hook (dumps written,
  nothing read): the hook's and the dump writes' share, without the daemon;
* ``daemon``: ``eagle3d run --backend sglang`` on the hooked server (dumps committed);
* ``serial``: the seed story's client on the hooked server (one request, wait for its dump,
  load it, ``torch.save``, next).

Reported: tokens/s of each (prompt tokens / wall time of the process), the ratios daemon/bare
and daemon/serial per round (median and spread), the daemon's own working span (first send to
``run_finished``, from its journal) to separate its start and drain from the steady state, and
tokens per CPU-second of the client process plus the server's processes (less sensitive than
wall time to other work on a shared machine, and it says where the CPU goes).

    flock /tmp/eagle3d-bench.lock .venv/bin/python bench/sglang_server.py [--rounds 5]
        [--concurrencies 8,16,32]   # bare, tagged and daemon at each; serial once a round
"""

from __future__ import annotations

import argparse
import asyncio
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


# --------------------------------------------------------------------------------------------
# the clients (run as their own processes: ``bench/sglang_server.py --client KIND ...``)


async def _concurrent(url: str, samples: list[list[int]], concurrency: int, tagged: bool) -> None:
    import httpx
    from eagle3d.remote.sglang_rid import sglang_rid

    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:

        async def one(i: int, ids: list[int]) -> None:
            body: dict[str, Any] = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            }
            if tagged:
                body["rid"] = sglang_rid(f"tagged-{i}", ids)
            async with sem:
                r = await c.post("/generate", json=body)
            r.raise_for_status()

        await asyncio.gather(*(one(i, ids) for i, ids in enumerate(samples)))


def _serial(url: str, samples: list[list[int]], dump_dir: Path, out: Path) -> None:
    import httpx
    from bench_pipeline import story_save
    from eagle3d.remote.sglang_rid import sglang_rid

    out.mkdir(parents=True, exist_ok=True)
    with httpx.Client(base_url=url, timeout=600) as c:
        for i, ids in enumerate(samples):
            rid = f"serial-{i}"
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "rid": sglang_rid(rid, ids),
            }
            c.post("/generate", json=body).raise_for_status()
            story_save(dump_dir, rid, out / f"serial_{i}.ckpt")


def client_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=("bare", "tagged", "serial"))
    ap.add_argument("url")
    ap.add_argument("ids")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--dump-dir")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    samples = json.loads(Path(a.ids).read_text())
    if a.kind == "serial":
        _serial(a.url, samples, Path(a.dump_dir), Path(a.out))
    else:
        asyncio.run(_concurrent(a.url, samples, a.concurrency, a.kind == "tagged"))


# --------------------------------------------------------------------------------------------
# the harness


def group_cpu(pid: int) -> float:
    """CPU seconds used so far by ``pid`` and its descendants (SGLang's scheduler, ...)."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            continue
    return total


def timed(cmd: list[str], server_pid: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the client process plus the server's processes)."""
    import resource

    os.sync()  # the previous round's writes are not this one's
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    s0 = group_cpu(server_pid)
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    wall = time.monotonic() - t0
    s1 = group_cpu(server_pid)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed ({r.returncode}): {r.stderr[-3000:]}")
    client = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    return wall, client + (s1 - s0)


def demo_subset(work: Path, model: Path, convs: int) -> tuple[Path, list[list[int]]]:
    """The first ``convs`` valid conversations of the demo set, as a dataset file in ``work``
    and as the daemon's own token ids (what the bare clients send)."""
    from bench_pipeline import DEMO
    from eagle3d.ingest.chat import ChatEncoder
    from eagle3d.ingest.dataset import BadSample, iter_lines, parse_line

    enc = ChatEncoder.from_pretrained(str(model))
    lines, samples = [], []
    for i, raw in iter_lines(DEMO):
        try:
            samples.append(list(enc.encode(parse_line(i, raw)).input_ids))
        except BadSample:
            continue
        lines.append(raw)
        if len(samples) == convs:
            break
    data = work / "data.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")
    return data, samples


def daemon_span(out: Path) -> float:
    from eagle3proto import events as ev
    from eagle3proto import paths
    from eagle3proto.journalread import iter_events

    evs, _ = iter_events(paths.journal_dir(str(out), paths.Shard()))
    first = next(e.ts for e in evs if isinstance(e, ev.SampleSent))
    end = next(e.ts for e in reversed(evs) if isinstance(e, ev.RunFinished))
    return end - first


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client_main(sys.argv[2:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--convs", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument(
        "--concurrencies",
        default="",
        help="comma-separated concurrencies for bare, tagged and daemon (default: --concurrency)",
    )
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--skip", default="", help="comma-separated kinds not to run")
    ap.add_argument("--json", help="write the raw figures here")
    a = ap.parse_args()

    import sglang_real as sr
    from bench_pipeline import build_model

    work = Path(tempfile.mkdtemp(prefix="e3d-bench-sglang-"))
    shm = Path(tempfile.mkdtemp(prefix="e3d-bench-sglang-", dir="/dev/shm"))
    model = build_model(work, a.layers, a.hidden)
    data, samples = demo_subset(work, model, a.convs)
    ids = work / "ids.json"
    ids.write_text(json.dumps(samples))
    tokens = sum(map(len, samples))
    levels = [int(x) for x in (a.concurrencies or str(a.concurrency)).split(",")]
    print(
        f"{len(samples)} conversations, {tokens} tokens, concurrency {levels}, "
        f"model h{a.hidden}/L{a.layers} fp32",
        flush=True,
    )

    (shm / "hooked").mkdir()
    (shm / "bare").mkdir()
    # the servers' own thread defaults (the benchmark holds the machine's lock)
    hooked = sr.Server(model, shm / "hooked", work, threads=None)
    bare = sr.Server(model, shm / "bare", work, bare=True, hook=False, threads=None)
    me = [sys.executable, str(Path(__file__).resolve()), "--client"]
    kinds = [k for k in ("bare", "tagged", "daemon", "serial") if k not in a.skip.split(",")]
    rounds: list[dict[str, float]] = []
    try:
        for s in (hooked, bare):
            s.start()
            s.pause(True)
        for k in range(a.rounds):
            runs = [(kind, c) for kind in kinds for c in ([0] if kind == "serial" else levels)]
            order = runs if k % 2 == 0 else runs[::-1]
            row: dict[str, float] = {}
            for kind, c in order:
                name = kind if len(levels) == 1 or kind == "serial" else f"{kind}@{c}"
                for d in (shm / "hooked", work / "serial", work / "out"):
                    shutil.rmtree(d, ignore_errors=True)
                (shm / "hooked").mkdir(exist_ok=True)
                # The server not measured is stopped (SIGSTOP): an idle SGLang scheduler
                # polls, and would take CPU from the one measured.
                hooked.pause(kind == "bare")
                bare.pause(kind != "bare")
                server = bare if kind == "bare" else hooked
                pid = server.main_pids()[-1] if server.main_pids() else server.proc.pid  # type: ignore[union-attr]
                if kind in ("bare", "tagged"):
                    cmd = [*me, kind, server.url, str(ids), "--concurrency", str(c)]
                elif kind == "serial":
                    cmd = [
                        *me,
                        "serial",
                        hooked.url,
                        str(ids),
                        "--dump-dir",
                        str(shm / "hooked"),
                        "--out",
                        str(work / "serial"),
                    ]
                else:
                    out = work / "out"
                    cmd = [
                        sys.executable,
                        "-m",
                        "eagle3d",
                        "run",
                        "--backend",
                        "sglang",
                        "--server",
                        hooked.url,
                        "--model",
                        str(model),
                        "--dataset",
                        str(data),
                        "--output",
                        str(out),
                        "--dump-dir",
                        str(shm / "hooked"),
                        "--concurrency",
                        str(c),
                    ]
                wall, cpu = timed(cmd, pid)
                if kind == "daemon":
                    row[name.replace("daemon", "daemon_span")] = tokens / daemon_span(work / "out")
                row[f"{name}_per_cpu_s"] = tokens / cpu
                row[name] = tokens / wall
            rounds.append(row)
            print(
                f"round {k + 1}: " + "  ".join(f"{n} {v:,.0f}" for n, v in row.items()), flush=True
            )
    finally:
        for s in (hooked, bare):
            if s.proc is not None:
                s.pause(False)
                s.stop()
        shutil.rmtree(shm, ignore_errors=True)
    report(rounds, levels)
    if a.json:
        Path(a.json).write_text(json.dumps(rounds, indent=1))
    shutil.rmtree(work, ignore_errors=True)


def report(rounds: list[dict[str, float]], levels: list[int]) -> None:
    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs):,.2f} (min {min(xs):,.2f}, max {max(xs):,.2f})"

    print("\ntokens/s, median (min, max) over", len(rounds), "rounds")
    for kind in rounds[0]:
        xs = [r[kind] for r in rounds]
        print(f"  {kind:12} {statistics.median(xs):8,.0f}  ({min(xs):,.0f} .. {max(xs):,.0f})")
    pairs = (
        ("daemon", "bare"),
        ("tagged", "bare"),
        ("daemon", "tagged"),
        ("daemon", "serial"),
        ("bare", "serial"),  # the ceiling of daemon/serial at that concurrency
        ("daemon_span", "bare"),
    )
    for c in levels:
        for num, den in pairs:
            n, d = (_at(num, c, levels), _at(den, c, levels))
            if n in rounds[0] and d in rounds[0]:
                print(f"  {n}/{d}: {med([r[n] / r[d] for r in rounds])}")


def _at(kind: str, c: int, levels: list[int]) -> str:
    """A figure's name in a round: ``kind@c`` when several concurrencies ran."""
    return kind if len(levels) == 1 or kind == "serial" else f"{kind}@{c}"


if __name__ == "__main__":
    main()
