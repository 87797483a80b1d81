"""Issue #30's figures: bytes per token and extraction speed per recipe, bfloat16 and fp8.

Two parts, each against EAGLE-3 in bfloat16 in the same run:

* ``bytes``: the exact bytes per token of a sample file (:func:`eagle3d.store.sizing.file_bytes`,
  the layout every commit writes) at Qwen3-8B's shape (H=4096, L=36, T=1024) for each recipe's
  default layer count, and what SpecForge v0.3.0's writer would store for the same record
  (DFlash/Domino without the last state; torch.save, uncompressed);
* ``speed``: ``eagle3d run`` on the tiny model (12 layers, H=256) over the demo's first 120
  conversations, HF backend on this CPU, per recipe and storage dtype, in interleaved rounds:
  tokens per second of the whole run (start to exit), and its ratio to EAGLE-3 bfloat16 in the
  same round.

    flock /tmp/eagle3d-bench.lock .venv/bin/python bench/recipes.py [bytes|speed] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
RECIPES = {"eagle3": 3, "dflash": 5, "dspark": 5}


def bytes_part() -> None:
    import torch
    from eagle3d.remote import recipes, storedtype
    from eagle3d.remote import samplefile as archive
    from eagle3d.store import sizing

    h, layers, t = 4096, 36, 1024
    base = sizing.file_bytes(t, h, 3, storedtype.get("bfloat16")) / t
    print(f"bytes per token, H={h}, L={layers}, T={t} (ratio to eagle3 bfloat16 {base:.0f} B)")
    for name in ("eagle3", "dflash", "domino", "dspark"):
        r = recipes.get(name)
        k = len(recipes.default_layers(name, layers))
        for dt in ("bfloat16", "fp8"):
            ours = sizing.file_bytes(t, h, k, storedtype.get(dt)) / t
            print(
                f"  {name:7s} {dt:9s} k={k}: eagle3d file {ours:8.0f} B/token ({ours / base:.2f}x)"
            )
        spec = [("input_ids", torch.int64, (t,)), ("loss_mask", torch.int64, (t,))]
        spec.append((r.layers_key, torch.bfloat16, (1, t, k * h)))
        if r.last_key:
            spec.append((r.last_key, torch.bfloat16, (1, t, h)))
        theirs = archive.plan(tuple(spec)).total / t
        print(f"  {name:7s} SpecForge v0.3.0 record, bfloat16: {theirs:8.0f} B/token")


def run_once(model: Path, data: Path, out: Path, recipe: str, dtype: str) -> tuple[float, int]:
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "eagle3d", "run", "--model", str(model), "--dataset", str(data)]
    r = subprocess.run(
        [*cmd, "--output", str(out), "--recipe", recipe, "--store-dtype", dtype],
        env=ENV,
        capture_output=True,
        text=True,
    )
    s = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(f"run {recipe} {dtype} exited {r.returncode}: {r.stderr[-2000:]}")
    from eagle3d.reader import HiddenStates

    tokens = sum(len(x["input_ids"]) for x in HiddenStates(out))
    return s, tokens


def speed_part(rounds: int) -> None:
    from eagle3d.tools.tinymodel import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = Path(build_tiny_model(work / "model", layers=12, hidden=256))
        demo = (ROOT / "daemon" / "eagle3d" / "data" / "demo.jsonl").read_text().splitlines()
        data = work / "data.jsonl"
        data.write_text("\n".join(demo[:120]) + "\n")
        rates: dict[tuple[str, str], list[float]] = {}
        ratios: dict[tuple[str, str], list[float]] = {}
        for rnd in range(rounds):
            base = 0.0
            for recipe in RECIPES:
                for dt in ("bfloat16", "fp8"):
                    out = work / f"out-{rnd}-{recipe}-{dt}"
                    s, tokens = run_once(model, data, out, recipe, dt)
                    rate = tokens / s
                    if (recipe, dt) == ("eagle3", "bfloat16"):
                        base = rate
                    rates.setdefault((recipe, dt), []).append(rate)
                    ratios.setdefault((recipe, dt), []).append(rate / base)
        print(f"extraction speed, tiny model L=12 H=256, 120 demo conversations, {rounds} rounds")
        for (recipe, dt), v in rates.items():
            med = statistics.median(v)
            ratio = statistics.median(ratios[(recipe, dt)])
            print(f"  {recipe:7s} {dt:9s}: {med:8.0f} tokens/s ({ratio:.2f}x eagle3 bfloat16)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("parts", nargs="*", default=["bytes", "speed"])
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    if "bytes" in a.parts:
        bytes_part()
    if "speed" in a.parts:
        speed_part(a.rounds)


if __name__ == "__main__":
    main()
