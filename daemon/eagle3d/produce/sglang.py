"""The SGLang producer: an HTTP client of a stock SGLang server running the eagle3d capture hook.

Each request is ``POST /generate`` with the token ids, one greedy output token, and the SGLang
rid ``e3d.<send>.<T>.<digest>.<rid>`` (:func:`eagle3d.remote.sglang_rid.sglang_rid`); the hook in the
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
  left in its failure marker (``ENOSPC: ...``, see :mod:`eagle3d.remote.sglang_writer`) as soon as the
  marker is seen, else ``DumpMissing`` after the grace, naming the dump area's free space.

A poller reads ``/server_info`` (``/get_server_info`` on servers without it) and ``/metrics``
into :meth:`health` ``detail``: prompt tokens total and rate, running and queued requests.
``transport`` is the test seam (``httpx.MockTransport``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import Any

import httpx
from eagle3proto.events import ProducerHealth

from eagle3d.core.sample import Request
from eagle3d.produce.base import DumpGrace, Producer, ProducerEvents
from eagle3d.produce.sglang_info import (
    BAD_SAMPLE,
    SERVER_DOWN,
    NotSGLang,
    ServerUnfit,
    check_server_info,
    error_text,
    parse_metrics,
    rate,
    server_info,
    why,
)
from eagle3d.produce.sglang_markers import dump_area_words, marker_message, take_markers
from eagle3d.remote.sglang_rid import sglang_rid

log = logging.getLogger("eagle3d.produce.sglang")
# httpx logs every request at INFO: thousands of lines a minute in the daemon's log, and the
# CPU to format them taken from the server beside it.
logging.getLogger("httpx").setLevel(logging.WARNING)

WAITING_EVERY_S = 10.0  # how often "waiting for SGLang at URL (N s)" is said while it is not up


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
                        f"{why(e)}"
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
            self._failed(req.rid, f"HTTP{r.status_code}", error_text(r), False)
            return
        if r.status_code != 200:
            self._failed(req.rid, f"HTTP{r.status_code}", error_text(r), True)
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
            for rid, reason in take_markers(self.dump_dir, set(awaiting)).items():
                self._grace.forget(rid)
                self._failed(rid, "DumpWriteError", marker_message(self.dump_dir, reason), True)
        for rid in self._grace.late(now):
            why = f"/generate answered {self._grace.grace:.0f} s ago and no dump arrived"
            self._failed(rid, "DumpMissing", f"{why}; {dump_area_words(self.dump_dir)}", True)

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
        """``GET /server_info`` (:func:`eagle3d.produce.sglang_info.server_info`)."""
        assert self.client is not None
        info, self._info_path = await server_info(self.client, self.url, self._info_path, starting)
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
