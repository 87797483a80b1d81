"""The monitor on a small terminal (issue 27, point 10): at 80x24 every panel is reachable
(the body scrolls), and every panel's border ends in the same column, the Pipeline panel's
(which stays put above the scrolling body) included."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from monitor_helpers import EAGLE3_TOP
from runkit import conversations, run, write_jsonl

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def job(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("small")
    data = write_jsonl(root / "data.jsonl", [*conversations(12), "{not json"])
    out = root / "out"
    r = run(tiny_model_dir, data, out)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def _right_corners(screen: str) -> set[int]:
    return {ln.rindex("╮") for ln in screen.splitlines() if re.search(r"╭─ \w", ln)}


def test_every_panel_is_reachable_at_80x24_and_borders_align(job: Path) -> None:
    from test_tmux import Tmux

    t = Tmux([EAGLE3_TOP, "--output", str(job)], width=80, height=24)
    try:
        top = t.wait_screen(lambda s: "FINISHED" in s and "Throughput" in s)
        seen = set(re.findall(r"╭─ (\S[^─]*?) ─", top))
        corners = _right_corners(top)
        screen = top
        for _ in range(6):
            before = screen
            t.keys("PageDown")
            try:  # the screen moves (or, at the end, stays put)
                screen = t.wait_screen(lambda s, b=before: s != b, timeout=5)  # type: ignore[misc]
            except AssertionError:
                break
            seen |= set(re.findall(r"╭─ (\S[^─]*?) ─", screen))
            corners |= _right_corners(screen)
            if "Recent errors" in screen:
                break
    finally:
        t.kill()
    want = {"Pipeline", "Throughput", "Disk", "Producer / server", "GPU", "Recent errors"}
    assert want <= seen, seen
    assert len(corners) == 1, corners  # one right edge for every panel
