"""SGLangProducer against an httpx.MockTransport double of SGLang's HTTP API.

The real HTTP path (a server process, restarts, the full daemon) is tests/test_sglang_integration.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from eagle3d.core.sample import Request
from eagle3d.produce.base import DUMP_GRACE_S
from eagle3d.produce.sglang import SGLangProducer
from eagle3d.produce.sglang_info import (
    NotSGLang,
    ServerUnfit,
    parse_metrics,
    rate,
    server_url_problem,
)
from eagle3d.remote.sglang_hook import hook_spec
from eagle3d.remote.sglang_rid import (
    FACTORIES,
    FACTORY,
    LEGACY_FACTORY,
    failure_marker_name,
    parse_sglang_rid,
)


class Events:
    def __init__(self) -> None:
        self.failed: list[tuple[str, str, bool]] = []
        self.messages: list[str] = []
        self.states: list[str] = []
        self.said: list[str] = []

    def request_failed(self, rid: str, error: str, message: str, retryable: bool) -> None:
        self.failed.append((rid, error, retryable))
        self.messages.append(message)

    def producer_state(self, state: str, message: str = "") -> None:
        self.states.append(state)
        self.said.append(message)


def info(dump_dir: str, aux: list[int] | None = None, **kw: Any) -> dict[str, Any]:
    return {
        "version": "0.5.21",
        "forward_hooks": [hook_spec(dump_dir, aux)],
        "disable_radix_cache": True,
        **kw,
    }


def ok(req: httpx.Request, cached: int = 0) -> httpx.Response:
    body = json.loads(req.content)
    meta = {
        "id": body["rid"],
        "prompt_tokens": len(body["input_ids"]),
        "cached_tokens": cached,
        "finish_reason": {"type": "length", "length": 1},
    }
    return httpx.Response(200, json={"text": "x", "meta_info": meta})


class Server:
    """A scripted SGLang: ``generate`` decides each /generate answer."""

    def __init__(
        self,
        dump_dir: str,
        generate: Any = ok,
        server_info: dict[str, Any] | None = None,
        metrics: str = "",
    ) -> None:
        self.info = server_info if server_info is not None else info(dump_dir)
        self.generate = generate
        self.metrics = metrics
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []

    async def __call__(self, req: httpx.Request) -> httpx.Response:
        self.paths.append(req.url.path)
        if req.url.path == "/server_info":
            return httpx.Response(200, json=self.info)
        if req.url.path == "/metrics":
            return httpx.Response(200, text=self.metrics)
        if req.url.path == "/generate":
            self.bodies.append(json.loads(req.content))
            r = self.generate(req)
            return await r if asyncio.iscoroutine(r) else r
        return httpx.Response(404)


async def started(server: Server, dump_dir: str, **kw: Any) -> tuple[SGLangProducer, Events]:
    p = SGLangProducer(
        "http://sglang.test",
        dump_dir=dump_dir,
        aux_layers=kw.pop("aux_layers", None),
        transport=httpx.MockTransport(server),
        backoff=(0.01, 0.05),
        **kw,
    )
    ev = Events()
    await p.start(ev)
    return p, ev


async def settle(p: SGLangProducer) -> None:
    while p.tasks:
        await asyncio.sleep(0.01)


def req(rid: str = "s1-a1", ids: list[int] | None = None) -> Request:
    return Request(rid=rid, idx=1, input_ids=ids or [5, 6, 7])


async def test_generate_body_carries_ids_one_token_and_the_tied_rid(tmp_path: Path) -> None:
    srv = Server(str(tmp_path))
    p, ev = await started(srv, str(tmp_path))
    assert ev.states == ["up"] and p.window() == 32
    p.submit(req("s9-a2", [1, 2, 3, 4]))
    await settle(p)
    (body,) = srv.bodies
    assert body["input_ids"] == [1, 2, 3, 4]
    assert body["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.0}
    tag = parse_sglang_rid(body["rid"])
    assert tag is not None and tag.rid == "s9-a2" and tag.length == 4 and tag.send == 1
    assert body["extra_key"] and ev.failed == []
    await p.stop()


@pytest.mark.parametrize(
    "status, error, retryable",
    [
        (400, "HTTP400", False),
        (422, "HTTP422", False),
        (500, "HTTP500", True),
        (429, "HTTP429", True),
    ],
)
async def test_http_errors_tell_bad_samples_from_retryable_ones(
    tmp_path: Path, status: int, error: str, retryable: bool
) -> None:
    srv = Server(
        str(tmp_path), generate=lambda r: httpx.Response(status, json={"error": {"message": "no"}})
    )
    p, ev = await started(srv, str(tmp_path))
    p.submit(req())
    await settle(p)
    assert ev.failed == [("s1-a1", error, retryable)] and ev.states == ["up"]
    await p.stop()


async def test_prefix_cache_hit_and_abort_are_retryable_failures(tmp_path: Path) -> None:
    def gen(r: httpx.Request) -> httpx.Response:
        if json.loads(r.content)["input_ids"][0] == 1:
            return ok(r, cached=2)
        return httpx.Response(
            200, json={"meta_info": {"finish_reason": {"type": "abort", "message": "x"}}}
        )

    p, ev = await started(Server(str(tmp_path), generate=gen), str(tmp_path))
    p.submit(req("a", [1, 2, 3]))
    p.submit(req("b", [2, 3]))
    await settle(p)
    assert sorted(ev.failed) == [("a", "PrefixCacheHit", True), ("b", "Aborted", True)]
    await p.stop()


async def test_dead_server_is_down_and_retried_without_failing_the_sample(tmp_path: Path) -> None:
    answers = iter(["refuse", "refuse", 503, "ok"])

    def gen(r: httpx.Request) -> httpx.Response:
        a = next(answers)
        if a == "refuse":
            raise httpx.ConnectError("connection refused", request=r)
        return httpx.Response(a) if isinstance(a, int) else ok(r)

    srv = Server(str(tmp_path), generate=gen)
    p, ev = await started(srv, str(tmp_path))
    p.submit(req())
    await settle(p)
    assert ev.failed == [] and ev.states == ["up", "down", "up"]
    assert [parse_sglang_rid(b["rid"]).send for b in srv.bodies] == [1, 2, 3, 4]  # type: ignore[union-attr]
    assert p.health().restarts == 1 and p.health().up
    await p.stop()


async def test_read_timeout_is_a_retryable_failure(tmp_path: Path) -> None:
    def gen(r: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=r)

    p, ev = await started(Server(str(tmp_path), generate=gen), str(tmp_path))
    p.submit(req())
    await settle(p)
    assert ev.failed == [("s1-a1", "Timeout", True)] and ev.states == ["up"]
    await p.stop()


async def test_an_answered_request_whose_dump_never_arrives_is_retried_after_the_grace(
    tmp_path: Path,
) -> None:
    """The hook writes dumps on a background thread: a write that fails there, or a cleanup
    of the dump area, loses the dump while /generate answers 200. Without the grace the
    sample waited for the request timeout (600 s by default)."""
    p, ev = await started(Server(str(tmp_path)), str(tmp_path))
    for rid in ("lost", "seen-before", "seen-after"):
        p.submit(req(rid))
    p.dump_arrived("seen-before")  # the writer thread can beat the HTTP answer
    await settle(p)
    p.dump_arrived("seen-after")
    now = time.monotonic()
    p.missing_dumps(now + DUMP_GRACE_S / 2)
    assert ev.failed == []
    p.missing_dumps(now + DUMP_GRACE_S + 1)
    assert ev.failed == [("lost", "DumpMissing", True)]
    assert f"dump area {tmp_path} has " in ev.messages[0] and "bytes free" in ev.messages[0]
    p.missing_dumps(now + 3 * DUMP_GRACE_S)
    assert len(ev.failed) == 1
    await p.stop()


async def test_a_failed_or_cancelled_request_owes_no_dump(tmp_path: Path) -> None:
    def gen(r: httpx.Request) -> httpx.Response:
        if json.loads(r.content)["rid"].endswith(".bad"):
            return httpx.Response(500, json={"error": {"message": "boom"}})
        return ok(r)

    p, ev = await started(Server(str(tmp_path), generate=gen), str(tmp_path))
    p.submit(req("bad"))
    p.submit(req("cancelled"))
    await settle(p)
    p.cancel("cancelled")  # the daemon's own timeout, after the answer
    p.missing_dumps(time.monotonic() + 2 * DUMP_GRACE_S)
    assert ev.failed == [("bad", "HTTP500", True)]
    await p.stop()


async def test_window_bounds_requests_in_flight_and_cancel_stops_one(tmp_path: Path) -> None:
    release = asyncio.Event()
    inside = 0
    peak = 0

    async def gen(r: httpx.Request) -> httpx.Response:
        nonlocal inside, peak
        inside += 1
        peak = max(peak, inside)
        await release.wait()
        inside -= 1
        return ok(r)

    srv = Server(str(tmp_path), generate=gen)
    p, ev = await started(srv, str(tmp_path), concurrency=3)
    for k in range(10):
        p.submit(req(f"r{k}"))
    await asyncio.sleep(0.1)
    assert peak == 3 and p.window() == 3
    p.cancel("r9")
    release.set()
    await settle(p)
    assert peak == 3 and len(srv.bodies) == 9 and ev.failed == []
    await p.stop()


async def test_start_refuses_a_server_without_the_hook_or_with_another_dump_dir(
    tmp_path: Path,
) -> None:
    with pytest.raises(ServerUnfit, match="without the eagle3d capture hook"):
        await started(
            Server(str(tmp_path), server_info={"version": "0.5.21", "forward_hooks": None}),
            str(tmp_path),
        )
    with pytest.raises(ServerUnfit, match="--dump-dir /elsewhere"):
        await started(Server(str(tmp_path), server_info=info("/elsewhere")), str(tmp_path))
    with pytest.raises(ServerUnfit, match=r"aux layers \[1, 2\]"):
        await started(
            Server(str(tmp_path), server_info=info(str(tmp_path), [1, 2])),
            str(tmp_path),
            aux_layers=[2, 3],
        )


async def test_start_falls_back_to_get_server_info_and_waits_for_the_server(tmp_path: Path) -> None:
    calls = 0

    def handler(r: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise httpx.ConnectError("not yet", request=r)
        if r.url.path == "/get_server_info":
            return httpx.Response(200, json=info(str(tmp_path)))
        return httpx.Response(404)

    p = SGLangProducer(
        "http://x", dump_dir=str(tmp_path), aux_layers=None, transport=httpx.MockTransport(handler)
    )
    ev = Events()
    await p.start(ev)
    assert ev.states == ["waiting", "up"] and p._info_path == "/get_server_info"
    assert ev.said[0] == "waiting for SGLang at http://x (0 s)"
    await p.stop()
    with pytest.raises(ConnectionError, match="did not answer within 0 s: ConnectError: no"):
        q = SGLangProducer(
            "http://x",
            dump_dir=str(tmp_path),
            aux_layers=None,
            start_timeout=0.0,
            transport=httpx.MockTransport(
                lambda r: (_ for _ in ()).throw(httpx.ConnectError("no", request=r))
            ),
        )
        await q.start(Events())


async def test_the_hooks_failure_marker_names_why_a_dump_is_missing(tmp_path: Path) -> None:
    """The hook could not write a dump (a full dump area): the client reports the errno at
    once, as the HF producer does, instead of DumpMissing after the grace."""
    p, ev = await started(Server(str(tmp_path)), str(tmp_path))
    for rid in ("full", "lostchunk", "fine"):
        p.submit(req(rid))
    await settle(p)
    for rid, reason in (("full", "ENOSPC"), ("lostchunk", "LOST"), ("someone-else", "ENOSPC")):
        (tmp_path / failure_marker_name(rid, reason)).touch()
    p.missing_dumps(time.monotonic())
    assert sorted(ev.failed) == [
        ("full", "DumpWriteError", True),
        ("lostchunk", "DumpWriteError", True),
    ]
    full = ev.messages[[f[0] for f in ev.failed].index("full")]
    assert full.startswith("the server's hook could not write the dump: ENOSPC: No space left")
    assert "bytes free" in full
    # read markers are removed; another client's recent one is left for it
    assert os.listdir(tmp_path) == [failure_marker_name("someone-else", "ENOSPC")]
    p.missing_dumps(time.monotonic() + 2 * DUMP_GRACE_S)  # no marker, no dump: the grace
    assert len(ev.failed) == 3 and ev.failed[-1] == ("fine", "DumpMissing", True)
    await p.stop()


@pytest.mark.parametrize(
    "answer, said",
    [
        (httpx.Response(404, text="<html>Not Found</html>"), "HTTP 404 ('<html>Not Found</html>')"),
        (
            httpx.Response(401, text="login first"),
            "GET /server_info answered HTTP 401 ('login first')",
        ),
        (
            httpx.Response(200, text="<!doctype html><p>hello"),
            "HTTP 200 with '<!doctype html><p>hello'",
        ),
        (httpx.Response(200, json={"status": "ok"}), "not SGLang's server info"),
    ],
)
async def test_an_address_that_answers_but_is_not_sglang_is_refused_at_once(
    tmp_path: Path, answer: httpx.Response, said: str
) -> None:
    p = SGLangProducer(
        "http://web.test",
        dump_dir=str(tmp_path),
        aux_layers=None,
        transport=httpx.MockTransport(lambda r: answer),
    )
    t0 = time.monotonic()
    with pytest.raises(NotSGLang, match=r"http://web\.test is not an SGLang server") as e:
        await p.start(Events())
    assert said in str(e.value) and time.monotonic() - t0 < 5


@pytest.mark.parametrize(
    "url, ok_",
    [
        ("http://127.0.0.1:30000", True),
        ("https://node7", True),
        ("http://[::1]:8000/", True),
        ("htp:/bogus", False),
        ("127.0.0.1:30000", False),
        ("http://", False),
        ("http://host:port", False),
        ("http://host:30000/generate", False),
    ],
)
def test_server_urls(url: str, ok_: bool) -> None:
    assert (server_url_problem(url) is None) == ok_, server_url_problem(url)


METRICS_TEXT = """# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="m",tp_rank="0"} %s
sglang:prompt_tokens_total{model_name="m",tp_rank="1"} 0.0
sglang:prompt_tokens_created{model_name="m"} 1.7e9
sglang:num_running_reqs{model_name="m"} 7.0
sglang:num_queue_reqs{model_name="m"} 2.0
sglang:gen_throughput{model_name="m"} 0.5
"""


async def test_poll_reads_server_info_and_metrics_into_health(tmp_path: Path) -> None:
    srv = Server(str(tmp_path), metrics=METRICS_TEXT % "1000.0")
    p, _ = await started(srv, str(tmp_path))
    await p.poll_once(now=100.0)
    srv.metrics = METRICS_TEXT % "5000.0"
    await p.poll_once(now=102.0)
    d = p.health().detail
    assert d["prompt_tokens_total"] == 5000.0 and d["prompt_tokens_s"] == 2000.0
    assert (
        d["num_running_reqs"] == 7.0
        and d["num_queue_reqs"] == 2.0
        and d["server_version"] == "0.5.21"
    )
    assert "/generate" not in srv.paths  # health reads never create requests
    await p.stop()


async def test_refresh_reads_now_and_never_raises(tmp_path: Path) -> None:
    srv = Server(str(tmp_path), metrics=METRICS_TEXT % "42.0")
    down = False

    async def handler(req: httpx.Request) -> httpx.Response:
        if down:
            raise httpx.ConnectError("refused", request=req)
        return await srv(req)

    p = SGLangProducer(
        "http://x",
        dump_dir=str(tmp_path),
        aux_layers=None,
        poll_interval=3600.0,
        transport=httpx.MockTransport(handler),
    )
    ev = Events()
    await p.start(ev)
    assert "prompt_tokens_total" not in p.health().detail  # the poller has not run yet
    await p.refresh()
    assert p.health().detail["prompt_tokens_total"] == 42.0
    down = True
    await p.refresh()  # the run's end must not fail on a last reading
    assert ev.states[-1] == "down" and not p.health().up
    await p.stop()


def test_parse_metrics_and_rate() -> None:
    m = parse_metrics(METRICS_TEXT % "12.5")
    assert m == {"prompt_tokens_total": 12.5, "num_running_reqs": 7.0, "num_queue_reqs": 2.0}
    assert rate(None, 5, 1.0) is None
    assert rate((1.0, 10.0), 30.0, 3.0) == 10.0
    assert rate((1.0, 10.0), 3.0, 3.0) is None  # counter reset: a restarted server
    assert FACTORY == "eagle3d.remote.sglang_hook:make_hook"
    # Launch lines written before the hook moved still name the old place, which still works.
    assert LEGACY_FACTORY == "eagle3d.sglang_hook:make_hook" and LEGACY_FACTORY in FACTORIES
    import importlib

    from eagle3d.remote.sglang_hook import make_hook

    assert importlib.import_module(LEGACY_FACTORY.split(":")[0]).make_hook is make_hook


def test_run_refuses_a_server_url_that_does_not_parse_before_starting(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle3d",
            "run",
            "--backend",
            "sglang",
            "--server",
            "htp:/bogus",
            "--model",
            str(tmp_path),
            "--dataset",
            str(tmp_path / "d.jsonl"),
            "--output",
            str(out),
            "--dump-dir",
            str(tmp_path / "dumps"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert "server: 'htp:/bogus': want an http:// or https:// URL" in r.stderr
    assert not out.exists()  # nothing started
