"""``eagle3d serve-sglang`` and ``eagle3d sglang-args``: a stock SGLang server set up for extraction.

The extra arguments (checked against SGLang 0.5.21's ``ServerArgs`` by the conformance test):

* ``--forward-hooks '[{...eagle3d.sglang_hook:make_hook...}]'`` loads the capture hook;
* ``--disable-radix-cache``: a prefix-cache hit skips the prefill of the cached tokens, whose
  states would then be missing (the hook refuses such requests; this makes them not happen);
* ``--disable-prefill-cuda-graph``: a replayed CUDA graph never calls Python hooks;
* ``--enable-metrics``: ``/metrics`` for the client's stats (prompt tokens, running, queued).

Chunked prefill stays on: the hook assembles chunks (it knows each request's length from its
rid). The server also needs ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false`` in its
environment so that ``/health`` answers without running a generation
(``sglang/srt/entrypoints/http_server.py``; default true in ``sglang/srt/environ.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from . import storedtype

log = logging.getLogger("eagle3d.sglang")

HEALTH_ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}
FIXED_ARGS = ["--disable-radix-cache", "--disable-prefill-cuda-graph", "--enable-metrics"]
# User arguments that would defeat the capture (the hook also refuses them at load time).
CONFLICTS = {
    "--forward-hooks": "eagle3d supplies the forward hooks",
    "--cuda-graph-backend-prefill": "prefill CUDA graphs never call hooks",
    "--cuda-graph-config": "prefill CUDA graphs never call hooks",
    "--enable-dp-attention": "the hook supports tensor parallelism only",
    "--pp-size": "the hook supports tensor parallelism only",
    "--pipeline-parallel-size": "the hook supports tensor parallelism only",
    "--attn-cp-size": "the hook supports tensor parallelism only",
    "--enable-two-batch-overlap": "two-batch overlap skips the aux capture",
    "--speculative-algorithm": "a draft model would own the aux capture",
}


def extra_args(
    dump_dir: str,
    aux_layers: list[int] | None = None,
    max_pending: int = 4,
    store_dtype: str | None = None,
) -> list[str]:
    """The arguments eagle3d adds to ``python -m sglang.launch_server``."""
    from .sglang_hook import hook_spec

    spec = hook_spec(os.path.abspath(dump_dir), aux_layers, max_pending, store_dtype)
    return ["--forward-hooks", json.dumps([spec], separators=(",", ":")), *FIXED_ARGS]


def default_layers(model_path: str | None) -> list[int] | None:
    """``[2, L//2, L-3]`` from a local model directory's config.json, else None.

    Writing the layers into the hook spec lets the client compare them with its job at start-up
    (a mismatch would otherwise fail every dump). A hub id or an unreadable config leaves the
    choice to the hook, which asks the model for its EAGLE-3 default.
    """
    if not model_path:
        return None
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        n = int(cfg.get("text_config", cfg)["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return [2, n // 2, n - 3]


def model_path_of(user_args: list[str]) -> str | None:
    ns = argparse.ArgumentParser(add_help=False)
    ns.add_argument("--model-path", "--model")
    known, _ = ns.parse_known_args(user_args)
    return known.model_path


def conflicts(user_args: list[str]) -> list[str]:
    """Human reasons for user arguments that cannot be combined with the capture."""
    out = []
    for a in user_args:
        flag = a.split("=", 1)[0]
        if flag in CONFLICTS:
            out.append(f"{flag}: {CONFLICTS[flag]}")
    return out


def server_url(user_args: list[str]) -> str:
    """``http://host:port`` the server will listen on (SGLang defaults 127.0.0.1:30000)."""
    ns = argparse.ArgumentParser(add_help=False)
    ns.add_argument("--host", default="127.0.0.1")
    ns.add_argument("--port", type=int, default=30000)
    known, _ = ns.parse_known_args(user_args)
    host = "127.0.0.1" if known.host in ("0.0.0.0", "::", "") else known.host
    return f"http://{host}:{known.port}"


def command(
    python: str,
    user_args: list[str],
    dump_dir: str,
    aux_layers: list[int] | None,
    max_pending: int,
    store_dtype: str | None = None,
) -> list[str]:
    return [
        python,
        "-m",
        "sglang.launch_server",
        *user_args,
        *extra_args(dump_dir, aux_layers, max_pending, store_dtype),
    ]


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
        from .notify import Notifier

        Notifier.from_env().status(text)
    except Exception:  # no systemd (or no notify support): the log line says it
        pass


def _notify_ready(url: str) -> None:
    try:
        from .notify import Notifier

        Notifier.from_env().ready(f"SGLang with eagle3d capture ready at {url}")
    except Exception:  # no systemd (or no notify support): nothing to tell
        pass


def _layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--aux-layers: want comma-separated ints, got {text!r}"
        ) from None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--aux-layers",
        type=_layers,
        default=None,
        help="layer ids a,b,c (default: the model's EAGLE-3 default [2, L//2, L-3])",
    )
    p.add_argument(
        "--dump-dir",
        default="/dev/shm/eagle3d-dumps",
        help="where the hook writes dumps (give the daemon the same --dump-dir)",
    )
    p.add_argument(
        "--max-pending",
        type=int,
        default=4,
        help="captured forwards queued for the writer before the forward waits",
    )
    p.add_argument(
        "--store-dtype",
        choices=tuple(storedtype.FORMATS),
        default=None,
        help="cast the states to the job's storage dtype on the GPU before they are copied"
        " out (default: as the server computes them; the daemon's commit casts them then)",
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    user = list(args.sglang_args)
    if user and user[0] == "--":
        user = user[1:]
    bad = conflicts(user)
    if bad:
        print("eagle3d serve-sglang: cannot combine with: " + "; ".join(bad), file=sys.stderr)
        return 2
    if model_path_of(user) is None:
        print("eagle3d serve-sglang: give SGLang's --model-path after --", file=sys.stderr)
        return 2
    os.makedirs(args.dump_dir, exist_ok=True)
    env = {**os.environ, **HEALTH_ENV, "PYTHONUNBUFFERED": "1"}
    layers = args.aux_layers or default_layers(model_path_of(user))
    cmd = command(args.python, user, args.dump_dir, layers, args.max_pending, args.store_dtype)
    if args.dry_run:
        print(" ".join(f"{k}={v}" for k, v in HEALTH_ENV.items()), shlex.join(cmd))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return supervise(
        cmd, env, server_url(user), ready_timeout=args.ready_timeout, stop_timeout=args.stop_timeout
    )


def _cmd_args(args: argparse.Namespace) -> int:
    layers = args.aux_layers or default_layers(args.model_path)
    extra = extra_args(args.dump_dir, layers, args.max_pending, args.store_dtype)
    if args.format == "json":
        print(json.dumps({"args": extra, "env": HEALTH_ENV}))
    else:
        print(shlex.join(extra))
        print(
            "# and in the server's environment: "
            + " ".join(f"{k}={v}" for k, v in HEALTH_ENV.items()),
            file=sys.stderr,
        )
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve-sglang",
        help="start a stock SGLang server with the eagle3d capture hook, and supervise it",
        description="eagle3d serve-sglang [--aux-layers a,b,c] [--dump-dir D] -- <sglang launch_server args>",
    )
    _common(p)
    p.add_argument("--python", default=sys.executable, help="the Python that has sglang installed")
    p.add_argument(
        "--ready-timeout", type=float, default=3600.0, help="seconds to wait for /health"
    )
    p.add_argument(
        "--stop-timeout",
        type=float,
        default=90.0,
        help="seconds SGLang gets to drain after SIGTERM before its processes are killed",
    )
    p.add_argument("--dry-run", action="store_true", help="print the command line and exit")
    p.add_argument("sglang_args", nargs=argparse.REMAINDER, help="-- then SGLang's own arguments")
    p.set_defaults(func=_cmd_serve)
    q = subparsers.add_parser(
        "sglang-args",
        help="print the SGLang arguments the capture needs (for your own launcher)",
    )
    _common(q)
    q.add_argument(
        "--model-path", help="local model directory: writes its default aux layers into the spec"
    )
    q.add_argument("--format", choices=("shell", "json"), default="shell")
    q.set_defaults(func=_cmd_args)
