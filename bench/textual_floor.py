"""The floor for ``bench/monitor.py``: the least a Textual screen can cost at a given refresh.

One ``Static`` whose text changes at every tick (a clock with seconds), nothing else: no
feeds, no sockets, no reducer. Whatever this costs on a machine is what any Textual monitor
repainting once per interval pays there before doing any work of its own.

    python bench/textual_floor.py [INTERVAL_S]
"""

from __future__ import annotations

import sys
import time

from textual.app import App, ComposeResult
from textual.widgets import Static


class Floor(App[None]):
    def __init__(self, interval: float) -> None:
        super().__init__()
        self.interval = interval

    def compose(self) -> ComposeResult:
        yield Static(id="clock")

    def on_mount(self) -> None:
        self.set_interval(self.interval, self.tick)
        self.tick()

    def tick(self) -> None:
        now = time.time()
        self.query_one("#clock", Static).update(f"{time.strftime('%H:%M:%S')} saved {now:.0f}")


if __name__ == "__main__":
    Floor(float(sys.argv[1]) if len(sys.argv) > 1 else 1.0).run()
