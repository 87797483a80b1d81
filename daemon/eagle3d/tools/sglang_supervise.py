"""``eagle3d serve-sglang``'s supervisor: one SGLang server at a time, restarted when it dies
after it was ready (:class:`RestartPolicy`), stopped in order on a signal, and its readiness
told to systemd."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("eagle3d.sglang")


def _healthy(url: str, timeout: float = 2.0) -> bool:
    """``GET /health``: with generation off in the server's environment, no request is created."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass(slots=True)
class RestartPolicy:
    """When ``serve-sglang`` starts a server again after it died (pure: times are arguments).

    A server that dies before it was ever ready is a configuration error (bad arguments, a
    hook that refuses the model): not restarted, its status is ``serve-sglang``'s. One that
    was ready and then died (a crash, an out-of-memory kill, a foreign client crashing it) is
    restarted after ``base`` seconds, doubling up to ``cap`` while it keeps dying; a life of
    at least ``stable`` seconds resets the delay. ``max_unready`` restarts in a row that die
    before becoming ready again give up.
    """

    base: float = 2.0
    cap: float = 60.0
    stable: float = 300.0
    max_unready: int = 5
    restarts: int = 0
    ever_ready: bool = False
    unready_in_a_row: int = 0
    delay: float = 0.0

    def died(self, ready: bool, life_s: float) -> float | None:
        """The server died; seconds to wait before starting it again, or None to give up."""
        if not self.ever_ready and not ready:
            return None
        self.ever_ready = True
        self.unready_in_a_row = 0 if ready else self.unready_in_a_row + 1
        if self.unready_in_a_row >= self.max_unready:
            return None
        if ready and life_s >= self.stable:
            self.delay = self.base
        else:
            self.delay = self.base if self.delay == 0 else min(self.delay * 2, self.cap)
        self.restarts += 1
        return self.delay


def _term_with_parent() -> None:
    """In the child: SIGTERM when serve-sglang dies (even by SIGKILL), so SGLang, in a session
    of its own, drains and exits instead of living on, holding its port and memory."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the server outlives a killed supervisor
        pass


def _exit_status(rc: int) -> int:
    return rc if rc >= 0 else 128 - rc


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a member we may not signal: still there
        return True
    return True


class _Server:
    """One life of the server: its own session, so a terminal's Ctrl-C does not reach it."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            cmd, env=env, start_new_session=True, preexec_fn=_term_with_parent
        )
        self.started = time.monotonic()
        self.ready_at: float | None = None

    def stop(self, timeout: float) -> int:
        """Stop in order: SIGTERM to the main process only, so SGLang drains its requests and
        asks its schedulers to exit by themselves (the hook's writer then finishes what is
        queued); after ``timeout`` s, or once the main process is gone, whatever is left of
        the process group gets SIGTERM, then SIGKILL."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("serve-sglang: server still running %.0f s after SIGTERM", timeout)
        self.reap_group()
        return self.proc.wait()

    def reap_group(self, grace: float = 10.0) -> None:
        """Children the main process left behind (a scheduler it did not stop)."""
        pgid = self.proc.pid
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            if not _group_alive(pgid):
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(pgid):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(0.1)  # reap the main process if it is the one left


def supervise(
    cmd: list[str],
    env: dict[str, str],
    url: str,
    *,
    ready_timeout: float = 3600.0,
    poll: float = 2.0,
    stop_timeout: float = 90.0,
    policy: RestartPolicy | None = None,
) -> int:
    """Run the server; restart it when it dies (:class:`RestartPolicy`); on SIGTERM, SIGINT or
    SIGHUP stop it in order (:meth:`_Server.stop`). Returns the exit status of its last life
    (128 + N for a death by signal N)."""
    policy = policy or RestartPolicy()
    stopping: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        stopping.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        while True:
            server = _Server(cmd, env)
            log.info("serve-sglang: started pid %d: %s", server.proc.pid, shlex.join(cmd))
            rc = _watch(server, url, ready_timeout, poll, stopping, policy.restarts)
            if stopping:
                name = signal.Signals(stopping[0]).name
                log.info("serve-sglang: %s: stopping the server (main process first)", name)
                rc = server.stop(stop_timeout)
                log.info("serve-sglang: server exited with status %d", _exit_status(rc))
                return _exit_status(rc)
            server.reap_group()
            life = time.monotonic() - server.started
            delay = policy.died(server.ready_at is not None, life)
            if delay is None:
                log.error(
                    "serve-sglang: server exited with status %d after %.0f s%s; not restarting",
                    _exit_status(rc),
                    life,
                    "" if policy.ever_ready else " before it was ever ready",
                )
                return _exit_status(rc)
            log.warning(
                "serve-sglang: server exited with status %d after %.0f s; restart %d in %.0f s",
                _exit_status(rc),
                life,
                policy.restarts,
                delay,
            )
            _notify_status(f"SGLang died (status {_exit_status(rc)}); restart {policy.restarts}")
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline and not stopping:
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            if stopping:
                return _exit_status(rc)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _watch(
    server: _Server,
    url: str,
    ready_timeout: float,
    poll: float,
    stopping: list[int],
    restarts: int,
) -> int:
    """Wait until the server exits or a stop is asked for; mark it ready on its first /health."""
    proc = server.proc
    while proc.poll() is None and not stopping:
        if server.ready_at is None and _healthy(url):
            server.ready_at = time.monotonic()
            took = server.ready_at - server.started
            log.info("serve-sglang: ready at %s after %.0f s", url, took)
            if restarts:
                _notify_status(f"SGLang ready again at {url} (restart {restarts})")
            else:
                _notify_ready(url)
        elif server.ready_at is None and time.monotonic() - server.started > ready_timeout:
            log.error("serve-sglang: not ready after %.0f s; stopping it", ready_timeout)
            stopping.append(signal.SIGTERM)
            break
        step = time.monotonic() + poll
        while proc.poll() is None and not stopping and time.monotonic() < step:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=min(0.2, poll))
    return proc.returncode if proc.returncode is not None else 0


def _notify_status(text: str) -> None:
    try:
        from eagle3d.serve.notify import Notifier

        Notifier.from_env().status(text)
    except Exception:  # no systemd (or no notify support): the log line says it
        pass


def _notify_ready(url: str) -> None:
    try:
        from eagle3d.serve.notify import Notifier

        Notifier.from_env().ready(f"SGLang with eagle3d capture ready at {url}")
    except Exception:  # no systemd (or no notify support): nothing to tell
        pass
