"""``eagle3d serve-sglang`` and ``eagle3d sglang-args``: a stock SGLang server set up for extraction.

The extra arguments (checked against SGLang 0.5.21's ``ServerArgs`` by the conformance test):

* ``--forward-hooks '[{...eagle3d.remote.sglang_hook:make_hook...}]'`` loads the capture hook;
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
import json
import logging
import os
import shlex
import sys
from typing import Any

from eagle3d.remote import storedtype
from eagle3d.remote.dumpfile import default_aux_layers
from eagle3d.tools.sglang_supervise import supervise

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
    from eagle3d.remote.sglang_hook import hook_spec

    spec = hook_spec(os.path.abspath(dump_dir), aux_layers, max_pending, store_dtype)
    return ["--forward-hooks", json.dumps([spec], separators=(",", ":")), *FIXED_ARGS]


def default_layers(model_path: str | None) -> list[int] | None:
    """EAGLE-3's default layers (``[2, L//2, L-3]``, distinct: :mod:`eagle3d.remote.recipes`)
    from a local model directory's config.json, else None.

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
    try:
        return default_aux_layers(n)
    except ValueError:
        return None


def model_path_of(user_args: list[str]) -> str | None:
    ns = argparse.ArgumentParser(add_help=False)
    ns.add_argument("--model-path", "--model")
    known, _ = ns.parse_known_args(user_args)
    path: str | None = known.model_path
    return path


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


def _layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--aux-layers: want comma-separated ints, got {text!r}"
        ) from None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--layers",
        "--aux-layers",
        dest="aux_layers",
        type=_layers,
        default=None,
        help="layer ids L1,L2,... the job captures, any number (eagle3d run's --layers; default:"
        " the model's EAGLE-3 default [2, L//2, L-3])",
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
        help="put the states in the job's storage dtype on the GPU before they are copied"
        " out: cast, or quantized with their scales for fp8 (default: as the server computes"
        " them; the daemon's commit casts or quantizes them then)",
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
