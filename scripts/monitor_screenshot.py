"""Screenshots of eagle3-top watching the real daemon, for docs/monitor.md:

* ``monitor.png`` (120x40) and ``monitor-80x24.png``: a real ``eagle3d demo`` run, once a
  third of its samples are saved;
* ``monitor-paused.png`` (120x40): a real ``eagle3d run`` whose output is a 1 MiB tmpfs, once
  it has paused on the full disk (needs root to mount; skipped otherwise).

The monitor is the real app with the same feeds as in a terminal, run headless; its SVG is
converted with ``rsvg-convert`` (Debian: ``apt-get install librsvg2-bin``).

    .venv/bin/python scripts/monitor_screenshot.py [--dir docs]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import resources

from eagle3proto import paths
from eagle3proto.reducer import ShardState
from eagle3top.app import Eagle3Top
from eagle3top.feeds import LocalFeed
from eagle3top.sources import discover, read_journal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATASET = str(resources.files("eagle3d").joinpath("data/demo.jsonl"))


def svg_to_png(svg: str, png: str) -> None:
    """rsvg-convert, with the web font swapped for a local monospace and spaces kept."""
    with open(svg) as f:
        text = f.read()
    # The SVG names "Fira Code" from a CDN; offline, a proportional fallback misaligns the
    # columns. Non-breaking spaces are also collapsed by librsvg at segment edges.
    text = text.replace("Fira Code", "DejaVu Sans Mono").replace("&#160;", " ")
    text = text.replace("<svg ", '<svg xml:space="preserve" ', 1)
    # librsvg ignores textLength, and DejaVu Sans Mono's advance (0.602 em) is narrower than
    # the SVG's cell: long runs came out short and a panel's right border stood apart from
    # its corners. Letter spacing makes up the difference.
    size = re.search(r"\.terminal-matrix \{[^}]*font-size: ([0-9.]+)px", text)
    cell = re.search(r'textLength="([0-9.]+)"[^>]*>[^<]</text>', text)
    if size and cell:
        gap = float(cell.group(1)) - 0.60205 * float(size.group(1))
        text = text.replace(
            "font-variant-east-asian: full-width;",
            f"font-variant-east-asian: full-width; letter-spacing: {gap:.3f}px;",
            1,
        )
    fixed = svg + ".local.svg"
    with open(fixed, "w") as f:
        f.write(text)
    subprocess.run(["rsvg-convert", "-o", png, fixed], check=True)


async def shoot(output: str, svg_dir: str, name: str, size: tuple[int, int]) -> str:
    feeds = [LocalFeed(t, time.time, 1.0) for t in discover(output, None)]
    app = Eagle3Top(feeds, interval=1.0)
    async with app.run_test(size=size) as pilot:
        await pilot.pause(3.0)
        app.tick()
        await pilot.pause(0.3)
        return app.save_screenshot(f"{name}.svg", svg_dir)


def wait_state(output: str, done: Callable[[ShardState], bool], seconds: float) -> bool:
    jdir = paths.journal_dir(output, paths.Shard())
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if os.path.isdir(jdir):
            state, _ = read_journal(jdir)
            if done(state):
                return True
        time.sleep(0.5)
    return False


def running(work: str, docs: str) -> str:
    """The demo's run: 120x40 and 80x24. Returns its model directory."""
    output = os.path.join(work, "demo", "out")
    demo = subprocess.Popen(
        [sys.executable, "-m", "eagle3d", "demo", "--dir", os.path.join(work, "demo"), "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Slower batches, so the run is still going when the second screenshot is taken.
        env={**os.environ, "EAGLE3D_FAULT": "worker_slow:5000"},
    )
    try:
        wait_state(output, lambda s: s.total > 0 and s.saved >= s.total // 3, 300)
        for name, size in (("monitor", (120, 40)), ("monitor-80x24", (80, 24))):
            svg = asyncio.run(shoot(output, work, name, size))
            svg_to_png(svg, os.path.join(docs, f"{name}.png"))
            print(f"wrote {os.path.join(docs, name)}.png")
    finally:
        demo.wait(300)
    return os.path.join(work, "demo", "model")


def paused(work: str, docs: str, model: str) -> None:
    """A run on a 1 MiB filesystem, once it has paused on the full disk."""
    small = os.path.join(work, "small")
    os.makedirs(small)
    mount = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", small]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode != 0:
        print("monitor-paused.png skipped: mounting a small tmpfs needs root", file=sys.stderr)
        return
    data = os.path.join(work, "data.jsonl")
    with open(DATASET) as src, open(data, "w") as dst:
        dst.writelines(src.readlines()[:40])
    output = os.path.join(small, "out")
    cmd = [sys.executable, "-m", "eagle3d", "run", "--model", model, "--dataset", data]
    cmd += ["--output", output, "--dump-dir", os.path.join(work, "dumps"), "--workers", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if wait_state(output, lambda s: s.state == "paused", 180):
            time.sleep(3.0)  # the commits under way when the disk filled end
            svg = asyncio.run(shoot(output, work, "monitor-paused", (120, 40)))
            svg_to_png(svg, os.path.join(docs, "monitor-paused.png"))
            print(f"wrote {os.path.join(docs, 'monitor-paused.png')}")
    finally:
        proc.terminate()
        proc.wait(120)
        subprocess.run(["umount", small], check=False)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=os.path.join(ROOT, "docs"))
    a = ap.parse_args()
    if shutil.which("rsvg-convert") is None:
        print("rsvg-convert not found (apt-get install librsvg2-bin)", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="e3-shot-")
    try:
        model = running(work, a.dir)
        paused(work, a.dir, model)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
