"""Pipeline benchmarks for ``eagle3d run``; every figure is a ratio against a baseline
measured in the same run on this machine.

* ``forward``: end-to-end tokens/s of the daemon (HF producer, h256/L8 fp32) against a bare
  forward loop of the same model and batch policy in one process (no dumps, no commits).
* ``serial``: daemon samples/s against a re-creation of the serial client of the seed story
  (send one request, wait for its dump, load it, ``torch.save``, next) on the same producer.
* ``gpu-like``: the same comparison against a producer modelled on a GPU server (a fixed
  0.3 s per batch, as the seed story's ``req_time``), where overlapping saves is what matters.
* ``commit``: committed MB/s with the synthetic producer against ``dd bs=16M oflag=direct``
  writing the same bytes to the same disk (what the disk takes), interleaved rounds
  (``--rounds``); see :func:`commit_rows`. ``bench/commit_breakdown.py`` takes the commit
  path apart layer by layer against the same baseline.
* ``splice``: the commit's splice fast path against the general path (``EAGLE3D_SPLICE=0``),
  the same daemon runs interleaved (``--rounds``); see :func:`splice_rows`.
* ``rss``: peak RSS of the daemon process for a small and a 10x larger dataset.

    .venv/bin/python bench/bench_pipeline.py [forward|serial|gpu-like|commit|splice|rss|all] [--markdown]
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import psutil
from eagle3d.produce.hf_layout import model_weight_bytes, usable_cpus, visible_gpus, worker_layout
from eagle3proto import events as ev
from eagle3proto import paths
from eagle3proto.journalread import iter_events

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
DEMO = str(resources.files("eagle3d").joinpath("data/demo.jsonl"))
BATCH_TOKENS = 4096
WINDOW = 64


def build_model(d: Path, layers: int = 8, hidden: int = 256) -> Path:
    from eagle3d.tools.tinymodel import build_tiny_model

    m = d / f"model-L{layers}-h{hidden}"
    if not (m / "config.json").exists():
        heads = max(4, hidden // 64)  # 4 heads at h256 (the reference model), 64-wide above
        build_tiny_model(str(m), layers=layers, hidden=hidden, heads=heads, kv_heads=heads // 2)
    return m


def repeated(src: str, dst: Path, times: int) -> str:
    """The dataset ``times`` over (sample ids differ, token ids repeat): a longer GPU run."""
    if times <= 1:
        return src
    with open(src, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    with open(dst, "w", encoding="utf-8") as f:
        for _ in range(times):
            f.writelines(lines)
    return str(dst)


def encoded_samples(model: Path, dataset: str) -> list[list[int]]:
    from eagle3d.ingest.chat import ChatEncoder
    from eagle3d.ingest.dataset import BadSample, iter_lines, parse_line

    enc = ChatEncoder.from_pretrained(str(model), max_length=2048)
    out = []
    for idx, raw in iter_lines(dataset):
        try:
            out.append(enc.encode(parse_line(idx, raw)).input_ids)
        except BadSample:
            continue
    return out


def _peak_rss(pid: int) -> int:
    """The kernel's high-water mark of ``pid``'s RSS (``VmHWM``), in bytes; 0 once gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class RssSampler:
    """Peak RSS of one process and the sum of its descendants' peaks, from the kernel's
    high-water marks (``VmHWM``), read twice a second.

    The kernel keeps each peak, so a slow poll misses nothing but the last half second.
    Polling the current RSS of every descendant twenty times a second, as this did before,
    took 1.7-1.9 % of this 2-CPU machine from the daemon's run, and none from the bare loop
    it is compared with (CHANGELOG.md, the tenth session of the benchmark history).
    """

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = 0
        self._children: dict[int, int] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    @property
    def children_peak(self) -> int:
        return sum(self._children.values())

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, _peak_rss(self.proc.pid))
            try:
                kids = self.proc.children(recursive=True)
            except psutil.Error:
                return
            for c in kids:
                self._children[c.pid] = max(self._children.get(c.pid, 0), _peak_rss(c.pid))
            if self._stop.wait(0.5):
                return

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def daemon_layout(model: Path, device: str = "cpu") -> tuple[int, int]:
    """The daemon's automatic worker layout (workers, torch threads each), computed as it
    computes it."""
    return worker_layout(
        0,
        0,
        gpus=visible_gpus(device),
        cpus=usable_cpus(),
        model_bytes=model_weight_bytes(str(model)),
        mem_available=psutil.virtual_memory().available,
    )


def run_daemon(
    model: Path,
    dataset: str,
    out: Path,
    *extra: str,
    watch: Callable[[int], Any] | None = None,
    dumps: str = "",
) -> dict[str, Any]:
    """Run ``eagle3d run`` on a fresh ``out``; rates over the working span (first send ..
    finish, also returned as ``first`` and ``end``) from the journal. A previous run's output
    is removed first: resuming it would be a no-op, not a measurement. ``watch(pid)``, if
    given, starts a sampler of the daemon's process with a ``stop()`` called once it ended."""
    dump_dir = dumps or str(out) + "-dumps"
    for stale in (out, Path(dump_dir)):
        shutil.rmtree(stale, ignore_errors=True)
    # The previous round's deletions are flushed before the clock starts: on a disk mounted
    # with 'discard' (this machine's) they otherwise land inside this run's span.
    os.sync()
    cmd = [sys.executable, "-m", "eagle3d", "run", "--model", str(model), "--dataset", dataset]
    cmd += [
        "--output",
        str(out),
        "--dump-dir",
        dump_dir,
        "--socket",
        str(out) + ".sock",
        *extra,
    ]
    t0 = time.monotonic()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(
        cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    rss = RssSampler(proc.pid)
    watcher = watch(proc.pid) if watch is not None else None
    _, err = proc.communicate()
    rss.stop()
    if watcher is not None:
        watcher.stop()
    wall = time.monotonic() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    # The daemon's CPU (user + system, its threads and any worker process), whole process.
    cpu_s = ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime
    os.sync()  # and this run's leftovers before the bare loop that follows is timed
    if proc.returncode != 0:
        raise RuntimeError(f"eagle3d run failed ({proc.returncode}): {err[-2000:]}")
    evs, _ = iter_events(paths.journal_dir(str(out), paths.Shard()))
    first = next(e.ts for e in evs if isinstance(e, ev.SampleSent))
    end = next(e.ts for e in reversed(evs) if isinstance(e, ev.RunFinished))
    saved = [e for e in evs if isinstance(e, ev.SampleSaved)]
    span = end - first
    sent_at: dict[int, float] = {}
    dumped_at: dict[int, float] = {}
    at_producer, committing = [], []
    for e in evs:
        if isinstance(e, ev.SampleSent):
            sent_at[e.idx] = e.ts
        elif isinstance(e, ev.SampleDumped) and e.idx in sent_at:
            dumped_at[e.idx] = e.ts
            at_producer.append(e.ts - sent_at[e.idx])
        elif isinstance(e, ev.SampleSaved) and e.idx in dumped_at:
            committing.append(e.ts - dumped_at[e.idx])
    return {
        "stage_s": {"at_producer": _quantiles(at_producer), "committing": _quantiles(committing)},
        "samples": len(saved),
        "tokens": sum(e.tokens for e in saved),
        "bytes": sum(e.bytes for e in saved),
        "first": first,
        "end": end,
        "span": span,
        "wall": wall,
        "samples_s": len(saved) / span,
        "tokens_s": sum(e.tokens for e in saved) / span,
        "mb_s": sum(e.bytes for e in saved) / span / 1e6,
        "rss": rss.peak,
        "children_rss": rss.children_peak,
        "cpu_s": cpu_s,
    }


def _quantiles(xs: list[float]) -> str:
    """'median / p90' in milliseconds: where a sample's time goes between journal records."""
    if not xs:
        return "-"
    xs = sorted(xs)
    return f"{1000 * xs[len(xs) // 2]:.0f} / {1000 * xs[int(len(xs) * 0.9)]:.0f} ms"


def torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


def load_for_bare(model: Path, device: str = "cpu", dtype: str = "float32") -> tuple[Any, Any]:
    """The model and the worker's capture hooks, as a worker loads them (its malloc
    settings included)."""
    import torch
    from eagle3d.remote.dumpfile import default_aux_layers
    from eagle3d.remote.hf_batching import tune_malloc
    from eagle3d.remote.hf_worker import Capture
    from transformers import AutoModelForCausalLM

    tune_malloc()

    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=getattr(torch, dtype))
    m = m.eval().to(device)
    return m, Capture(m, default_aux_layers(m.config.num_hidden_layers))


def bare_loop(m: Any, cap: Any, samples: list[list[int]], device: str = "cpu") -> int:
    """The worker's batch policy and capture over ``samples``, without dumps; tokens run.

    On CUDA the states stay on the device (no copy to the host): the loop is the GPU's own pace.
    """
    import torch
    from eagle3d.remote.hf_batching import batch_budget, next_batch

    tokens = 0
    # The daemon's window with the worker's own batch rule, refilled in dataset order as
    # each batch finishes (no dumps, no commits, no waiting for the daemon to refill).
    queue = iter(enumerate(samples))
    pool = {str(i): s for i, s in itertools.islice(queue, WINDOW)}
    while pool:
        lengths = {k: len(v) for k, v in pool.items()}
        batch = next_batch(lengths, batch_budget(sum(lengths.values()), BATCH_TOKENS))
        seqs = [pool.pop(r) for r in batch]
        longest = max(map(len, seqs))
        ids = torch.zeros((len(seqs), longest), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        ids, mask = ids.to(device), mask.to(device)
        with torch.inference_mode():
            out = m.model(input_ids=ids, attention_mask=mask, use_cache=False)
        aux = torch.cat([cap.states[i] for i in cap.layers], dim=-1)
        for i, s in enumerate(seqs):  # the per-sample cut the worker makes
            aux[i, : len(s)].contiguous()
            out.last_hidden_state[i, : len(s)].contiguous()
        tokens += sum(map(len, seqs))
        pool.update((str(i), s) for i, s in itertools.islice(queue, len(seqs)))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return tokens


def bare_forward(
    model: Path, samples: list[list[int]], device: str = "cpu", dtype: str = "float32"
) -> float:
    """Tokens/s of the bare loop in this process, with torch's default threads (every CPU)."""
    m, cap = load_for_bare(model, device, dtype)
    t = time.perf_counter()
    tokens = bare_loop(m, cap, samples, device)
    return tokens / (time.perf_counter() - t)


def bare_forward_split(model: Path, dataset: str, procs: int, threads: int) -> float:
    """Tokens/s of ``procs`` bare loops side by side, ``threads`` torch threads each, over
    samples dealt round-robin: the daemon's CPU layout (one worker per core) without the
    daemon. All start together once every process has loaded; the rate is all tokens over
    the first start to the last end."""
    cmd = [sys.executable, os.path.abspath(__file__), "_bare-part", str(model), dataset]
    parts = [
        subprocess.Popen(
            [*cmd, str(i), str(procs), str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        for i in range(procs)
    ]
    for p in parts:  # each says "ready" when loaded and tokenized
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    for p in parts:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [json.loads(p.communicate()[0]) for p in parts]
    if any(p.returncode for p in parts):
        raise RuntimeError("a bare loop process failed")
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    return sum(r["tokens"] for r in results) / span


def _bare_part(argv: list[str]) -> int:
    """Child of :func:`bare_forward_split`: one share of the samples, on a signal."""
    model, dataset, part, procs, threads = argv
    import torch

    torch.set_num_threads(int(threads))
    samples = encoded_samples(Path(model), dataset)[int(part) :: int(procs)]
    m, cap = load_for_bare(Path(model))
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.time()
    tokens = bare_loop(m, cap, samples)
    print(json.dumps({"tokens": tokens, "start": start, "end": time.time()}), flush=True)
    return 0


def story_save(dump_dir: Path, rid: str, target: Path) -> None:
    """The serial script's tail: wait for the dump, load it, ``torch.save`` it, delete it."""
    import torch
    from eagle3d.dumps.format import read_dump
    from eagle3d.remote.dumpfile import dump_path

    path = dump_path(str(dump_dir), rid)
    while not os.path.exists(path):
        time.sleep(0.001)
    d = read_dump(path)
    torch.save(
        {
            "input_ids": d.input_ids,
            "loss_mask": torch.ones_like(d.input_ids),
            "hidden_state": d.hidden_state[None],
            "aux_hidden_state": d.aux_hidden_state[None],
        },
        target,
    )
    os.unlink(path)


def serial_client(model: Path, samples: list[list[int]], out: Path) -> float:
    """The seed story's loop: one request, wait for its dump, load, torch.save, next."""
    import msgspec
    from eagle3proto.codec import encode_frame
    from eagle3proto.wire import FrameBuffer

    dump_dir = out / "serial-dumps"
    dump_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "eagle3d.remote.hf_worker", "--model", str(model)]
    cmd += ["--dump-dir", str(dump_dir), "--batch-tokens", str(BATCH_TOKENS)]
    w = subprocess.Popen(cmd, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert w.stdin is not None and w.stdout is not None
    frames = FrameBuffer()
    dec = msgspec.msgpack.Decoder(dict)

    def wait_for(op: str) -> None:
        assert w.stdout is not None
        while True:
            for p in frames.feed(os.read(w.stdout.fileno(), 1 << 16)):
                if dec.decode(p).get("op") == op:
                    return

    wait_for("ready")
    t = time.perf_counter()
    for i, ids in enumerate(samples):
        rid = f"serial-{i}"
        w.stdin.write(encode_frame(msgspec.msgpack.encode({"op": "req", "rid": rid, "ids": ids})))
        w.stdin.flush()
        story_save(dump_dir, rid, out / f"serial_{i}.ckpt")
    rate = len(samples) / (time.perf_counter() - t)
    w.stdin.close()
    w.wait()
    return rate


def serial_synthetic(model: Path, data: str, out: Path, latency: float, n: int) -> float:
    """The seed story's loop against the GPU-like synthetic producer (same knobs)."""
    import asyncio

    from eagle3d.core.sample import Request
    from eagle3d.ingest.chat import ChatEncoder
    from eagle3d.ingest.dataset import iter_lines, parse_line
    from eagle3d.produce.synthetic import SyntheticProducer

    cfg = json.loads((model / "config.json").read_text())
    n_layers = cfg["num_hidden_layers"]
    enc = ChatEncoder.from_pretrained(str(model))
    samples = [enc.encode(parse_line(i, raw)).input_ids for i, raw in iter_lines(data)][:n]
    dump_dir = out / "serial-synthetic-dumps"
    dump_dir.mkdir(parents=True)
    prod = SyntheticProducer(
        dump_dir=str(dump_dir),
        hidden_size=cfg["hidden_size"],
        aux_layers=[2, n_layers // 2, n_layers - 3],
        latency_s=latency,
        batch=32,
    )
    asyncio.run(prod.start())
    t = time.perf_counter()
    for i, ids in enumerate(samples):
        rid = f"serial-{i}"
        prod.submit(Request(rid, i, ids))
        story_save(dump_dir, rid, out / f"serial_{i}.ckpt")
    rate = len(samples) / (time.perf_counter() - t)
    asyncio.run(prod.stop())
    return rate


def big_model_dir(d: Path, hidden: int, layers: int, tokenizer_from: Path) -> Path:
    """config.json of a big model plus the tiny tokenizer: enough for the synthetic producer."""
    m = d / f"config-only-h{hidden}"
    m.mkdir(exist_ok=True)
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, m / f.name)
    cfg = json.loads((tokenizer_from / "config.json").read_text())
    cfg.update(hidden_size=hidden, num_hidden_layers=layers)
    (m / "config.json").write_text(json.dumps(cfg))
    return m


def commit_inputs(
    base: Path, model: Path, name: str
) -> tuple[Path, Path, str, tuple[str, ...], str]:
    """What the commit benchmarks run the daemon on: the config of a model of H=4096 (the
    synthetic producer's shape), 96 samples of 1,024 tokens twice (one sample repeated, for
    dumps that are links of one; and varied ones), the daemon's arguments, and a dump area
    in /dev/shm removed when the benchmark ends."""
    big = big_model_dir(base, 4096, 32, model)
    rnd = random.Random(11)
    ids = [rnd.randrange(7, 1000) for _ in range(1024)]
    same = base / "same.jsonl"
    same.write_text(
        "".join(
            json.dumps({"input_ids": ids, "loss_mask": [i % 2 for i in range(1024)]}) + "\n"
            for _ in range(96)
        )
    )
    varied = pretokenized(base / "big.jsonl", 96, 1024, 1000)
    args = ("--backend", "synthetic", "--commit-threads", "3", "--concurrency", "12")
    # Dumps in /dev/shm, the daemon's default dump area (a dump area on the output disk
    # would add its page-cache traffic to the commits').
    shm = os.path.join("/dev/shm", f"bench-{name}-{os.getpid()}")
    atexit.register(shutil.rmtree, shm, True)  # the daemon leaves its dump area
    return big, same, varied, args, shm


def pretokenized(path: Path, n: int, tokens: int, vocab: int, seed: int = 0) -> str:
    rnd = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            ids = [rnd.randrange(7, vocab) for _ in range(tokens)]
            f.write(
                json.dumps({"input_ids": ids, "loss_mask": [i % 2 for i in range(tokens)]}) + "\n"
            )
    return str(path)


def dd_rate(d: Path, nbytes: int, how: str = "conv=fdatasync") -> float:
    """MB/s of ``dd bs=16M`` writing ``nbytes`` of zeros to ``d``'s disk: ``conv=fdatasync``
    (buffered, one sync at the end) or ``oflag=direct`` (straight to the device: what the
    disk takes)."""
    target = d / "dd.bin"
    count = max(1, nbytes // (16 << 20))
    os.sync()
    t = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={count}", how],
        check=True,
        capture_output=True,
    )
    rate = count * (16 << 20) / (time.perf_counter() - t) / 1e6
    target.unlink()
    return rate


def commit_rows(base: Path, model: Path, rounds: int) -> list[tuple[str, str, str, str]]:
    """``commit``: the daemon's commits against what the disk takes, interleaved rounds.

    Each round: the daemon with the synthetic producer (96 samples x 34 MB, bf16, H=4096,
    3 commit threads, dumps in /dev/shm), once with dumps that cost nothing (``EAGLE3D_SYNTHETIC_LINK``: every
    request's dump is a hard link of one written dump, so only the commit path works, as on
    a GPU node whose server writes its dumps on cores of its own) and once with the
    producer writing each dump (on this 2-core machine its copies compete with the
    commits'); and ``dd bs=16M`` of the same bytes to the same disk, ``oflag=direct`` (the
    baseline: what the disk takes) and ``conv=fdatasync`` (buffered: the earlier baseline).
    """
    big, same, varied, args, shm = commit_inputs(base, model, "commit")
    got: dict[str, list[float]] = {k: [] for k in ("link", "write", "direct", "buffered")}
    per = 0.0
    for r in range(rounds):
        ENV["EAGLE3D_SYNTHETIC_LINK"] = "1"  # the daemon's environment (run_daemon's)
        try:
            c = run_daemon(big, str(same), base / "out-commit", *args, dumps=shm)
        finally:
            del ENV["EAGLE3D_SYNTHETIC_LINK"]
        w = run_daemon(big, varied, base / "out-commit", *args, dumps=shm)
        direct = dd_rate(base, int(c["bytes"]), "oflag=direct")
        buffered = dd_rate(base, int(c["bytes"]))
        per = c["bytes"] / c["samples"]
        for k, v in (
            ("link", c["mb_s"]),
            ("write", w["mb_s"]),
            ("direct", direct),
            ("buffered", buffered),
        ):
            got[k].append(v)
        print(
            f"round {r + 1}: commits {c['mb_s']:.0f} (producer writing: {w['mb_s']:.0f}),"
            f" dd direct {direct:.0f}, dd fdatasync {buffered:.0f} MB/s",
            file=sys.stderr,
        )

    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    def ratio(a: str, b: str) -> str:
        each = [x / y for x, y in zip(got[a], got[b], strict=True)]
        text = f"{med(each):.2f}"
        return text + (
            f" (median of {rounds}: " + ", ".join(f"{x:.2f}" for x in each) + ")"
            if rounds > 1
            else ""
        )

    what = f"96 samples x {per / 1e6:.0f} MB (bf16, H=4096), 3 commit threads"
    return [
        (
            f"committed MB/s, synthetic producer whose dumps cost nothing, {what}",
            f"{med(got['link']):,.0f} MB/s",
            f"dd bs=16M oflag=direct, same bytes: {med(got['direct']):,.0f} MB/s",
            ratio("link", "direct"),
        ),
        (
            "  the same, the producer writing each dump (2 shared CPUs)",
            f"{med(got['write']):,.0f} MB/s",
            f"dd bs=16M oflag=direct: {med(got['direct']):,.0f} MB/s",
            ratio("write", "direct"),
        ),
        (
            "  the first row against buffered dd (the earlier baseline)",
            f"{med(got['link']):,.0f} MB/s",
            f"dd bs=16M conv=fdatasync: {med(got['buffered']):,.0f} MB/s",
            ratio("link", "buffered"),
        ),
    ]


def splice_rows(base: Path, model: Path, rounds: int) -> list[tuple[str, str, str, str]]:
    """``splice``: the A/B of the commit's splice fast path (issue #19), end to end.

    The daemon as in :func:`commit_rows` (synthetic producer, 96 samples x 34 MB, bf16,
    3 commit threads, dumps in /dev/shm), with the fast path (the default) and without it
    (``EAGLE3D_SPLICE=0``: every dump loaded with safetensors, checked, gathered into the
    archive), once with dumps that cost nothing (the commit path alone) and once with the
    producer writing each dump (the commit's share of a CPU shared with the producer).
    Interleaved: who goes first alternates from round to round. The ratio is "without"
    over "with" committed MB/s, per round (below 1: the fast path pays)."""
    big, same, varied, args, shm = commit_inputs(base, model, "splice")
    got: dict[str, list[float]] = {f"{k}-{s}": [] for k in ("link", "write") for s in ("1", "0")}
    cpu: dict[str, list[float]] = {k: [] for k in got}
    for r in range(rounds):
        order = ("1", "0") if r % 2 == 0 else ("0", "1")
        for kind, data in (("link", str(same)), ("write", varied)):
            for s in order:
                ENV["EAGLE3D_SPLICE"] = s
                if kind == "link":
                    ENV["EAGLE3D_SYNTHETIC_LINK"] = "1"
                try:
                    d = run_daemon(big, data, base / "out-splice", *args, dumps=shm)
                finally:
                    ENV.pop("EAGLE3D_SPLICE", None)
                    ENV.pop("EAGLE3D_SYNTHETIC_LINK", None)
                got[f"{kind}-{s}"].append(d["mb_s"])
                cpu[f"{kind}-{s}"].append(d["cpu_s"] / d["samples"] * 1000)
        print(
            f"round {r + 1} (load {os.getloadavg()[0]:.1f}): "
            + ", ".join(
                f"{k} {v[-1]:.0f} MB/s ({cpu[k][-1]:.1f} CPU ms/sample)" for k, v in got.items()
            ),
            file=sys.stderr,
        )

    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    rows = []
    for kind, what in (
        ("link", "dumps that cost nothing"),
        ("write", "the producer writing each dump"),
    ):
        each = [b / a for a, b in zip(got[f"{kind}-1"], got[f"{kind}-0"], strict=True)]
        rows.append(
            (
                f"committed MB/s without the splice fast path (EAGLE3D_SPLICE=0), {what}",
                f"{med(got[f'{kind}-0']):,.0f} MB/s",
                f"with it (the default): {med(got[f'{kind}-1']):,.0f} MB/s",
                f"{med(each):.2f} ({', '.join(f'{x:.2f}' for x in each)})",
            )
        )
        each = [b / a for a, b in zip(cpu[f"{kind}-1"], cpu[f"{kind}-0"], strict=True)]
        rows.append(
            (
                f"  the daemon's CPU ms per sample (whole process), without it, {what}",
                f"{med(cpu[f'{kind}-0']):.1f} ms",
                f"with it: {med(cpu[f'{kind}-1']):.1f} ms",
                f"{med(each):.2f} ({', '.join(f'{x:.2f}' for x in each)})",
            )
        )
    return rows


def main() -> int:
    if sys.argv[1:2] == ["_bare-part"]:
        return _bare_part(sys.argv[2:])
    p = argparse.ArgumentParser()
    p.add_argument(
        "which",
        nargs="?",
        default="all",
        choices=("forward", "serial", "gpu-like", "commit", "splice", "rss", "all"),
    )
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--dir", default=None)
    # The reference is h256/L8 fp32 on this machine's CPU; the rest is for GPU nodes.
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=BATCH_TOKENS)
    p.add_argument("--repeat", type=int, default=1, help="run the demo dataset N times over")
    p.add_argument("--commit-threads", type=int, default=0, help="the daemon's (0: its default)")
    p.add_argument("--rounds", type=int, default=1, help="forward: paired rounds, median ratio")
    args = p.parse_args()
    base = Path(
        args.dir
        or tempfile.mkdtemp(
            prefix="bench-pipeline-", dir=os.path.dirname(os.path.abspath(__file__))
        )
    )
    base.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, str, str, str]] = []
    try:
        model = build_model(base)
        if args.which in ("forward", "serial", "all"):
            fwd_model = build_model(base, args.layers, args.hidden)
            data = repeated(DEMO, base / "demo-repeated.jsonl", args.repeat)
            samples = encoded_samples(fwd_model, data)
            # The daemon's automatic worker layout, computed as it computes it, so that each
            # worker gets a window of WINDOW requests and the bare loop can copy the layout.
            workers, threads = daemon_layout(fwd_model, args.device)
            daemon_args = [
                *("--batch-tokens", str(args.batch_tokens)),
                *("--concurrency", str(WINDOW * workers)),
                *("--device", args.device, "--dtype", args.dtype),
                *(["--commit-threads", str(args.commit_threads)] if args.commit_threads else []),
            ]
            d = run_daemon(fwd_model, data, base / "out-daemon", *daemon_args)
            if args.which in ("forward", "all"):
                # Paired rounds: this machine's speed drifts by more than the effect measured,
                # so each round runs the daemon and the bare loop back to back.
                def bare_best() -> tuple[float, str]:
                    """The faster of the bare loop in one process (torch's threads) and,
                    on a CPU, in the daemon's layout (``workers`` processes): the ratio is
                    taken against the stricter baseline."""
                    one = bare_forward(fwd_model, samples, args.device, args.dtype)
                    text = f"one process, {torch_threads()} threads: {one:,.0f} tok/s"
                    if args.device != "cpu" or workers < 2:
                        return one, text
                    split = bare_forward_split(fwd_model, data, workers, threads)
                    text += f"; {workers} processes of {threads} thread: {split:,.0f} tok/s"
                    return max(one, split), text

                bare, bare_text = bare_best()
                ratios = [d["tokens_s"] / bare]
                for k in range(1, args.rounds):
                    again = run_daemon(fwd_model, data, base / "out-daemon", *daemon_args)
                    bare_k, _ = bare_best()
                    ratios.append(again["tokens_s"] / bare_k)
                    print(f"round {k + 1}: {ratios[-1]:.2f}", file=sys.stderr)
                where = f"{args.device}, {args.dtype}" + (
                    f", batches of {args.batch_tokens} tokens" if args.device != "cpu" else ""
                )
                ratio = f"{ratios[0]:.2f}"
                if len(ratios) > 1:
                    each = ", ".join(f"{r:.2f}" for r in ratios)
                    median = sorted(ratios)[len(ratios) // 2]
                    ratio = f"median {median:.2f} of {len(ratios)} paired rounds ({each})"
                rows.append(
                    (
                        f"end-to-end tokens/s, HF producer h{args.hidden}/L{args.layers} "
                        f"({where}), {len(samples)} samples",
                        f"{d['tokens_s']:,.0f} tok/s ({d['mb_s']:,.0f} MB/s committed; "
                        f"{workers} worker(s) of {threads} thread(s))",
                        f"bare forward loop, same batch policy, the faster of {bare_text}",
                        ratio,
                    )
                )
                st = d["stage_s"]
                rows.append(
                    (
                        "  time per sample: at the producer (sent to dumped), committing "
                        "(dumped to saved); median / p90",
                        f"{st['at_producer']}",
                        f"{st['committing']}",
                        "",
                    )
                )
                if args.device != "cpu":
                    dd = dd_rate(base, int(d["bytes"]))
                    rows.append(
                        (
                            "  the same run's committed bytes against the output disk",
                            f"{d['mb_s']:,.0f} MB/s",
                            f"dd bs=16M conv=fdatasync, same bytes: {dd:,.0f} MB/s",
                            f"{d['mb_s'] / dd:.2f}",
                        )
                    )
            if args.which in ("serial", "all"):
                sub = samples[:60]
                serial = serial_client(model, sub, base / "serial")
                rows.append(
                    (
                        "samples/s, daemon (same run as above)",
                        f"{d['samples_s']:.1f} samples/s",
                        f"serial client (send, wait, load, torch.save), 60 samples: {serial:.1f} samples/s",
                        f"{d['samples_s'] / serial:.1f}",
                    )
                )
            rows.append(
                (
                    "peak RSS, daemon process / HF workers (sum of their peaks)",
                    f"{d['rss'] / 2**20:.0f} MiB / {d['children_rss'] / 2**20:.0f} MiB",
                    "",
                    "",
                )
            )
        if args.which in ("gpu-like", "all"):
            big = big_model_dir(base, 4096, 32, model)
            data = pretokenized(base / "gpu-like.jsonl", 64, 1024, 1000, seed=7)
            lat = 0.3  # the seed story's req_time per request, served in batches of 32
            os.environ["EAGLE3D_SYNTHETIC_LATENCY_S"] = str(lat)
            try:
                g = run_daemon(
                    big,
                    data,
                    base / "out-gpu-like",
                    "--backend",
                    "synthetic",
                    "--concurrency",
                    "32",
                    "--commit-threads",
                    "3",
                )
            finally:
                del os.environ["EAGLE3D_SYNTHETIC_LATENCY_S"]
            serial = serial_synthetic(big, data, base / "serial-gpu-like", lat, 12)
            rows.append(
                (
                    f"samples/s against a GPU-like producer (0.3 s per batch of up to 32, as the seed story's req_time), {g['samples']} samples x {g['bytes'] / g['samples'] / 1e6:.0f} MB",
                    f"{g['samples_s']:.2f} samples/s ({g['mb_s']:.0f} MB/s committed)",
                    f"serial client on the same producer: {serial:.2f} samples/s",
                    f"{g['samples_s'] / serial:.1f}",
                )
            )
        if args.which in ("commit", "all"):
            rows.extend(commit_rows(base, model, args.rounds if args.which == "commit" else 1))
        if args.which == "splice":
            rows.extend(splice_rows(base, model, args.rounds))
        if args.which in ("rss", "all"):
            big = big_model_dir(base, 512, 8, model)
            res = []
            for n in (500, 5000):
                data = pretokenized(base / f"small-{n}.jsonl", n, 64, 1000, seed=n)
                r = run_daemon(
                    big,
                    data,
                    base / f"out-rss-{n}",
                    "--backend",
                    "synthetic",
                    "--concurrency",
                    "32",
                )
                res.append((n, r["rss"]))
            rows.append(
                (
                    "peak RSS of the daemon, synthetic producer",
                    f"{res[0][1] / 2**20:.0f} MiB at {res[0][0]:,} samples",
                    f"{res[1][1] / 2**20:.0f} MiB at {res[1][0]:,} samples",
                    f"{res[1][1] / res[0][1]:.2f}",
                )
            )
    finally:
        if args.dir:  # keep the models built in a given directory for the next run
            for child in base.iterdir():
                if child.is_dir() and not child.name.startswith("model-"):
                    shutil.rmtree(child, ignore_errors=True)
                elif not child.is_dir():
                    child.unlink()
        else:
            shutil.rmtree(base, ignore_errors=True)
    if args.markdown:
        print("| measurement | result | baseline (same run) | ratio |\n|---|---|---|---|")
    for row in rows:
        print(f"| {' | '.join(row)} |" if args.markdown else "  ".join(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
