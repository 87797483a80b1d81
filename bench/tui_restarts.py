#!/usr/bin/env python3
"""The TUI's memory over daemon restarts: ``eagle3-top`` in a tmux terminal (120x40) attached
to a synthetic job whose daemon is stopped and started again ``--restarts`` times.

The daemon (``eagle3d run --backend synthetic`` on the tiny model, pre-tokenized rows of 16
tokens) works ``--work`` seconds per session, then gets SIGTERM (even sessions) or SIGKILL
(odd ones); the monitor falls back to the journal, and reattaches to the socket when the next
session is up. After each restart, once the screen shows the new session live, the TUI's RSS
is read from ``/proc/PID/status`` (``VmRSS``, and ``VmHWM``, its peak). Nothing here asserts.

    nice -n 10 .venv/bin/python bench/tui_restarts.py [--restarts 4] [--work 25]
        [--n 400000] [--dir /tmp/e3d-tuirss]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
PY = sys.executable


def dataset(path: Path, n: int) -> Path:
    r = random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            ids = [r.randrange(1, 900) for _ in range(16)]
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 4 + [1] * 12}) + "\n")
    return path


def rss_kb(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in KiB."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def screen(name: str) -> str:
    return subprocess.run(
        ["tmux", "capture-pane", "-p", "-t", name], capture_output=True, text=True
    ).stdout


def wait(pred: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return
        time.sleep(0.25)
    raise SystemExit(f"timed out waiting for {what}")


def start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=ENV)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--restarts", type=int, default=4)
    ap.add_argument("--work", type=float, default=25.0, help="seconds each session works")
    ap.add_argument("--n", type=int, default=400_000)
    ap.add_argument("--dir", default="/tmp/e3d-tuirss")
    args = ap.parse_args(argv)
    from eagle3d.tools.tinymodel import build_tiny_model

    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    model = Path(build_tiny_model(str(root / "model")))
    data = dataset(root / "data.jsonl", args.n)
    out = root / "out"
    run = [PY, "-m", "eagle3d", "run", "--model", str(model), "--dataset", str(data)]
    run += ["--output", str(out), "--backend", "synthetic", "--dump-dir", f"{out}.dumps"]
    run += ["--socket", f"{out}.sock", "--max-failed-fraction", "0.5"]
    name = f"e3d-tuirss-{os.getpid()}"
    figures: list[dict[str, object]] = []
    proc = start(run, root / "daemon1.log")
    try:
        wait(lambda: b"up; window" in (root / "daemon1.log").read_bytes(), 300, "the producer")
        tui = f"{PY} -m eagle3top --output {out}"
        subprocess.run(
            ["tmux", "new-session", "-d", "-s", name, "-x", "120", "-y", "40", tui],
            env=ENV,
            check=True,
        )
        pane = subprocess.run(
            ["tmux", "list-panes", "-t", name, "-F", "#{pane_pid}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        pid = int(pane[0])
        for k in range(args.restarts + 1):
            wait(lambda: "live (socket)" in screen(name), 120, "the TUI live")
            time.sleep(args.work)
            rss, hwm = rss_kb(pid)
            saved = next((ln for ln in screen(name).splitlines() if " saved · " in ln), "")
            figures.append({"session": k + 1, "rss_mb": rss / 1024, "hwm_mb": hwm / 1024})
            print(
                f"session {k + 1}: TUI rss {rss / 1024:.1f} MB, peak {hwm / 1024:.1f} MB"
                f"  |{saved.strip()[:70]}",
                flush=True,
            )
            if k == args.restarts:
                break
            proc.send_signal(signal.SIGTERM if k % 2 == 0 else signal.SIGKILL)
            proc.wait()
            wait(lambda: "journal" in screen(name), 60, "the TUI on the journal")
            time.sleep(3)
            log = root / f"daemon{k + 2}.log"
            proc = start(run, log)
            wait(lambda: b"up; window" in log.read_bytes(), 300, "the producer")  # noqa: B023
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], check=False)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
