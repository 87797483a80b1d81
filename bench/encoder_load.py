#!/usr/bin/env python3
"""What the feeder's encoder costs to make (issue 32): the tokenizer loaded by transformers
(``AutoTokenizer``, what a first start pays) against the one kept beside the journal
(:mod:`eagle3d.ingest.tokcache`, what a resume pays), each in a fresh process: CPU seconds
(user + system) and peak RSS of ``eagle3d.ingest.chat.encoder``, imports included, and
whether torch and transformers were imported. The ratio kept / loaded is the figure.

    .venv/bin/python bench/encoder_load.py [--model DIR] [--tries 3] [--json FILE]

Without ``--model`` it builds the tiny model (``eagle3d tiny-model``) in a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import resource, sys, time
t0 = time.process_time()
from eagle3d.ingest import chat
mode, model, jdir = sys.argv[1:4]
enc = chat.encoder(model, kept=[jdir] if mode == "kept" else [])
assert chat._made[(model, 0, "truncate")][1] == (mode == "kept"), "not made as asked"
cpu = time.process_time() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(cpu, rss, "torch" in sys.modules, "transformers" in sys.modules)
"""


def one(mode: str, model: str, jdir: str) -> dict[str, float | bool]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, model, jdir], capture_output=True, text=True
    )
    if out.returncode:
        raise SystemExit(out.stderr[-2000:])
    cpu, rss, torch, transformers = out.stdout.split()
    return {
        "cpu_s": float(cpu),
        "rss": int(rss),
        "torch": torch == "True",
        "transformers": transformers == "True",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--tries", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if not model:
            model = str(Path(tmp) / "tiny")
            subprocess.run([sys.executable, "-m", "eagle3d", "tiny-model", model], check=True)
        # Kept by a child: this process stays small, and a child's peak RSS counts what it
        # had between its fork and its exec.
        keep = "from eagle3d.ingest import chat, tokcache; import sys; "
        keep += "assert tokcache.save(sys.argv[2], sys.argv[1], chat.encoder(sys.argv[1]).facts)"
        subprocess.run([sys.executable, "-c", keep, model, tmp], check=True)
        runs = {m: [one(m, model, tmp) for _ in range(args.tries)] for m in ("loaded", "kept")}
    res: dict[str, object] = {"model": model, "runs": runs}
    for m, rs in runs.items():
        res[f"{m}_cpu_s"] = statistics.median(float(r["cpu_s"]) for r in rs)
        res[f"{m}_rss_mb"] = max(float(r["rss"]) for r in rs) / 1e6
        res[f"{m}_imports"] = sorted(k for k in ("torch", "transformers") if rs[0][k])
    res["cpu_ratio"] = float(res["kept_cpu_s"]) / float(res["loaded_cpu_s"])  # type: ignore[arg-type]
    res["rss_ratio"] = float(res["kept_rss_mb"]) / float(res["loaded_rss_mb"])  # type: ignore[arg-type]
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
