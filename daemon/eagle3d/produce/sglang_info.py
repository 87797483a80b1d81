"""What the SGLang client reads and checks: a server URL, ``/server_info`` (the hook is there,
writing where the daemon looks), and ``/metrics``. Pure functions of what was answered."""

from __future__ import annotations

import logging
import os
import re
import urllib.parse
from typing import Any

import httpx

from eagle3d.remote.sglang_rid import FACTORIES, FACTORY

log = logging.getLogger("eagle3d.produce.sglang")

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


def excerpt(r: httpx.Response, n: int = 120) -> str:
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
    ours = [h for h in hooks if isinstance(h, dict) and h.get("hook_factory") in FACTORIES]
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


def error_text(r: httpx.Response) -> str:
    """The error message of a failed answer, short."""
    try:
        body = r.json()
        err = body.get("error", body) if isinstance(body, dict) else body
        msg = err.get("message", err) if isinstance(err, dict) else err
        return str(msg)[:300]
    except ValueError:
        return r.text[:300]


def why(e: Exception) -> str:
    """An exception from the HTTP client, in a few words."""
    if isinstance(e, httpx.HTTPStatusError):
        return f"HTTP {e.response.status_code}"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def server_info(
    client: httpx.AsyncClient, url: str, path: str, starting: bool = False
) -> tuple[dict[str, Any], str]:
    """``GET path`` (``/server_info``; ``/get_server_info`` on older servers) as a dict, and the
    path that answered (ask that one next time).

    ``starting``: an answer that no SGLang gives (a 404 on both paths, another 4xx, a body
    that is not a JSON object with SGLang's keys) raises :class:`NotSGLang`, naming what
    was answered; 502/503/504 and transport errors raise as usual (not up yet).
    """
    r = await client.get(path, timeout=10.0)
    if r.status_code == 404 and path == "/server_info":
        first = r
        r = await client.get("/get_server_info", timeout=10.0)
        if r.status_code != 404:
            path = "/get_server_info"  # older servers
        elif starting:
            raise NotSGLang(
                f"{url} is not an SGLang server: GET /server_info answered HTTP 404 "
                f"({excerpt(first)!r}) and GET /get_server_info HTTP 404 ({excerpt(r)!r})"
            )
    if starting and r.status_code not in SERVER_DOWN and r.status_code >= 400:
        raise NotSGLang(
            f"{url} is not an SGLang server: GET {r.request.url.path} answered HTTP "
            f"{r.status_code} ({excerpt(r)!r})"
        )
    r.raise_for_status()
    try:
        info = r.json()
    except ValueError:
        info = None
    if not isinstance(info, dict) or not ({"version", "model_path"} & info.keys()):
        if starting:
            raise NotSGLang(
                f"{url} is not an SGLang server: GET {r.request.url.path} answered HTTP "
                f"{r.status_code} with {excerpt(r)!r}, not SGLang's server info"
            )
        raise httpx.HTTPStatusError("server_info is not an object", request=r.request, response=r)
    return info, path
