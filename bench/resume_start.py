#!/usr/bin/env python3
"""What a resume's start costs against the dataset's size (issue 29): a synthetic job of N
pre-tokenized rows (``bench/scale.py``'s), killed with SIGKILL at ``--saved`` samples, then
started again ``--tries`` times (each on a fresh copy of the killed output). Per start: wall
and CPU seconds (the daemon's, all its threads, from ``/proc``) from the process start to
"producer ... up; window" in its log, and to 20 samples more in the journal (the first saves:
what the feeder's own start adds after "up"), and the space check's log line. The killed
output is started once more before the timed starts (unless ``--first``), so that they find
what a start keeps beside the journal for the next (the dataset's pin and row index, the
tokenizer), as every resume but the first after a job's own first start does.

``--tree DIR`` runs the daemon of another checkout (its ``shared``, ``daemon``, ``tui`` on
``PYTHONPATH``): the same start before and after a change. CPU seconds are the figure to
compare on a loaded machine; wall seconds follow the load.

    nice -n 10 .venv/bin/python bench/resume_start.py --n 1000000 [--tree /work/main]
        [--saved 2000] [--tries 2] [--dir /tmp/e3d-resume]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import scale  # noqa: E402

#: Journal bytes of 20 samples (sent, dumped, saved records).
FIRST_SAVES = 20 * scale.JOURNAL_BYTES_PER_SAMPLE


def argv(model: Path, data: Path, out: Path) -> list[str]:
    a = [scale.PY, "-m", "eagle3d", "run", "--model", str(model), "--dataset", str(data)]
    a += ["--output", str(out), "--backend", "synthetic", "--dump-dir", f"{out}.dumps"]
    return [*a, "--socket", f"{out}.sock", "--max-failed-fraction", "0.5"]


def killed_job(model: Path, data: Path, out: Path, saved: int, env: dict[str, str]) -> None:
    """The job started and killed with SIGKILL once about ``saved`` samples are saved."""
    if out.exists():
        return
    with open(f"{out}.first.log", "wb") as log:
        proc = subprocess.Popen(argv(model, data, out), stdout=log, stderr=log, env=env)
    while scale.saved_estimate(out) < saved and proc.poll() is None:
        time.sleep(0.2)
    proc.kill()
    proc.wait()


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _journal_bytes(out: Path) -> int:
    jdir = out / ".eagle3d" / "journal" / "shard-0-of-1"
    return sum(e.stat().st_size for e in os.scandir(jdir) if e.name.endswith(".e3j"))


def one_start(
    model: Path, data: Path, src: Path, env: dict[str, str], copy: bool = True
) -> dict[str, Any]:
    """One start of the killed output (a fresh copy of it, unless not ``copy``), stopped
    with SIGINT after its first saves."""
    out = src
    if copy:
        out = src.parent / f"{src.name}.try"
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(f"{out}.dumps", ignore_errors=True)
        shutil.copytree(src, out, symlinks=True)
    log = Path(f"{out}.log")
    t0 = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv(model, data, out), stdout=f, stderr=f, env=env)
    got: dict[str, Any] = {}
    size0 = 0
    while proc.poll() is None and time.monotonic() - t0 < 600:
        time.sleep(0.02)
        if "up_s" not in got and b"up; window" in log.read_bytes()[-20000:]:
            got["up_s"], got["up_cpu_s"] = time.monotonic() - t0, _cpu(proc.pid)
            size0 = _journal_bytes(out)
        if "up_s" in got and _journal_bytes(out) > size0 + FIRST_SAVES:
            got["saves_s"], got["saves_cpu_s"] = time.monotonic() - t0, _cpu(proc.pid)
            break
    proc.send_signal(signal.SIGINT)
    proc.wait()
    space = [ln.split("eagle3d: ", 1)[-1] for ln in log.read_text().splitlines() if "space:" in ln]
    got["space"] = space[0] if space else ""
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in got.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--tree", default=str(HERE.parent), help="the checkout whose daemon runs")
    ap.add_argument("--saved", type=int, default=2000)
    ap.add_argument("--tries", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/e3d-resume")
    ap.add_argument(
        "--first",
        action="store_true",
        help="time the first resume after the kill (default: a later one: the killed output "
        "is started once more first, as every resume after the first finds it)",
    )
    args = ap.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    tree = Path(args.tree).resolve()
    env = {**scale.ENV, "PYTHONPATH": f"{tree}/shared:{tree}/daemon:{tree}/tui"}
    model = root / "model"
    if not model.exists():
        from eagle3d.tools.tinymodel import build_tiny_model

        build_tiny_model(str(model))
    data = scale.dataset(root / f"d{args.n}.jsonl", args.n)
    src = root / f"out{args.n}"
    if not src.exists():
        killed_job(model, data, src, args.saved, env)
        if not args.first:  # what a start keeps beside the journal for the next one
            print(json.dumps({"settling start": one_start(model, data, src, env, copy=False)}))
    for _ in range(args.tries):
        r = {"n": args.n, "tree": str(tree), **one_start(model, data, src, env)}
        r["load"] = round(os.getloadavg()[0], 1)
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
