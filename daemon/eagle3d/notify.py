"""sd_notify in pure Python: readiness, status, watchdog and stop notices for systemd.

The protocol (sd_notify(3)) is one ``AF_UNIX`` datagram of newline-separated ``KEY=VALUE``
lines sent to ``$NOTIFY_SOCKET``; a leading ``@`` names an abstract socket. It is stable,
so no libsystemd binding is needed. Without ``$NOTIFY_SOCKET`` (not under systemd, or
``Type=simple``) every method is a no-op, and send errors are ignored, as the man page asks:
a notification must never take the daemon down.

Also here, both pure (time is an argument):

* :func:`format_status` turns a :class:`eagle3proto.reducer.View` into the one-line STATUS
  shown by ``systemctl status`` ("saved 18,420/37,312 · 1.1 samples/s · ETA 4 h 48 m");
* :class:`WatchdogPolicy` decides whether the pipeline deserves a ``WATCHDOG=1`` ping, so a
  hung producer or a stuck commit stops the pings and systemd restarts the service, while an
  event loop that merely keeps ticking does not hide the hang.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from eagle3proto.reducer import View

# STATUS is shown on one line of `systemctl status`; keep it short and free of newlines.
MAX_STATUS_CHARS = 200
STALL_ENV = "EAGLE3D_STALL_SEC"
DEFAULT_STALL_SEC = 300.0


class Notifier:
    """Sends sd_notify messages to one address; a Notifier without an address does nothing.

    ``address`` is the raw ``$NOTIFY_SOCKET`` value (a path, or ``@name`` for an abstract
    socket). ``watchdog_usec`` is the watchdog interval systemd expects pings within, or None
    when the watchdog is off for this process.
    """

    def __init__(self, address: str | None = None, watchdog_usec: int | None = None) -> None:
        self.address = address or None
        self._watchdog_usec = watchdog_usec if watchdog_usec and watchdog_usec > 0 else None
        self._sock: socket.socket | None = None
        self.sent = 0
        self.errors = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, pid: int | None = None) -> Notifier:
        """The notifier systemd asked for through the environment (``os.environ`` by default).

        ``WATCHDOG_USEC`` applies only when ``WATCHDOG_PID`` is unset or names this process
        (``pid``, default ``os.getpid()``): a child that inherited the variables must not
        believe it owns the watchdog.
        """
        env = os.environ if env is None else env
        address = env.get("NOTIFY_SOCKET") or None
        usec: int | None = None
        try:
            usec = int(env.get("WATCHDOG_USEC", ""))
        except ValueError:
            usec = None
        wpid = env.get("WATCHDOG_PID")
        if wpid:
            try:
                if int(wpid) != (os.getpid() if pid is None else pid):
                    usec = None
            except ValueError:
                usec = None
        return cls(address, usec)

    @property
    def enabled(self) -> bool:
        """Whether messages go anywhere (i.e. we run under a notify-aware manager)."""
        return self.address is not None

    @property
    def watchdog_interval(self) -> float | None:
        """The watchdog interval in seconds (ping at least twice per interval), or None."""
        if self._watchdog_usec is None:
            return None
        return self._watchdog_usec / 1_000_000

    def notify(self, *lines: str) -> bool:
        """Send ``lines`` as one datagram. True if it was sent; never raises."""
        if self.address is None or not lines:
            return False
        payload = "\n".join(lines).encode("utf-8", "replace")
        addr: bytes = os.fsencode(self.address)
        if addr.startswith(b"@"):
            addr = b"\0" + addr[1:]
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(payload, addr)
        except OSError:
            # The manager may be gone or reloading; notifications are best effort by design.
            self.errors += 1
            return False
        self.sent += 1
        return True

    def ready(self, status: str | None = None) -> bool:
        """``READY=1``: start-up finished (the producer is up); optionally with a STATUS."""
        lines = ["READY=1"]
        if status is not None:
            lines.append(_status_line(status))
        return self.notify(*lines)

    def status(self, text: str) -> bool:
        """``STATUS=text`` (one line; newlines are flattened, long text is cut)."""
        return self.notify(_status_line(text))

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: the pipeline is alive. Only send it when :class:`WatchdogPolicy` agrees."""
        return self.notify("WATCHDOG=1")

    def watchdog_trigger(self) -> bool:
        """``WATCHDOG=trigger``: ask systemd to treat the service as hung right now."""
        return self.notify("WATCHDOG=trigger")

    def extend_timeout(self, usec: int) -> bool:
        """``EXTEND_TIMEOUT_USEC``: the current start/stop step needs ``usec`` more from now."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={max(int(usec), 0)}")

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1``: the graceful stop has begun; optionally with a STATUS."""
        lines = ["STOPPING=1"]
        if status is not None:
            lines.append(_status_line(status))
        return self.notify(*lines)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _status_line(text: str) -> str:
    flat = " ".join(text.split())
    if len(flat) > MAX_STATUS_CHARS:
        flat = flat[: MAX_STATUS_CHARS - 1] + "…"
    return "STATUS=" + flat


# -- STATUS text ---------------------------------------------------------------------------


def format_duration(seconds: float) -> str:
    """A coarse human duration: "42 s", "12 m 5 s", "4 h 48 m", "2 d 3 h"."""
    s = max(round(seconds), 0)
    if s < 60:
        return f"{s} s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m} m {s} s" if s else f"{m} m"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h} h {m} m" if m else f"{h} h"
    d, h = divmod(h, 24)
    return f"{d} d {h} h" if h else f"{d} d"


def format_rate(per_s: float) -> str:
    """Samples per second with the precision that still says something."""
    if per_s >= 100:
        return f"{per_s:,.0f}"
    if per_s >= 0.1 or per_s <= 0:
        return f"{max(per_s, 0.0):.1f}"
    return f"{per_s:.2g}"


def format_status(view: View, phase: str | None = None) -> str:
    """The STATUS line for ``systemctl status``, from the reducer's view of the run.

    ``"saved 18,420/37,312 · 1.1 samples/s · ETA 4 h 48 m"``, with ``· N failed`` when
    samples failed for good, and the run state (or ``phase``, e.g. ``"loading model"``) in
    front when the run is not simply running. The rate is the one the ETA uses (since the
    producer came up, over the ETA's window).
    """
    saved = f"saved {view.saved:,}/{view.total:,}" if view.total >= 0 else f"saved {view.saved:,}"
    parts = [saved]
    if view.state == "finished":
        parts.append("done")
    else:
        parts.append(f"{format_rate(view.rate_eta.samples_s)} samples/s")
        if view.eta_s is not None:
            parts.append(f"ETA {format_duration(view.eta_s)}")
        elif view.state == "running":
            parts.append("ETA unknown")
    if view.failed:
        parts.append(f"{view.failed:,} failed")
    head = phase or ("" if view.state in ("running", "finished", "empty") else view.state)
    if view.state == "draining" and not phase:
        head = f"draining {view.in_flight + view.committing:,} in flight"
    line = " · ".join(parts)
    return f"{head}: {line}" if head else line


# -- the watchdog policy -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WatchdogDecision:
    ping: bool
    reason: str


@dataclass(frozen=True, slots=True)
class WatchdogPolicy:
    """Whether the daemon should send ``WATCHDOG=1`` now. Pure: ``now`` is an argument.

    The daemon pings only when the pipeline is demonstrably alive:

    * it is legitimately idle or in a known-long phase (model load, final flush, nothing
      left to do), or
    * nothing is outstanding (``in_flight == 0``: no request waits on the producer and no
      dump waits for its commit, so nothing can be stuck), or
    * something completed (a sample saved or failed for good) less than ``stall_after``
      seconds ago.

    Otherwise work is outstanding and nothing has moved for ``stall_after`` seconds: a hung
    producer or a stuck commit. The pings stop and systemd kills and restarts the service
    ``WatchdogSec=`` later; the journal makes the restart an exact resume. ``in_flight``
    should count samples sent but not yet saved (in flight plus committing).
    """

    stall_after: float = DEFAULT_STALL_SEC

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WatchdogPolicy:
        """Policy with ``stall_after`` from ``$EAGLE3D_STALL_SEC`` (default 300 s)."""
        env = os.environ if env is None else env
        try:
            stall = float(env.get(STALL_ENV, ""))
        except ValueError:
            stall = DEFAULT_STALL_SEC
        return cls(stall if stall > 0 else DEFAULT_STALL_SEC)

    def decide(
        self,
        now: float,
        last_progress: float,
        in_flight: int,
        idle: bool = False,
        stall_after: float | None = None,
    ) -> WatchdogDecision:
        """The decision with a reason (the reason suits a log line or the STATUS)."""
        limit = self.stall_after if stall_after is None else stall_after
        if idle:
            return WatchdogDecision(True, "idle")
        if in_flight <= 0:
            return WatchdogDecision(True, "nothing outstanding")
        quiet = now - last_progress
        if quiet < limit:
            return WatchdogDecision(True, "progressing")
        return WatchdogDecision(
            False, f"stalled: no progress for {format_duration(quiet)} with {in_flight:,} in flight"
        )

    def should_ping(
        self,
        now: float,
        last_progress: float,
        in_flight: int,
        idle: bool = False,
        stall_after: float | None = None,
    ) -> bool:
        """True when ``WATCHDOG=1`` should be sent (see the class docstring)."""
        return self.decide(now, last_progress, in_flight, idle, stall_after).ping
