"""The Textual app: one screen that tells the truth at a glance.

Widgets only place text; what they say comes from :mod:`eagle3top.panels` (pure) given the
rows the feeds maintain and ``now`` from the injected clock. Redraws happen on a fixed
interval (not per record) and a panel is only updated when its text changed.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.timer import Timer
from textual.widgets import Footer, Static

from . import panels
from .feeds import Feed
from .model import Row

HELP = """\
eagle3-top: every number comes from the daemon's journal (via its socket, the
journal file itself, or an ssh relay) and is shown with its age.

  q   quit
  ?   this help
  p   pause the display (data keeps being collected; PAUSED shows in the header)
  r   reconnect now (skip the back-off)

Connection line:
  live                  the socket answered and spoke within the last 5 s
  STALE for N s         the socket is open but silent
  journal               reading the journal file; the daemon is up or down as
                        its shard lock (OUTPUT/.eagle3d/shard-I-of-N.lock) says
  disconnected, retrying in N s   nothing to read right now

Pipeline: sent -> dumped -> saved. in flight = sent - dumped, committing =
dumped - saved, each with the age of its last change. failed = given up for good.

press any key to close"""

PANELS = (
    ("pipeline", "Pipeline"),
    ("eta", "ETA"),
    ("throughput", "Throughput"),
    ("disk", "Disk"),
    ("producer", "Producer / server"),
    ("gpus", "GPU"),
    ("errors", "Recent errors"),
)


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Static { width: 92; height: auto; border: round $accent; padding: 1 2;
                          background: $surface; }
    """

    def compose(self) -> ComposeResult:
        yield Static(HELP)

    def on_key(self) -> None:
        self.dismiss()


class Eagle3Top(App[int]):
    """The monitor. ``feeds`` keep ``rows`` current; ``clock`` gives wall time."""

    TITLE = "eagle3-top"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    Screen { layout: vertical; }
    #header { height: 1; }
    #conn { height: auto; max-height: 6; padding: 0 1; text-wrap: nowrap; text-overflow: ellipsis; }
    #fleet { height: auto; max-height: 12; border: round $secondary; border-title-align: left;
             padding: 0 1; text-wrap: nowrap; text-overflow: ellipsis; }
    #grid { grid-size: 2; grid-columns: 7fr 5fr; grid-rows: auto; grid-gutter: 0 1;
            height: 1fr; overflow-y: auto; }
    .panel { border: round $primary; border-title-align: left; padding: 0 1; height: auto;
             text-wrap: nowrap; text-overflow: ellipsis; }
    #errors { column-span: 2; height: 1fr; min-height: 4; }
    """
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("p", "pause", "Pause"),
        Binding("r", "reconnect", "Reconnect"),
    ]

    def __init__(
        self,
        feeds: list[Feed] | None = None,
        *,
        rows: list[Row] | None = None,
        clock: Callable[[], float] = time.time,
        interval: float = 1.0,
        tz_offset_s: float | None = None,
        run_feeds: bool = True,
    ) -> None:
        super().__init__()
        self.feeds = feeds or []
        self.rows = rows if rows is not None else [f.row for f in self.feeds]
        self.clock = clock
        self.interval = interval
        self.tz_offset_s = tz_offset_s
        self.run_feeds = run_feeds
        self.paused = False
        self._shown: dict[str, Text] = {}
        self._drawn_version: tuple[int, ...] = ()
        self._pipeline_at = float("-inf")  # monotonic time the pipeline panel was drawn
        self._pipeline_due: Timer | None = None
        self._ticker: Timer | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def compose(self) -> ComposeResult:
        yield Static(id="header")
        yield Static(id="conn")
        fleet = Static(id="fleet")
        fleet.border_title = "Shards"
        fleet.display = len(self.rows) > 1
        yield fleet
        with Grid(id="grid"):
            for wid, title in PANELS:
                w = Static(id=wid, classes="panel")
                w.border_title = title
                yield w
        yield Footer()

    def on_mount(self) -> None:
        for f in self.feeds:
            f.on_change = self.records_arrived
            # A busy socket is read four times per interval; every other read repaints the
            # counters in the same wake-up (see records_arrived).
            f.coalesce_s = max(self.interval / 4, 0.05)
        if self.run_feeds:
            self._tasks = [asyncio.create_task(f.run()) for f in self.feeds]
        self._ticker = self.set_interval(self.interval, self.tick)
        self.tick()

    def on_resize(self) -> None:
        # Below 110 columns two panel columns crop the Pipeline counters: stack the panels.
        grid = self.query_one("#grid", Grid)
        narrow = self.size.width < 110
        grid.styles.grid_size_columns = 1 if narrow else 2
        grid.styles.grid_columns = "1fr" if narrow else "7fr 5fr"
        self.query_one("#errors").styles.column_span = 1 if narrow else 2

    async def on_unmount(self) -> None:
        for timer in (self._pipeline_due, self._ticker):
            if timer is not None:
                timer.stop()
        for t in self._tasks:
            t.cancel()

    def _panel(self, wid: str) -> Static | None:
        """The panel ``wid``, or None once the app is closing.

        The app's timers can fire after the screen's widgets were removed at exit (a full
        test run caught NoMatches('#fleet') there); drawing then has nothing to draw on.
        """
        try:
            return self.query_one(f"#{wid}", Static)
        except NoMatches:
            return None

    def _set(self, wid: str, text: Text) -> None:
        if self._shown.get(wid) == text:
            return  # unchanged: no redraw (Textual stays idle)
        panel = self._panel(wid)
        if panel is None:
            return
        old = self._shown.get(wid)
        self._shown[wid] = text
        # Re-layout only when the height may change; otherwise repaint just this widget.
        same_height = old is not None and old.plain.count("\n") == text.plain.count("\n")
        panel.update(text, layout=not same_height)

    def tick(self) -> None:
        """Redraw from the rows at ``clock()``; only the header while paused."""
        now = self.clock()
        rows, tz = self.rows, self.tz_offset_s
        self._set("header", panels.header(rows, now, self.paused, tz))
        if self.paused:
            return
        fleet = self._panel("fleet")
        if fleet is None:
            return  # closing
        want = len(rows) > 1
        if fleet.display != want:
            fleet.display = want
        if len(rows) > 1:
            self._set("fleet", panels.fleet(rows, now))
        self._set("conn", panels.connection(rows, now))
        self._mark_pipeline()
        self._set("pipeline", panels.pipeline(rows, now))
        self._set("throughput", panels.throughput(rows, now))
        self._set("eta", panels.eta(rows, now, tz))
        self._set("disk", panels.disk(rows, now))
        self._set("gpus", panels.gpus(rows, now))
        self._set("producer", panels.producer(rows, now))
        self._set("errors", panels.errors(rows, now, tz_offset_s=tz))

    def _version(self) -> tuple[int, ...]:
        return tuple(r.state.seq if r.state is not None else -2 for r in self.rows)

    def records_arrived(self) -> None:
        """A feed folded new records: repaint the counters now, or soon.

        The counters are what people watch. A busy feed reads every interval/4; a read that
        comes interval/2 (less a little) after the last repaint repaints the pipeline panel at
        once, in the same wake-up, so 'saved' on screen is at most about interval/2 behind.
        A read sooner than that leaves a fallback repaint for when no further read comes.
        Nothing runs while nothing arrives: an idle monitor wakes once per interval.
        """
        if self.paused:
            return
        since = time.monotonic() - self._pipeline_at
        if since >= 0.45 * self.interval:
            self.fast_tick()
        elif self._pipeline_due is None:
            self._pipeline_due = self.set_timer(0.75 * self.interval - since, self._fallback)

    def _fallback(self) -> None:
        self._pipeline_due = None
        self.fast_tick()

    def fast_tick(self) -> None:
        """Repaint the pipeline panel alone if records arrived since it was drawn."""
        if self._pipeline_due is not None:
            self._pipeline_due.stop()
            self._pipeline_due = None
        if self.paused or self._version() == self._drawn_version:
            return
        self._mark_pipeline()
        self._set("pipeline", panels.pipeline(self.rows, self.clock()))

    def _mark_pipeline(self) -> None:
        self._drawn_version = self._version()
        self._pipeline_at = time.monotonic()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.tick()

    def action_reconnect(self) -> None:
        for f in self.feeds:
            f.reconnect()
        self.notify("reconnecting now", timeout=2)
        self.tick()


def build_feeds(args: argparse.Namespace, clock: Callable[[], float]) -> list[Feed]:
    from .cli import remote_args, targets
    from .feeds import LocalFeed, StreamFeed
    from .sources import ssh_argv

    if args.hosts:
        return [StreamFeed(h, ssh_argv(h, remote_args(args)), clock) for h in args.hosts]
    return [LocalFeed(t, clock, args.interval) for t in targets(args)]


def run_app(args: argparse.Namespace) -> int:
    feeds = build_feeds(args, time.time)
    if not feeds:
        print("eagle3-top: nothing to watch: give --output DIR, --socket PATH or HOST")
        return 3
    app = Eagle3Top(feeds, interval=args.interval)
    app.run()
    return 0
