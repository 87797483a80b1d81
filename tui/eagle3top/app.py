"""The Textual app: one screen that states the verdict, then the numbers behind it.

Widgets only place text; what they say comes from :mod:`eagle3top.panels` (pure) given the
rows the feeds maintain, the verdict (the same :class:`~eagle3top.report.Report` that
``--once`` computes) and ``now`` from the injected clock. Redraws happen on a fixed interval
(not per record) and a panel is only updated when its text changed.

Layout: the header (state and level), the reason, the connection and the Pipeline panel
(the three counters, progress, ETA) always stay on screen; the rest (shards, throughput,
disk, producer, GPU, history, errors) sits below them and scrolls when the terminal is short
(80x24). Below 110 columns the panels stack; from 36 lines a 15-minute history chart shows
and the errors panel takes what is left.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable

from eagle3proto import locks
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid, VerticalScroll
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.timer import Timer
from textual.widgets import Footer, Static

from . import hostpanels, panels
from .feeds import Feed, ShardWatch
from .model import Row, stamp_clocks

HELP = """\
eagle3-top: every number comes from the daemon's journal (via its socket, the
journal file itself, or an ssh relay) and is shown with its age.

  q   quit
  ?   this help
  p   freeze the screen (data is still collected; the header says SCREEN FROZEN)
  r   reconnect now (skip the back-off)

Header: the verdict `eagle3-top --once` gives (state, level, reason), coloured by
level: green OK, yellow WARNING, red CRITICAL, magenta UNKNOWN.

Connection line:
  live                  the socket answered and spoke within the last 5 s
  STALE for N s         the socket is open but silent
  journal               reading the journal file; the daemon is up or down as
                        its shard lock (OUTPUT/.eagle3d/shard-I-of-N.lock) says
  disconnected, retrying in N s   nothing to read right now

Pipeline: sent -> dumped -> saved. in flight = sent - dumped, committing =
dumped - saved, each with the age of its last change. failed = given up for good
(its own count: never progress). The ETA uses the rate since the producer came up
and freezes (saying why) while the work is paused or stopped.

press any key to close"""

#: (widget id, border title); the pipeline is fixed at the top, the rest in #body.
PANELS = (
    ("throughput", "Throughput"),
    ("disk", "Disk"),
    ("producer", "Producer / server"),
    ("gpus", "GPU"),
)
WIDE_AT = 110  # columns: two panel columns from here
TALL_AT = 36  # lines: the history chart from here
SHARD_POLL_S = 2.0  # how often a new shard's journal folder is looked for


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Static { width: 92; max-width: 100%; height: auto; max-height: 100%;
                          border: round $accent; padding: 1 2; background: $surface; }
    """

    def compose(self) -> ComposeResult:
        yield Static(HELP)

    def on_key(self) -> None:
        self.dismiss()


class Eagle3Top(App[int]):
    """The monitor. ``feeds`` keep ``rows`` current; ``clock`` gives wall time; ``watch``
    adds the feeds of shards that start later."""

    TITLE = "eagle3-top"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    Screen { layout: vertical; }
    #header { height: 1; }
    #verdict { height: auto; max-height: 3; padding: 0 1; text-wrap: nowrap;
               text-overflow: ellipsis; }
    #conn { height: auto; max-height: 4; padding: 0 1; text-wrap: nowrap; text-overflow: ellipsis; }
    .panel { border: round $primary; border-title-align: left; padding: 0 1; height: auto;
             text-wrap: nowrap; text-overflow: ellipsis; }
    #pipeline { height: auto; }
    #body { height: 1fr; width: 100%; scrollbar-size-vertical: 1; }
    #fleet { border: round $secondary; }
    #grid { grid-size: 2; grid-columns: 7fr 5fr; grid-rows: auto; grid-gutter: 0 1;
            height: auto; }
    #history { display: none; }
    #errors { height: 1fr; min-height: 5; }
    """
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("p", "pause", "Freeze"),
        Binding("r", "reconnect", "Reconnect"),
    ]

    def __init__(
        self,
        feeds: list[Feed] | None = None,
        *,
        rows: list[Row] | None = None,
        clock: Callable[[], float] = time.time,
        boot: Callable[[], tuple[str, float]] | None = None,
        interval: float = 1.0,
        tz_offset_s: float | None = None,
        run_feeds: bool = True,
        watch: ShardWatch | None = None,
    ) -> None:
        super().__init__()
        self.feeds = feeds or []
        self.rows = rows if rows is not None else [f.row for f in self.feeds]
        self.clock = clock
        self.boot = boot or _boot_clock
        self.interval = interval
        self.tz_offset_s = tz_offset_s
        self.run_feeds = run_feeds
        self.shard_watch = watch
        self.paused = False
        self._shown: dict[str, Text] = {}
        self._drawn_version: tuple[int, ...] = ()
        self._pipeline_at = float("-inf")  # monotonic time the pipeline panel was drawn
        self._pipeline_due: Timer | None = None
        self._ticker: Timer | None = None
        self._tasks: dict[Feed, asyncio.Task[None]] = {}
        self._watched_at = float("-inf")

    def compose(self) -> ComposeResult:
        yield Static(id="header")
        yield Static(id="verdict")
        yield Static(id="conn")
        pipe = Static(id="pipeline", classes="panel")
        pipe.border_title = "Pipeline"
        yield pipe
        with VerticalScroll(id="body"):
            fleet = Static(id="fleet", classes="panel")
            fleet.border_title = "Shards"
            fleet.display = len(self.rows) > 1
            yield fleet
            with Grid(id="grid"):
                for wid, title in PANELS:
                    w = Static(id=wid, classes="panel")
                    w.border_title = title
                    yield w
            hist = Static(id="history", classes="panel")
            hist.border_title = "History (samples saved)"
            yield hist
            errs = Static(id="errors", classes="panel")
            errs.border_title = "Recent errors"
            yield errs
        yield Footer()

    def on_mount(self) -> None:
        for f in self.feeds:
            self._start_feed(f)
        self._ticker = self.set_interval(self.interval, self.tick)
        self.tick()

    def _start_feed(self, f: Feed) -> None:
        f.on_change = self.records_arrived
        # A busy socket is read four times per interval; every other read repaints the
        # counters in the same wake-up (see records_arrived).
        f.coalesce_s = max(self.interval / 4, 0.05)
        if self.run_feeds:
            self._tasks[f] = asyncio.create_task(f.run())

    def _watch_shards(self) -> None:
        """Add the shards whose journal folders appeared since the last look."""
        if self.shard_watch is None or time.monotonic() - self._watched_at < SHARD_POLL_S:
            return
        self._watched_at = time.monotonic()
        new, drop = self.shard_watch.poll(self.feeds)
        for f in drop:
            task = self._tasks.pop(f, None)
            if task is not None:
                task.cancel()
            self.feeds.remove(f)
            self.rows.remove(f.row)
        for f in new:
            self.feeds.append(f)
            self.rows.append(f.row)
            self._start_feed(f)
        if new or drop:
            self.rows.sort(key=lambda r: r.label)
            self._layout()

    # -- sizes ---------------------------------------------------------------------------------

    def _wide(self) -> bool:
        return self.size.width >= WIDE_AT

    def _widths(self) -> tuple[int, int, int]:
        """Content widths: the full width, the left and the right panel column."""
        w = max(self.size.width, 40)
        full = w - 4  # border and padding
        if not self._wide():
            return full, full, full
        return full, (w - 1) * 7 // 12 - 4, (w - 1) * 5 // 12 - 4

    def _layout(self) -> None:
        try:
            grid = self.query_one("#grid", Grid)
            hist = self.query_one("#history", Static)
            fleet = self.query_one("#fleet", Static)
        except NoMatches:
            return
        wide = self._wide()
        grid.styles.grid_size_columns = 2 if wide else 1
        grid.styles.grid_columns = "7fr 5fr" if wide else "1fr"
        hist.display = self.size.height >= TALL_AT
        fleet.display = len(self.rows) > 1
        self._shown.clear()  # widths changed: every panel is drawn anew

    def on_resize(self) -> None:
        self._layout()
        self.call_after_refresh(self.tick)

    async def on_unmount(self) -> None:
        for timer in (self._pipeline_due, self._ticker):
            if timer is not None:
                timer.stop()
        for t in self._tasks.values():
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

    def _align_pipeline(self) -> None:
        """The Pipeline panel stands above the scrolling body: while the body shows its
        scrollbar, leave that column free too, so every panel ends in the same column."""
        try:
            body = self.query_one("#body", VerticalScroll)
            pipe = self.query_one("#pipeline", Static)
        except NoMatches:
            return
        want = 1 if body.show_vertical_scrollbar else 0
        if pipe.styles.margin.right != want:
            pipe.styles.margin = (0, want, 0, 0)

    def _pipeline_gap(self) -> int:
        try:
            return int(self.query_one("#pipeline", Static).styles.margin.right)
        except NoMatches:
            return 0

    def _now(self) -> float:
        """The wall time, with the boot clock read at the same moment for every row (their
        ages are boot-clock differences where the journal is of this boot)."""
        stamp_clocks(self.rows, *self.boot())
        return self.clock()

    def tick(self) -> None:
        """Redraw from the rows at ``clock()``; only the header while the screen is frozen."""
        self._watch_shards()
        now = self._now()
        rows, tz = self.rows, self.tz_offset_s
        report = panels.verdict(rows, now)
        self._set("header", panels.header(rows, now, self.paused, tz, report))
        if self.paused:
            return
        if self._panel("fleet") is None:
            return  # closing
        self._align_pipeline()
        full, left, right = self._widths()
        self._set("verdict", panels.verdict_line(report, rows, now, width=full + 2))
        if len(rows) > 1:
            self._set("fleet", panels.fleet(rows, now, full, report))
        self._set("conn", panels.connection(rows, now))
        self._mark_pipeline()
        gap = self._pipeline_gap()
        self._set("pipeline", panels.pipeline(rows, now, full - gap, tz, report))
        tall = self.size.height >= TALL_AT
        span = 900 if tall else panels.SPARK_SECONDS
        self._set("throughput", panels.throughput(rows, now, left, span))
        self._set("disk", hostpanels.disk(rows, now))
        self._set("producer", hostpanels.producer(rows, now, report, left))
        self._set("gpus", hostpanels.gpus(rows, now, right))
        if tall:
            self._set("history", panels.history(rows, now, full))
        errs = self._panel("errors")
        limit = max(errs.size.height - 2, 5) if errs is not None and errs.size.height else 12
        self._set("errors", panels.errors(rows, now, limit=limit, tz_offset_s=tz))

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
        now = self._now()
        full = self._widths()[0]
        gap = self._pipeline_gap()
        self._set("pipeline", panels.pipeline(self.rows, now, full - gap, self.tz_offset_s))

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


def _boot_clock() -> tuple[str, float]:
    return locks.boot_id(), locks.boottime()


def build_feeds(
    args: argparse.Namespace, clock: Callable[[], float]
) -> tuple[list[Feed], ShardWatch | None]:
    from .feeds import LocalFeed, StreamFeed
    from .sources import remote_args, ssh_argv, targets

    if args.hosts:
        return [StreamFeed(h, ssh_argv(h, remote_args(args)), clock) for h in args.hosts], None
    found = targets(args)
    feeds: list[Feed] = [LocalFeed(t, clock, args.interval) for t in found]
    watch = None
    output = next((t.output for t in found if t.output), "")
    if output and not args.socket:
        from eagle3proto.paths import Shard

        want = Shard.parse(args.shard) if args.shard else None
        watch = ShardWatch(
            output,
            lambda t: LocalFeed(t, clock, args.interval),
            found,
            keep=lambda t: want is None or t.shard == want,
        )
    return feeds, watch


def run_app(args: argparse.Namespace) -> int:
    feeds, watch = build_feeds(args, time.time)
    if not feeds:
        print("eagle3-top: nothing to watch: give --output DIR, --socket PATH or HOST")
        return 3
    app = Eagle3Top(feeds, interval=args.interval, watch=watch)
    app.run()
    return 0
