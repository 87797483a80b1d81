"""The progress line of ``eagle3d run`` and ``eagle3d demo``.

:func:`describe` says where a shard stands in one line (pure: the reducer state and ``now``
in, words out): what is being started or loaded and for how long, then saved / total, the
rate and the ETA, and what stopped the work when it stopped.

:class:`ProgressLine` shows it. On a terminal it is one live line redrawn in place (Rich),
with log lines printed above it; otherwise (a pipe, a file, journald) a plain line whenever
the state changes and every ``every`` seconds while it does not.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any, TextIO

from eagle3proto import views
from eagle3proto.reducer import ShardState
from eagle3proto.units import duration, rate, size

log = logging.getLogger("eagle3d")

#: How often a plain (non-terminal) progress line is written while the state holds.
EVERY_S = 10.0


def describe(s: ShardState, now: float) -> str:
    """One line: ``saved 120/500 (24.0%) · 2 failed · 10.5 samples/s · ETA 36 s``."""
    if s.state == "empty" or (s.total < 0 and s.state != "stopped"):
        return "starting"
    if s.state in ("starting", "loading") or s.producer == "waiting":
        what = s.state_reason or s.state
        since = s.state_since
        if s.producer == "waiting":
            what, since = s.producer_message or "waiting for the producer", s.producer_since
        return f"{what} · {duration(now - since)}"
    v = views.view(s, now)
    total = f"{v.total:,}" if v.total >= 0 else "?"
    saved = f"saved {v.saved:,}/{total} ({v.percent:.1f}%)"
    failed = f" · {v.failed:,} failed" if v.failed else ""
    failed += f" · {v.truncated:,} truncated" if v.truncated else ""
    if s.state == "finished":
        return f"finished: {saved}{failed}"
    head = ""
    if s.state == "paused":
        head = f"PAUSED: {s.state_reason} · " if s.state_reason else "PAUSED · "
    elif s.state == "draining":
        head = f"stopping: {v.in_flight + v.committing:,} in flight · "
    elif s.state == "stopped":
        head = f"stopped: {s.state_reason} · " if s.state_reason else "stopped · "
    elif s.producer == "down":
        head = f"producer down: {s.producer_message} · " if s.producer_message else ""
    speed = f" · {rate(v.rate_1m.samples_s, 'samples')} · {v.rate_1m.tokens_s:,.0f} tok/s"
    if v.eta_frozen:
        eta = f" · ETA {duration(v.eta_s)} (frozen)" if v.eta_s is not None else ""
    else:
        eta = f" · ETA {duration(v.eta_s)}" if v.eta_s is not None else " · ETA unknown yet"
    busy = f" · in flight {v.in_flight:,}" if s.state == "running" else ""
    return f"{head}{saved}{failed}{busy}{speed}{eta}"


def failures_by_reason(s: ShardState) -> dict[str, int]:
    """Samples failed for good, counted by reason (most first)."""
    by: dict[str, int] = {}
    for why in s.failed_idx.values():
        by[why] = by.get(why, 0) + 1
    return dict(sorted(by.items(), key=lambda kv: (-kv[1], kv[0])))


def summary(s: ShardState, took_s: float) -> str:
    """The last word of ``eagle3d run``: ``summary: saved 30/31 · 1 failed (bad_json 1) ·
    12 truncated (340 tokens dropped) · 3,901 tokens · 2.2 MB · took 3.0 s``."""
    total = f"{s.total:,}" if s.total >= 0 else "?"
    left = max(s.total - s.saved - s.failed, 0) if s.total >= 0 else 0
    parts = [f"saved {s.saved:,}/{total}"]
    if s.failed:
        reasons = ", ".join(f"{k} {n:,}" for k, n in failures_by_reason(s).items())
        parts.append(f"{s.failed:,} failed ({reasons})")
    if s.truncated:
        lost = f" ({s.tokens_dropped:,} tokens dropped)" if s.tokens_dropped else ""
        parts.append(f"{s.truncated:,} truncated to max_length{lost}")
    if left:
        parts.append(f"{left:,} left")
    parts += [f"{s.tokens_saved:,} tokens", size(s.bytes_saved), f"took {duration(took_s)}"]
    return "summary: " + " · ".join(parts)


class ProgressLine:
    """Shows :func:`describe` live on a terminal (``console``) or as periodic ``emit`` lines."""

    def __init__(
        self,
        console: Any | None = None,
        emit: Callable[[str], None] | None = None,
        every: float = EVERY_S,
    ) -> None:
        self.every = every
        self.emit = emit or (lambda text: log.info("%s", text))
        self._live: Any = None
        self._console = console
        self._last_at = float("-inf")
        self._last_key: tuple[str, str] = ("", "")

    @classmethod
    def for_daemon(cls) -> ProgressLine:
        """Live on the terminal the daemon's log goes to, else log lines (journald)."""
        from eagle3d.serve.logsetup import terminal_console

        return cls(console=terminal_console())

    @classmethod
    def for_stream(cls, stream: TextIO = sys.stdout, every: float = EVERY_S) -> ProgressLine:
        """Live on ``stream`` if it is a terminal, else plain lines printed to it."""
        console = None
        if stream.isatty():
            from rich.console import Console

            console = Console(file=stream, highlight=False)

        def emit(text: str) -> None:
            print(f"  {text}", file=stream, flush=True)

        return cls(console=console, emit=emit, every=every)

    @property
    def live(self) -> bool:
        return self._console is not None

    def _render(self, s: ShardState, now: float) -> Any:
        from rich.text import Text

        t = Text()
        if s.total > 0 and s.state not in ("empty", "starting", "loading"):
            done = min(s.saved / s.total, 1.0)
            cells = int(done * 24)
            t.append("━" * cells, style="green")
            t.append("━" * (24 - cells), style="bright_black")
            t.append(" ")
        t.append(describe(s, now))
        width = self._console.width if self._console is not None else 120
        t.truncate(max(width - 1, 20))
        return t

    def update(self, s: ShardState, now: float) -> None:
        if self._console is not None:
            if self._live is None:
                from rich.live import Live

                self._live = Live(
                    self._render(s, now),
                    console=self._console,
                    auto_refresh=False,
                    transient=False,
                    redirect_stdout=False,
                    redirect_stderr=False,
                )
                self._live.start()
            self._live.update(self._render(s, now), refresh=True)
            return
        key = ("starting" if s.state == "empty" else s.state, s.producer)
        if key != self._last_key or now - self._last_at >= self.every:
            self._last_key, self._last_at = key, now
            self.emit(describe(s, now))

    def close(self, s: ShardState, now: float) -> None:
        """On a terminal the final state stays on screen (a plain log says its own last
        word: the daemon's "finished" line, the demo's summary)."""
        if self._live is not None:
            self._live.update(self._render(s, now), refresh=True)
            self._live.stop()
            self._live = None


__all__ = ["ProgressLine", "describe", "failures_by_reason", "summary"]
