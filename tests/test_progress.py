"""The progress line of ``eagle3d run`` / ``demo``: its words (pure) and when it is written.

The live, in-place line on a real terminal is tested in ``tests/test_tmux.py`` (the screen)
and here (the bytes written to a real pseudo-terminal).
"""

from __future__ import annotations

import fcntl
import io
import os
import re
import struct
import subprocess
import termios
from pathlib import Path

import runkit
from eagle3d.serve.progress import ProgressLine, describe
from eagle3proto import events as ev
from eagle3proto import reducer

T = 1_800_000_000.0


def fold(*events: ev.Event) -> reducer.ShardState:
    s = reducer.new_state()
    for i, e in enumerate(events):
        e.seq = i
        reducer.apply(s, e)
    return s


def saves(n: int, t0: float, step: float = 0.5) -> list[ev.Event]:
    out: list[ev.Event] = []
    for i in range(n):
        out.append(ev.SampleSent(ts=t0 + i * step, idx=i, tokens=100))
        out.append(
            ev.SampleSaved(
                ts=t0 + i * step + 0.1, idx=i, path="p", bytes=1, tokens=100, checksum=""
            )
        )
    return out


def test_the_words_for_each_state() -> None:
    assert describe(reducer.new_state(), T) == "starting"  # no "saved 0/-1", no "ETA 0s"
    loading = fold(
        ev.RunStarted(ts=T - 20, total=500),
        ev.RunState(ts=T - 12, state="loading", reason="loading model /m (hf, device auto)"),
    )
    assert describe(loading, T) == "loading model /m (hf, device auto) · 12 s"
    waiting = fold(
        ev.RunStarted(ts=T - 40, total=500),
        ev.ProducerEvent(
            ts=T - 30, state="waiting", message="waiting for SGLang at http://h (30 s)"
        ),
    )
    assert describe(waiting, T) == "waiting for SGLang at http://h (30 s) · 30 s"
    run = fold(
        ev.RunStarted(ts=T - 60, total=500),
        ev.RunState(ts=T - 40, state="running", reason="producer hf up"),
        *saves(50, T - 30),
        ev.SampleFailed(ts=T - 2, idx=900, error="E"),
    )
    # The rate is since the producer came up (50 in 40 s), not since the session began (60 s);
    # the failed sample is counted on its own, not as progress.
    assert describe(run, T) == (
        "saved 50/500 (10.0%) · 1 failed · in flight 0 · 1.25 samples/s · 125 tok/s · ETA 5 m 59 s"
    )
    paused = fold(
        ev.RunStarted(ts=T - 60, total=500),
        *saves(50, T - 30),
        ev.RunState(ts=T - 5, state="paused", reason="disk full writing to /o"),
    )
    line = describe(paused, T + 600)
    assert line.startswith("PAUSED: disk full writing to /o · saved 50/500 (10.0%)")
    assert line.endswith("(frozen)")
    done = fold(ev.RunStarted(ts=T - 9, total=2), *saves(2, T - 5), ev.RunFinished(ts=T - 1))
    assert describe(done, T) == "finished: saved 2/2 (100.0%)"


def test_plain_lines_on_a_change_of_state_and_every_ten_seconds() -> None:
    out = io.StringIO()
    line = ProgressLine.for_stream(out, every=10.0)
    assert not line.live  # not a terminal
    s = fold(
        ev.RunStarted(ts=T - 2, total=10),
        ev.RunState(ts=T - 1, state="loading", reason="loading model /m"),
    )
    for k in range(12):
        line.update(s, T + k)
    reducer.apply(s, ev.RunState(seq=9, ts=T + 12, state="running", reason="up"))
    line.update(s, T + 12)
    lines = out.getvalue().splitlines()
    assert lines == [
        "  loading model /m · 1 s",
        "  loading model /m · 11 s",
        "  saved 0/10 (0.0%) · in flight 0 · 0.00 samples/s · 0 tok/s · ETA unknown yet",
    ]


def test_run_on_a_real_pty_rewrites_one_line_and_keeps_log_lines_whole(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Issue 27, point 10: ``eagle3d run`` with its stderr a real pseudo-terminal. The bytes
    it writes: the progress line redrawn in place (carriage return, erase line) with no new
    line between two draws; a warning (a malformed row) printed as a whole line of its own
    above it; the final ``summary:`` line whole."""
    data = runkit.write_jsonl(tmp_path / "data.jsonl", [*runkit.conversations(30), "{bad json"])
    out = tmp_path / "out"
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    env = runkit.env_without_faults(EAGLE3D_FAULT="worker_slow:200")
    env.pop("JOURNAL_STREAM", None)
    proc = subprocess.Popen(
        runkit.run_args(tiny_model_dir, data, out, "--workers", "1"),
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    raw = b""
    with runkit.reaped(proc):  # type: ignore[arg-type]
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every holder of the terminal's other end has exited
                break
            if not chunk:
                break
            raw += chunk
        assert proc.wait(60) == 0, raw.decode(errors="replace")[-3000:]
    os.close(master)
    text = raw.decode().replace("\x1b[?25l", "").replace("\x1b[?25h", "")  # cursor off/on
    lines = [ln.split("\r\x1b[2K")[-1] for ln in text.split("\r\n")]  # what stays on screen
    draws = [d for ln in text.split("\r\n") for d in ln.split("\r\x1b[2K")]
    progress = [d for d in draws if re.search(r"saved \d+/31 \(", d)]
    assert len(set(progress)) >= 2, text  # redrawn as it moved
    # two draws in a row with no line between: rewritten in place
    assert re.search(r"saved \d+/31 \([^\n]*\r\x1b\[2K[^\n]*saved \d+/31 \(", text), text
    warning = [ln for ln in lines if " WARNING " in ln and "bad JSON" in ln]
    assert len(warning) == 1 and warning[0].startswith("20"), lines  # whole, from its start
    assert "saved " not in warning[0], warning
    summary = [ln for ln in lines if "eagle3d: summary: " in ln]
    assert len(summary) == 1, lines
    assert (
        summary[0]
        .split("eagle3d: ", 1)[1]
        .startswith("summary: saved 30/31 · 1 failed (bad_json 1) · ")
    ), summary
    assert summary[0].rstrip().endswith(" s") and "\x1b" not in summary[0], summary
