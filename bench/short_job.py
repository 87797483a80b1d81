#!/usr/bin/env python3
"""A whole short job against a naive serial script, both whole processes, same model and samples.

The daemon (``eagle3d run``, HF backend, on the bundled 300-line demo set: 297 samples) and
``bench/serial_extract.py`` (template, forward, ``torch.save``, fsync, next) are each timed
from the moment the process is started to its exit, in interleaved rounds; the figure is the
median of the rounds' ratios of samples/s. The daemon's journal says where its fixed cost
goes: the process start to ``run_started`` (imports, preflight, the dataset's hash), to the
producer up (the workers' start and model load), the first saved sample, the last one, and
``run_finished`` to the exit (the drain and shutdown).

    flock /tmp/eagle3d-bench.lock .venv/bin/python bench/short_job.py [--rounds 3] [--markdown]
        [--compare-src DIR]   # another revision's daemon too: git archive REV daemon shared
        [--compare-env K=V]   # this daemon again as 'other', with K=V in its environment
                              # (EAGLE3D_WORKER_ZYGOTE=0: the workers exec'd, not forked)
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
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from eagle3proto import events as ev
from eagle3proto import paths
from eagle3proto.journalread import iter_events

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
DEMO = str(resources.files("eagle3d").joinpath("data/demo.jsonl"))


def build_model(d: Path, layers: int, hidden: int) -> Path:
    from eagle3d.tools.tinymodel import build_tiny_model

    m = d / f"model-L{layers}-h{hidden}"
    if not (m / "config.json").exists():
        heads = max(4, hidden // 64)
        build_tiny_model(str(m), layers=layers, hidden=hidden, heads=heads, kv_heads=heads // 2)
    return m


def run_daemon(
    model: Path, data: str, out: Path, extra: list[str], src: str = "", more_env: Sequence[str] = ()
) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    cmd = [sys.executable, "-m", "eagle3d", "run", "--model", str(model), "--dataset", data]
    cmd += ["--output", str(out), "--dump-dir", f"{out}-dumps", "--socket", f"{out}.sock", *extra]
    env = ENV if not src else {**ENV, "PYTHONPATH": f"{src}/daemon:{src}/shared"}
    env = {**env, **dict(kv.split("=", 1) for kv in more_env)}
    t0, w0 = time.monotonic(), time.time()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(f"eagle3d run failed ({r.returncode}): {r.stderr[-2000:]}")
    evs, _ = iter_events(paths.journal_dir(str(out), paths.Shard()))
    saved = [e for e in evs if isinstance(e, ev.SampleSaved)]

    def at(pred: Any) -> float:
        return next(e.ts for e in evs if pred(e)) - w0

    up = at(lambda e: isinstance(e, ev.RunState) and e.state == "running")
    stats = [e for e in evs if isinstance(e, ev.Stats) and "batch_fill" in e.producer.detail]
    fill = float(stats[-1].producer.detail["batch_fill"]) if stats else 0.0
    return {
        "batch_fill": fill,
        "saved": len(saved),
        "wall": wall,
        "samples_s": len(saved) / wall,
        "to_run_started": at(lambda e: isinstance(e, ev.RunStarted)),
        "to_producer_up": up,
        "to_first_send": at(lambda e: isinstance(e, ev.SampleSent)),
        "to_first_saved": saved[0].ts - w0,
        "to_last_saved": saved[-1].ts - w0,
        "to_finished": at(lambda e: isinstance(e, ev.RunFinished)),
        "steady_s": (len(saved) - 1) / max(1e-9, saved[-1].ts - saved[0].ts),
    }


def run_serial(model: Path, data: str, out: Path, threads: int) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    cmd = [sys.executable, str(HERE / "serial_extract.py"), "--model", str(model)]
    cmd += ["--dataset", data, "--output", str(out), "--threads", str(threads)]
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(f"serial script failed ({r.returncode}): {r.stderr[-2000:]}")
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    return {**doc, "wall": wall, "samples_s": doc["saved"] / wall}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dataset", default=DEMO)
    p.add_argument("--threads", type=int, default=0, help="the serial script's torch threads")
    p.add_argument("--daemon-arg", action="append", default=[], help="extra `eagle3d run` flag")
    p.add_argument(
        "--compare-src",
        default="",
        help="a source tree of another revision (git archive REV daemon shared): its daemon "
        "runs too, as 'other', with the same model and samples",
    )
    p.add_argument(
        "--compare-env",
        action="append",
        default=[],
        help="K=V in the environment of 'other' (with or without --compare-src)",
    )
    p.add_argument(
        "--compare-arg",
        action="append",
        default=[],
        help="an extra `eagle3d run` flag of 'other' only (with or without --compare-src)",
    )
    p.add_argument("--dir", default=None)
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args()
    work = Path(a.dir or tempfile.mkdtemp(prefix="bench-short-"))
    try:
        rows = rounds(a, work)
    finally:
        if not a.dir:  # each round's outputs, ~0.4 GB: a benchmark leaves no disk behind
            shutil.rmtree(work, ignore_errors=True)
    report(a, rows)
    return 0


def rounds(a: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """The interleaved rounds (daemon, serial script, and 'other' when asked)."""
    model = build_model(work, a.layers, a.hidden)
    compare = bool(a.compare_src or a.compare_env or a.compare_arg)
    rows = []
    for i in range(a.rounds):
        # Alternate who goes first: this machine's speed drifts by more than the effect.
        kinds = ["daemon", "serial", *(["other"] if compare else [])]
        order = kinds if i % 2 == 0 else kinds[::-1]
        got: dict[str, dict[str, Any]] = {}
        for who in order:
            if who == "daemon":
                got[who] = run_daemon(model, a.dataset, work / "out-daemon", a.daemon_arg)
            elif who == "other":
                out = work / "out-other"
                more = [*a.daemon_arg, *a.compare_arg]
                got[who] = run_daemon(model, a.dataset, out, more, a.compare_src, a.compare_env)
            else:
                got[who] = run_serial(model, a.dataset, work / "out-serial", a.threads)
        ratio = got["daemon"]["samples_s"] / got["serial"]["samples_s"]
        load = os.getloadavg()[0]
        rows.append({"round": i + 1, "ratio": ratio, "load": load, **got})
        if "other" in got:
            rows[-1]["other_ratio"] = got["other"]["samples_s"] / got["serial"]["samples_s"]
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def report(a: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """The rounds as a markdown table (``--markdown``) or one JSON document."""
    compare = bool(a.compare_src or a.compare_env or a.compare_arg)
    med = statistics.median(r["ratio"] for r in rows)
    if a.markdown:
        other = " | other: ratio (phases)" if compare else ""
        print(
            f"| round (load) | daemon samples/s (wall) | serial samples/s (wall) | ratio | batch fill | daemon: run_started / producer up / first saved / last saved / finished / exit (s){other} |"
        )
        print("|---|---|---|---|---|---|" + ("---|" if other else ""))
        keys = (
            "to_run_started",
            "to_producer_up",
            "to_first_saved",
            "to_last_saved",
            "to_finished",
            "wall",
        )
        for r in rows:
            d, s = r["daemon"], r["serial"]
            phases = " / ".join(f"{d[k]:.1f}" for k in keys)
            more = ""
            if "other" in r:
                o = " / ".join(f"{r['other'][k]:.1f}" for k in keys)
                more = f" {r['other_ratio']:.2f}, fill {r['other']['batch_fill']:.2f} ({o}) |"
            print(
                f"| {r['round']} ({r['load']:.1f}) | {d['samples_s']:.2f} ({d['wall']:.1f} s) | {s['samples_s']:.2f} ({s['wall']:.1f} s) | {r['ratio']:.2f} | {d['batch_fill']:.2f} | {phases} |{more}"
            )
        print(f"\nmedian ratio {med:.2f} over {len(rows)} rounds")
        if other:
            what = " ".join([a.compare_src, *a.compare_env, *a.compare_arg]).strip()
            print(f"other ({what}): median {statistics.median(r['other_ratio'] for r in rows):.2f}")
    else:
        print(json.dumps({"median_ratio": med, "rounds": rows}))


if __name__ == "__main__":
    raise SystemExit(main())
