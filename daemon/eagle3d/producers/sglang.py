"""The SGLang producer: an HTTP client of a stock SGLang server running the eagle3d capture hook.

Each request is ``POST /generate`` with the token ids, one greedy output token, and the SGLang
rid ``e3d.<send>.<T>.<digest>.<rid>`` (:func:`eagle3d.sglang_hook.sglang_rid`); the hook in the
server writes the dump named ``<rid>``, which the daemon picks up from the dump directory. The
HTTP answer only tells failures apart:

* not up yet at start (refused, reset, 502/503/504): ``producer_state("waiting", "waiting for
  SGLang at URL (N s)")`` at once and every 10 s until it answers, then ``"up"``; an address
  that answers but is not SGLang (a 404 to ``/server_info`` and ``/get_server_info``, a body
  that is not SGLang's) is :class:`NotSGLang`, which stops the daemon with exit 8;
* the server is unreachable later (refused, reset, 502/503/504): the producer reports
  ``producer_state("down")`` once and keeps resending with exponential back-off, without
  failing the sample; ``"up"`` when the server answers again;
* the sample is bad (HTTP 400/413/422, e.g. longer than the context): ``request_failed(...,
  retryable=False)``;
* other errors (500, an aborted request, a prefix-cache hit, a timeout): ``request_failed(...,
  retryable=True)``; the daemon decides how many attempts a sample gets;
* an answered request whose dump does not come: ``DumpWriteError`` with the reason the hook
  left in its failure marker (``ENOSPC: ...``, see :mod:`eagle3d.sglang_hook`) as soon as the
  marker is seen, else ``DumpMissing`` after the grace, naming the dump area's free space.

A poller reads ``/server_info`` (``/get_server_info`` on servers without it) and ``/metrics``
into :meth:`health` ``detail``: prompt tokens total and rate, running and queued requests.
``transport`` is the test seam (``httpx.MockTransport``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import random
import re
import time
import urllib.parse
from typing import Any

import httpx
from eagle3proto.events import ProducerHealth

from ..sglang_hook import FACTORY, parse_failure_marker, sglang_rid
from .base import DumpGrace, Producer, ProducerEvents, Request

log = logging.getLogger("eagle3d.producers.sglang")
# httpx logs every request at INFO: thousands of lines a minute in the daemon's log, and the
# CPU to format them taken from the server beside it.
logging.getLogger("httpx").setLevel(logging.WARNING)

BAD_SAMPLE = (400, 413, 422)
SERVER_DOWN = (502, 503, 504)
METRICS = {
    "sglang:prompt_tokens_total": "prompt_tokens_total",
    "sglang:generation_tokens_total": "generation_tokens_total",
    "sglang:cached_tokens_total": "cached_tokens_total",
    "sglang:num_running_reqs": "num_running_reqs",
    "sglang:num_queue_reqs": "num_queue_reqs",
}


class ServerUnfit(RuntimeError):
    """The server runs without the capture hook, or writes dumps somewhere else."""


class NotSGLang(ServerUnfit):
    """The address answers HTTP, but not as an SGLang server does."""


WAITING_EVERY_S = 10.0  # how often "waiting for SGLang at URL (N s)" is said while it is not up
STALE_MARKER_S = 600.0  # a failure marker nobody read in this long belongs to no live client


def server_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be an SGLang server's address (``http[s]://HOST[:PORT]``), or None."""
    try:
        u = urllib.parse.urlsplit(url)
        port = u.port
    except ValueError as e:
        return f"{url!r} is not a URL ({e}); want http://HOST:PORT"
    if u.scheme not in ("http", "https"):
        return f"{url!r}: want an http:// or https:// URL such as http://127.0.0.1:30000"
    if not u.hostname:
        return f"{url!r} names no host; want http://HOST:PORT"
    if u.query or u.fragment or u.path not in ("", "/"):
        return f"{url!r}: want the server's base URL, http://HOST:PORT, without a path"
    del port
    return None


def _excerpt(r: httpx.Response, n: int = 120) -> str:
    text = " ".join(r.text.split())
    return text[:n] + ("..." if len(text) > n else "")


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Sum the samples of the metrics we read over all their label sets (TP/DP ranks)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        key = METRICS.get(m.group(1)) if m else None
        if m is None or key is None:
            continue
        try:
            out[key] = out.get(key, 0.0) + float(m.group(2))
        except ValueError:
            continue
    return out


def rate(prev: tuple[float, float] | None, value: float, now: float) -> float | None:
    """Per-second rate of a counter between two samples (None across a reset or no interval)."""
    if prev is None:
        return None
    t0, v0 = prev
    if now <= t0 or value < v0:  # a restarted server starts its counters from zero
        return None
    return (value - v0) / (now - t0)


def check_server_info(info: dict[str, Any], dump_dir: str, aux_layers: list[int] | None) -> str:
    """Raise :class:`ServerUnfit` unless the server runs our hook into ``dump_dir``; return its version."""
    hooks = info.get("forward_hooks") or []
    ours = [h for h in hooks if isinstance(h, dict) and h.get("hook_factory") == FACTORY]
    if not ours:
        raise ServerUnfit(
            "the SGLang server runs without the eagle3d capture hook (no forward_hooks entry "
            f"with hook_factory {FACTORY}); start it with `eagle3d serve-sglang` or add "
            "`eagle3d sglang-args` to its arguments"
        )
    cfg = ours[0].get("config") or {}
    theirs = os.path.realpath(str(cfg.get("dump_dir", "")))
    if theirs != os.path.realpath(dump_dir):
        raise ServerUnfit(
            f"the server's hook writes dumps to {theirs}; run the daemon with --dump-dir {theirs}"
        )
    if (
        aux_layers is not None
        and cfg.get("aux_layers") is not None
        and list(cfg["aux_layers"]) != list(aux_layers)
    ):
        raise ServerUnfit(
            f"the server captures aux layers {cfg['aux_layers']}, this job wants {aux_layers}"
        )
    if info.get("disable_radix_cache") is False:
        log.warning(
            "the server runs with the radix cache on: prefix-cache hits are refused and retried"
        )
    return str(info.get("version", "?"))


class SGLangProducer(Producer):
    name = "sglang"

    def __init__(
        self,
        url: str,
        *,
        dump_dir: str,
        aux_layers: list[int] | None,
        concurrency: int = 32,
        request_timeout: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
        start_timeout: float = 3600.0,
        poll_interval: float = 2.0,
        backoff: tuple[float, float] = (0.5, 15.0),
    ) -> None:
        self.url = url.rstrip("/")
        self.dump_dir = dump_dir
        self.aux_layers = aux_layers
        self.concurrency = max(1, concurrency)
        self.request_timeout = request_timeout
        self.transport = transport
        self.start_timeout = start_timeout
        self.poll_interval = poll_interval
        self.backoff = backoff
        self.events: ProducerEvents | None = None
        self.client: httpx.AsyncClient | None = None
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.sem = asyncio.Semaphore(self.concurrency)
        self.up = False
        self.restarts = 0
        self.latency_s = 0.0
        self.detail: dict[str, float | str] = {}
        self._prompt_prev: tuple[float, float] | None = None
        self._poller: asyncio.Task[None] | None = None
        self._last_progress = time.monotonic()
        self._info_path = "/server_info"
        self._went_down = False
        self._grace = DumpGrace()  # answered requests whose dump has not been seen

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self, events: ProducerEvents) -> None:
        self.events = events
        limits = httpx.Limits(
            max_connections=self.concurrency + 4, max_keepalive_connections=self.concurrency + 4
        )
        self.client = httpx.AsyncClient(
            base_url=self.url,
            transport=self.transport,
            timeout=httpx.Timeout(self.request_timeout, connect=10.0),
            limits=limits,
        )
        info = await self._wait_for_server()
        try:
            version = check_server_info(info, self.dump_dir, self.aux_layers)
        except ServerUnfit:
            await self.client.aclose()
            raise
        self.detail["server_version"] = version
        self._set_up(True, f"SGLang {version} at {self.url}")
        self._poller = asyncio.create_task(self._poll())

    async def _wait_for_server(self) -> dict[str, Any]:
        """``/server_info`` once the server answers; "waiting" every 10 s until then.

        Raises :class:`NotSGLang` at once for an address that answers as something else, and
        ConnectionError after ``start_timeout`` seconds without an answer.
        """
        assert self.client is not None
        t0 = time.monotonic()
        said = -WAITING_EVERY_S
        while True:
            try:
                return await self._server_info(starting=True)
            except NotSGLang:
                await self.client.aclose()
                raise
            except (httpx.TransportError, httpx.HTTPStatusError) as e:
                waited = time.monotonic() - t0
                if waited > self.start_timeout:
                    await self.client.aclose()
                    raise ConnectionError(
                        f"SGLang at {self.url} did not answer within {self.start_timeout:.0f} s: "
                        f"{_why(e)}"
                    ) from e
                if waited - said >= WAITING_EVERY_S:
                    said = waited
                    if self.events is not None:
                        self.events.producer_state(
                            "waiting", f"waiting for SGLang at {self.url} ({waited:.0f} s)"
                        )
                await asyncio.sleep(1.0)

    async def stop(self) -> None:
        for t in list(self.tasks.values()):
            t.cancel()
        if self._poller is not None:
            self._poller.cancel()
        await asyncio.gather(
            *self.tasks.values(), *([self._poller] if self._poller else []), return_exceptions=True
        )
        self.tasks.clear()
        if self.client is not None:
            await self.client.aclose()

    # -- requests --------------------------------------------------------------------------------

    def window(self) -> int:
        return self.concurrency

    def submit(self, request: Request) -> None:
        self.tasks[request.rid] = asyncio.create_task(self._run(request))

    def cancel(self, rid: str) -> None:
        self._grace.forget(rid)
        t = self.tasks.pop(rid, None)
        if t is not None:
            t.cancel()

    def is_stuck(self, now: float) -> bool:
        # Down is not stuck: the server is being waited for, visibly (producer_state).
        return bool(self.tasks) and self.up and now - self._last_progress > self.request_timeout

    async def _run(self, req: Request) -> None:
        try:
            async with self.sem:
                await self._send(req)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not strand the sample
            log.exception("sglang producer: request %s", req.rid)
            self._failed(req.rid, type(e).__name__, str(e), True)
        finally:
            self.tasks.pop(req.rid, None)

    async def _send(self, req: Request) -> None:
        assert self.client is not None
        send = 0
        delay = self.backoff[0]
        while True:
            send += 1
            body = {
                "input_ids": req.input_ids,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "rid": sglang_rid(req.rid, req.input_ids, send),
                # a key of its own: even with the radix cache on, no prefix can be shared
                "extra_key": f"eagle3d-{req.rid}-{send}",
            }
            t0 = time.monotonic()
            try:
                r = await self.client.post("/generate", json=body)
            except (httpx.ReadTimeout, httpx.WriteTimeout) as e:
                self._failed(
                    req.rid,
                    "Timeout",
                    f"/generate gave no answer within {self.request_timeout:.0f} s ({type(e).__name__})",
                    True,
                )
                return
            except httpx.TransportError as e:
                self._set_up(False, f"{self.url} unreachable: {type(e).__name__}: {e}")
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, self.backoff[1])
                continue
            if r.status_code in SERVER_DOWN:
                self._set_up(False, f"{self.url} answers HTTP {r.status_code}")
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, self.backoff[1])
                continue
            self._set_up(True, f"{self.url} answers again")
            self.latency_s = (
                0.8 * self.latency_s + 0.2 * (time.monotonic() - t0)
                if self.latency_s
                else time.monotonic() - t0
            )
            self._last_progress = time.monotonic()
            self._judge(req, r)
            return

    def _judge(self, req: Request, r: httpx.Response) -> None:
        if r.status_code in BAD_SAMPLE:
            self._failed(req.rid, f"HTTP{r.status_code}", _error_text(r), False)
            return
        if r.status_code != 200:
            self._failed(req.rid, f"HTTP{r.status_code}", _error_text(r), True)
            return
        try:
            out = r.json()
            meta = (out[0] if isinstance(out, list) else out).get("meta_info", {})
        except (ValueError, AttributeError, IndexError):
            self._failed(req.rid, "BadResponse", r.text[:200], True)
            return
        finish = meta.get("finish_reason") or {}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            self._failed(
                req.rid, "Aborted", str(finish.get("message", "aborted by the server")), True
            )
        elif int(meta.get("cached_tokens") or 0) > 0:
            self._failed(
                req.rid,
                "PrefixCacheHit",
                f"{meta['cached_tokens']} tokens came from the prefix cache; start SGLang with --disable-radix-cache",
                True,
            )
        elif meta.get("prompt_tokens") is not None and int(meta["prompt_tokens"]) != len(
            req.input_ids
        ):
            self._failed(
                req.rid,
                "LengthMismatch",
                f"server ran {meta['prompt_tokens']} tokens, sent {len(req.input_ids)}",
                False,
            )
        else:
            # Success: the hook's writer thread has the dump, or will have it shortly. A
            # write that fails there loses that dump without failing the request, and so
            # does a cleanup of the dump area: the grace retries those.
            self._grace.written(req.rid, time.monotonic())

    def dump_arrived(self, rid: str) -> None:
        self._grace.arrived(rid, time.monotonic())

    def missing_dumps(self, now: float) -> None:
        """Answered requests whose dump is not coming: the hook's failure marker says why at
        once; without one, failed (retryable) as ``DumpMissing`` after the grace."""
        awaiting = self._grace.awaiting
        if awaiting:
            for rid, reason in self._markers(set(awaiting)).items():
                self._grace.forget(rid)
                self._failed(rid, "DumpWriteError", self._marker_message(reason), True)
        for rid in self._grace.late(now):
            why = f"/generate answered {self._grace.grace:.0f} s ago and no dump arrived"
            self._failed(rid, "DumpMissing", f"{why}; {self._dump_area()}", True)

    def _markers(self, rids: set[str]) -> dict[str, str]:
        """Failure markers the hook left for these requests (each removed once read)."""
        try:
            names = os.listdir(self.dump_dir)
        except OSError:
            return {}
        found: dict[str, str] = {}
        for name in names:
            parsed = parse_failure_marker(name)
            if parsed is None:
                continue
            path = os.path.join(self.dump_dir, name)
            if parsed[0] in rids:
                found[parsed[0]] = parsed[1]
            else:
                try:  # another shard's (read within seconds by its client), or stale
                    if time.time() - os.stat(path).st_mtime < STALE_MARKER_S:
                        continue
                except OSError:
                    continue
            with contextlib.suppress(OSError):
                os.unlink(path)
        return found

    def _marker_message(self, reason: str) -> str:
        if reason == "LOST":
            return "the server's hook lost the request's earlier chunks (see the server log)"
        text = os.strerror(getattr(errno, reason)) if hasattr(errno, reason) else "failed"
        where = self._dump_area()
        return f"the server's hook could not write the dump: {reason}: {text}; {where}"

    def _dump_area(self) -> str:
        try:
            st = os.statvfs(self.dump_dir)
        except OSError as e:
            return f"dump area {self.dump_dir}: {e.strerror}"
        return f"dump area {self.dump_dir} has {st.f_bavail * st.f_frsize} bytes free"

    def _failed(self, rid: str, error: str, message: str, retryable: bool) -> None:
        self._grace.forget(rid)
        if self.events is not None:
            self.events.request_failed(rid, error, message, retryable)

    def _set_up(self, up: bool, message: str) -> None:
        if up == self.up:
            return
        if up and self._went_down:
            self.restarts += 1  # came back after being down
        self._went_down = self._went_down or not up
        self.up = up
        if self.events is not None:
            self.events.producer_state("up" if up else "down", message)

    # -- health ----------------------------------------------------------------------------------

    def health(self) -> ProducerHealth:
        return ProducerHealth(
            name=self.name,
            up=self.up,
            latency_s=self.latency_s,
            restarts=self.restarts,
            detail=dict(self.detail),
        )

    async def _server_info(self, starting: bool = False) -> dict[str, Any]:
        """``GET /server_info`` (``/get_server_info`` on older servers) as a dict.

        ``starting``: an answer that no SGLang gives (a 404 on both paths, another 4xx, a body
        that is not a JSON object with SGLang's keys) raises :class:`NotSGLang`, naming what
        was answered; 502/503/504 and transport errors raise as usual (not up yet).
        """
        assert self.client is not None
        r = await self.client.get(self._info_path, timeout=10.0)
        if r.status_code == 404 and self._info_path == "/server_info":
            first = r
            r = await self.client.get("/get_server_info", timeout=10.0)
            if r.status_code != 404:
                self._info_path = "/get_server_info"  # older servers
            elif starting:
                raise NotSGLang(
                    f"{self.url} is not an SGLang server: GET /server_info answered HTTP 404 "
                    f"({_excerpt(first)!r}) and GET /get_server_info HTTP 404 ({_excerpt(r)!r})"
                )
        if starting and r.status_code not in SERVER_DOWN and r.status_code >= 400:
            raise NotSGLang(
                f"{self.url} is not an SGLang server: GET {r.request.url.path} answered HTTP "
                f"{r.status_code} ({_excerpt(r)!r})"
            )
        r.raise_for_status()
        try:
            info = r.json()
        except ValueError:
            info = None
        if not isinstance(info, dict) or not ({"version", "model_path"} & info.keys()):
            if starting:
                raise NotSGLang(
                    f"{self.url} is not an SGLang server: GET {r.request.url.path} answered HTTP "
                    f"{r.status_code} with {_excerpt(r)!r}, not SGLang's server info"
                )
            raise httpx.HTTPStatusError(
                "server_info is not an object", request=r.request, response=r
            )
        return info

    async def refresh(self) -> None:
        # The poller reads every poll_interval; a short last lifetime of a restarted server
        # (or a short job) could otherwise end with numbers a whole interval old.
        with contextlib.suppress(httpx.HTTPError, ValueError, asyncio.TimeoutError):
            await asyncio.wait_for(self.poll_once(time.monotonic()), 3.0)

    async def _poll(self) -> None:
        assert self.client is not None
        while True:
            await asyncio.sleep(self.poll_interval)
            self.missing_dumps(time.monotonic())
            try:
                await self.poll_once(time.monotonic())
            except (httpx.HTTPError, ValueError):
                pass  # down is reported by poll_once; the next round tries again
            except Exception:  # never let the poller die: the monitor would show stale numbers
                log.exception("sglang producer: reading /server_info or /metrics failed")

    async def poll_once(self, now: float) -> None:
        """One read of /server_info and /metrics into ``detail`` (``now``: monotonic seconds)."""
        assert self.client is not None
        try:
            info = await self._server_info()
        except httpx.TransportError as e:
            self._set_up(False, f"{self.url} unreachable: {type(e).__name__}")
            raise
        self._set_up(True, f"{self.url} answers again")
        self.detail["server_version"] = str(info.get("version", "?"))
        self.detail["server_at"] = time.time()
        r = await self.client.get("/metrics", timeout=10.0)
        if r.status_code != 200:
            self.detail["metrics"] = f"HTTP {r.status_code} (start SGLang with --enable-metrics)"
            return
        values = parse_metrics(r.text)
        self.detail.update(values)
        self.detail["metrics_at"] = time.time()
        total = values.get("prompt_tokens_total")
        if total is not None:
            per_s = rate(self._prompt_prev, total, now)
            if per_s is not None:
                self.detail["prompt_tokens_s"] = round(per_s, 1)
            self._prompt_prev = (now, total)


def _error_text(r: httpx.Response) -> str:
    try:
        body = r.json()
        err = body.get("error", body) if isinstance(body, dict) else body
        msg = err.get("message", err) if isinstance(err, dict) else err
        return str(msg)[:300]
    except ValueError:
        return r.text[:300]


def _why(e: Exception) -> str:
    if isinstance(e, httpx.HTTPStatusError):
        return f"HTTP {e.response.status_code}"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
