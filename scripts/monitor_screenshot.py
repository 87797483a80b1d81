"""Take a screenshot of eagle3-top watching a real ``eagle3d demo`` run: docs/monitor.png.

Starts the demo (the real daemon on the tiny model), attaches the real monitor (headless,
120x40, the same feeds as the terminal app) once a third of the samples are saved, saves an
SVG and converts it with ``rsvg-convert`` (Debian: ``apt-get install librsvg2-bin``).

    .venv/bin/python scripts/monitor_screenshot.py [--out docs/monitor.png]
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

from eagle3proto import paths
from eagle3top.app import Eagle3Top
from eagle3top.feeds import LocalFeed
from eagle3top.sources import discover, read_journal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


async def shoot(output: str, svg_dir: str) -> str:
    feeds = [LocalFeed(t, time.time, 1.0) for t in discover(output, None)]
    app = Eagle3Top(feeds, interval=1.0)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause(3.0)
        app.tick()
        await pilot.pause(0.3)
        return app.save_screenshot("monitor.svg", svg_dir)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "monitor.png"))
    a = ap.parse_args()
    if shutil.which("rsvg-convert") is None:
        print("rsvg-convert not found (apt-get install librsvg2-bin)", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="e3-shot-")
    output = os.path.join(work, "demo", "out")
    demo = subprocess.Popen(
        [sys.executable, "-m", "eagle3d", "demo", "--dir", os.path.join(work, "demo"), "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        jdir = paths.journal_dir(output, paths.Shard())
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if os.path.isdir(jdir):
                state, _ = read_journal(jdir)
                if state.total > 0 and state.saved >= state.total // 3:
                    break
            time.sleep(0.5)
        svg = asyncio.run(shoot(output, work))
        svg_to_png(svg, a.out)
        print(f"wrote {a.out}")
    finally:
        demo.wait(300)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
