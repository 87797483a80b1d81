"""sd_notify against real AF_UNIX datagram sockets, the watchdog policy and the STATUS line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
from eagle3d.notify import (
    DEFAULT_STALL_SEC,
    MAX_STATUS_CHARS,
    Notifier,
    WatchdogPolicy,
    format_duration,
    format_rate,
    format_status,
)
from eagle3proto.reducer import Rates, View


@pytest.fixture
def listener(tmp_path) -> Iterator[tuple[str, socket.socket]]:
    """A datagram socket bound where systemd's NOTIFY_SOCKET would be."""
    path = str(tmp_path / "notify.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(2.0)
    yield path, s
    s.close()


def recv(s: socket.socket) -> list[str]:
    return s.recv(4096).decode().split("\n")


def nothing_pending(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        s.recv(4096)
    except BlockingIOError:
        return True
    finally:
        s.settimeout(2.0)
    return False


def test_messages_arrive_as_single_datagrams(listener):
    path, s = listener
    n = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert n.enabled
    assert n.extend_timeout(600_000_000)
    assert recv(s) == ["EXTEND_TIMEOUT_USEC=600000000"]
    assert n.ready()
    assert recv(s) == ["READY=1"]
    assert n.status("saved 1/2")
    assert recv(s) == ["STATUS=saved 1/2"]
    assert n.watchdog()
    assert recv(s) == ["WATCHDOG=1"]
    assert n.stopping("draining 3 in flight")
    assert recv(s) == ["STOPPING=1", "STATUS=draining 3 in flight"]
    assert n.ready(status="up")
    assert recv(s) == ["READY=1", "STATUS=up"]
    assert n.sent == 6 and n.errors == 0
    assert nothing_pending(s)


def test_status_is_one_line_and_bounded(listener):
    path, s = listener
    n = Notifier(path)
    n.status("line one\nline two\tthree")
    assert recv(s) == ["STATUS=line one line two three"]
    n.status("x" * 1000)
    (line,) = recv(s)
    assert line.startswith("STATUS=x") and len(line) == len("STATUS=") + MAX_STATUS_CHARS


def test_abstract_socket():
    name = f"eagle3d-test-{uuid.uuid4().hex}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(2.0)
    try:
        n = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert n.ready()
        assert recv(s) == ["READY=1"]
    finally:
        s.close()


def test_no_socket_is_a_noop():
    n = Notifier.from_env({})
    assert not n.enabled
    assert n.watchdog_interval is None
    assert not n.ready() and not n.status("x") and not n.watchdog() and not n.stopping()
    assert n.sent == 0 and n.errors == 0


def test_send_errors_are_swallowed(tmp_path):
    # The manager went away: the path no longer exists / nobody listens.
    n = Notifier(str(tmp_path / "gone.sock"))
    assert n.ready() is False
    assert n.errors == 1
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(tmp_path / "gone.sock"))
    try:
        assert n.status("back")  # the same notifier recovers once the socket exists
        assert s.recv(100) == b"STATUS=back"
    finally:
        s.close()


def test_watchdog_interval_honours_watchdog_pid():
    env = {"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "5000000"}
    assert Notifier.from_env(env).watchdog_interval == 5.0
    assert Notifier.from_env({**env, "WATCHDOG_PID": str(os.getpid())}).watchdog_interval == 5.0
    assert Notifier.from_env({**env, "WATCHDOG_PID": "1"}, pid=4242).watchdog_interval is None
    assert Notifier.from_env({**env, "WATCHDOG_PID": "4242"}, pid=4242).watchdog_interval == 5.0
    assert Notifier.from_env({**env, "WATCHDOG_USEC": "0"}).watchdog_interval is None
    assert Notifier.from_env({**env, "WATCHDOG_USEC": "soon"}).watchdog_interval is None


def test_from_env_defaults_to_process_environment(listener):
    """A child started with NOTIFY_SOCKET (as systemd starts the daemon) reaches the socket."""
    path, s = listener
    code = "from eagle3d.notify import Notifier; import sys; sys.exit(0 if Notifier.from_env().ready('up') else 1)"
    env = {**os.environ, "NOTIFY_SOCKET": path}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    assert recv(s) == ["READY=1", "STATUS=up"]


# -- watchdog policy -----------------------------------------------------------------------


def test_policy_pings_while_progressing_and_stops_on_a_stall():
    p = WatchdogPolicy(stall_after=30.0)
    assert p.should_ping(now=1000.0, last_progress=990.0, in_flight=4)
    assert p.should_ping(now=1029.9, last_progress=1000.0, in_flight=4)
    assert not p.should_ping(now=1030.0, last_progress=1000.0, in_flight=4)
    d = p.decide(now=1100.0, last_progress=1000.0, in_flight=4)
    assert not d.ping and "1 m 40 s" in d.reason and "4 in flight" in d.reason


def test_policy_idle_or_nothing_outstanding_keeps_pinging():
    p = WatchdogPolicy(stall_after=30.0)
    # Loading the model / paused on a full disk / waiting for input: legitimately quiet.
    assert p.should_ping(now=5000.0, last_progress=0.0, in_flight=7, idle=True)
    # Nothing sent and unsaved: no request can be hung.
    assert p.should_ping(now=5000.0, last_progress=0.0, in_flight=0)
    assert p.decide(5000.0, 0.0, 0).reason == "nothing outstanding"


def test_policy_threshold_argument_and_env():
    p = WatchdogPolicy(stall_after=30.0)
    assert not p.should_ping(100.0, 0.0, 1, stall_after=50.0)
    assert p.should_ping(40.0, 0.0, 1, stall_after=50.0)
    assert WatchdogPolicy.from_env({}).stall_after == DEFAULT_STALL_SEC
    assert WatchdogPolicy.from_env({"EAGLE3D_STALL_SEC": "8"}).stall_after == 8.0
    assert WatchdogPolicy.from_env({"EAGLE3D_STALL_SEC": "-1"}).stall_after == DEFAULT_STALL_SEC
    assert WatchdogPolicy.from_env({"EAGLE3D_STALL_SEC": "x"}).stall_after == DEFAULT_STALL_SEC


# -- STATUS formatting ---------------------------------------------------------------------


def test_format_status_running():
    v = View(
        state="running", total=37312, saved=18420, rate_eta=Rates(samples_s=1.1), eta_s=17280.0
    )
    assert format_status(v) == "saved 18,420/37,312 · 1.1 samples/s · ETA 4 h 48 m"


def test_format_status_states_and_failures():
    v = View(state="running", total=10, saved=2, failed=3, rate_eta=Rates(), eta_s=None)
    assert format_status(v) == "saved 2/10 · 0.0 samples/s · ETA unknown · 3 failed"
    v = View(state="finished", total=10, saved=10, eta_s=0.0)
    assert format_status(v) == "saved 10/10 · done"
    v = View(state="draining", total=-1, saved=5, in_flight=2, committing=1, eta_s=None)
    assert format_status(v) == "draining 3 in flight: saved 5 · 0.0 samples/s"
    v = View(state="running", total=100, saved=5, rate_eta=Rates(samples_s=250.0), eta_s=0.38)
    assert format_status(v, "paused") == "paused: saved 5/100 · 250 samples/s · ETA 0 s"


def test_format_helpers():
    assert [format_duration(x) for x in (0, 42, 60, 725, 3600, 17280, 86400, 183600)] == [
        "0 s",
        "42 s",
        "1 m",
        "12 m 5 s",
        "1 h",
        "4 h 48 m",
        "1 d",
        "2 d 3 h",
    ]
    assert [format_rate(x) for x in (0.0, 0.05, 0.1234, 1.06, 12.34, 1234.5)] == [
        "0.0",
        "0.05",
        "0.1",
        "1.1",
        "12.3",
        "1,234",
    ]
