"""A local stand-in SGLang server: SGLang's HTTP API over the tiny model, dumps via the real hook.

    python tests/sglang_fake_server.py --model-path DIR --port P --forward-hooks JSON
        [--disable-radix-cache] [--chunked-prefill-size N] [--enable-metrics] [--exit-after N]

It accepts the arguments ``eagle3d serve-sglang`` adds (others of SGLang's are ignored), listens
on 127.0.0.1 only, and serves

* ``POST /generate`` (``input_ids``, ``rid``, ``sampling_params``; one greedy token): requests
  arriving together are packed into one extend forward of the stand-in model
  (``tests/sglang_standin.py``), whose forward hooks come from ``--forward-hooks`` exactly as
  SGLang loads them, so the dumps are written by ``eagle3d.sglang_hook`` itself;
* ``GET /server_info`` and ``/get_server_info`` (server args, version), ``GET /metrics``
  (Prometheus text, only with ``--enable-metrics``), ``GET /health`` (runs a generation unless
  ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false``, as SGLang 0.5.21 does).

``--exit-after N`` makes the process die abruptly (``os._exit``) when the engine picks up its
next batch after N answered generations: the requests then waiting or in that batch get their
connections reset; dumps of requests already answered are on disk (the writer is drained
first, so the test does not wait on the daemon's request timeout for a dump lost in between).
It is also importable as ``sglang.launch_server`` through a shim (see the integration test), so
``eagle3d serve-sglang`` can supervise it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VERSION = "0.5.21-eagle3d-fake"
MAX_CONTEXT = 4096


class Engine:
    """The model thread: takes whatever requests are waiting, runs them as one packed batch."""

    def __init__(self, args: argparse.Namespace) -> None:
        import sglang_standin as st
        import torch

        torch.set_num_threads(1)
        self.model, _ = st.load_standin(args.model_path)
        specs = json.loads(args.forward_hooks) if args.forward_hooks else []
        st.register_forward_hooks(self.model, specs)  # SGLang's algorithm; our factory
        self.scheduler = st.Scheduler(
            self.model,
            chunk=args.chunked_prefill_size if (args.chunked_prefill_size or 0) > 0 else None,
        )
        self.inbox: queue.Queue[tuple[str, list[int], dict[str, Any]]] = queue.Queue()
        self.lock = threading.Lock()
        self.running = 0
        self.prompt_tokens = 0
        self.generations = 0
        self.health_generations = 0
        self.answered = 0
        self.exit_after = args.exit_after
        threading.Thread(target=self._loop, daemon=True, name="engine").start()

    def generate(self, rid: str, ids: list[int]) -> int:
        slot: dict[str, Any] = {"done": threading.Event()}
        self.inbox.put((rid, ids, slot))
        slot["done"].wait()
        if "error" in slot:
            raise RuntimeError(slot["error"])
        return int(slot["token"])

    def queued(self) -> int:
        return self.inbox.qsize()

    def _loop(self) -> None:
        while True:
            batch = [self.inbox.get()]
            if self.exit_after and self.answered >= self.exit_after:
                for m in self.model.modules():  # the hook's writer: answered dumps reach the disk
                    for h in m._forward_hooks.values():
                        getattr(getattr(h, "writer", None), "drain", lambda: None)()
                os._exit(17)  # a crash mid-run: in-flight requests get their connections reset
            time.sleep(0.005)  # let concurrent arrivals join the batch
            while True:
                try:
                    batch.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            with self.lock:
                self.running = len(batch)
            try:
                out = self.scheduler.run([(rid, ids) for rid, ids, _ in batch])
                for rid, _ids, slot in batch:
                    slot["token"] = out[rid]
            except Exception as e:  # keep serving; the client sees a 500
                for _, _, slot in batch:
                    slot["error"] = f"{type(e).__name__}: {e}"
            with self.lock:
                self.running = 0
                self.prompt_tokens += sum(len(ids) for _, ids, _ in batch)
            for _, _, slot in batch:
                slot["done"].set()


def make_handler(
    engine: Engine, args: argparse.Namespace, info: dict[str, Any]
) -> type[BaseHTTPRequestHandler]:
    inflight: set[str] = set()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *a: Any) -> None:
            pass

        def _send(self, status: int, body: Any, ctype: str = "application/json") -> None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            self._send(
                status,
                {"error": {"message": message, "type": "invalid_request_error", "code": status}},
            )

        def do_GET(self) -> None:
            if self.path in ("/server_info", "/get_server_info"):
                self._send(200, {**info, "internal_states": [{"num_running_reqs": engine.running}]})
            elif self.path == "/metrics" and args.enable_metrics:
                labels = '{model_name="tiny"}'
                lines = [
                    "# TYPE sglang:prompt_tokens_total counter",
                    f"sglang:prompt_tokens_total{labels} {float(engine.prompt_tokens)}",
                    f"sglang:cached_tokens_total{labels} 0.0",
                    f"sglang:num_running_reqs{labels} {float(engine.running)}",
                    f"sglang:num_queue_reqs{labels} {float(engine.queued())}",
                    f"eagle3d_fake:health_generations_total {float(engine.health_generations)}",
                ]
                self._send(200, "\n".join(lines) + "\n", "text/plain; version=0.0.4")
            elif self.path in ("/health", "/health_generate"):
                gen = os.environ.get(
                    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true"
                ).lower() not in ("0", "false")
                if self.path == "/health_generate" or gen:
                    engine.health_generations += 1
                    engine.generate(f"HEALTH_CHECK_{uuid.uuid4().hex}", [0])
                self._send(200, "")
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self) -> None:
            if self.path != "/generate":
                self._error(404, f"no route {self.path}")
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                ids = body["input_ids"]
                rid = body.get("rid") or uuid.uuid4().hex
                if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                    raise ValueError("input_ids must be a non-empty list of ints")
            except (ValueError, KeyError, TypeError) as e:
                self._error(400, f"bad request: {e}")
                return
            if len(ids) > MAX_CONTEXT:
                self._error(
                    400,
                    f"The input ({len(ids)} tokens) is longer than the model's context length ({MAX_CONTEXT} tokens).",
                )
                return
            with lock:
                if rid in inflight:
                    self._error(400, f"Duplicate request ID detected: {rid}")
                    return
                inflight.add(rid)
            try:
                token = engine.generate(rid, ids)
            except RuntimeError as e:
                self._error(500, str(e))
                return
            finally:
                with lock:
                    inflight.discard(rid)
            meta = {
                "id": rid,
                "prompt_tokens": len(ids),
                "completion_tokens": 1,
                "cached_tokens": 0,
                "finish_reason": {"type": "length", "length": 1},
            }
            self._send(200, {"text": "", "output_ids": [token], "meta_info": meta})
            with engine.lock:
                engine.answered += 1

    return Handler


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--forward-hooks", default=None)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--disable-prefill-cuda-graph", action="store_true")
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--exit-after", type=int, default=0)
    args, _unknown = p.parse_known_args(argv)  # the rest of SGLang's arguments do not apply here
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    engine = Engine(args)
    info = {
        "version": VERSION,
        "model_path": args.model_path,
        "forward_hooks": json.loads(args.forward_hooks) if args.forward_hooks else None,
        "disable_radix_cache": args.disable_radix_cache,
        "disable_prefill_cuda_graph": args.disable_prefill_cuda_graph,
        "chunked_prefill_size": args.chunked_prefill_size,
        "enable_metrics": args.enable_metrics,
        "tp_size": 1,
    }
    # 127.0.0.1 only, whatever --host says: this is a test double
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(engine, args, info))
    server.daemon_threads = True
    print(f"fake sglang ready on 127.0.0.1:{server.server_address[1]}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()


if __name__ == "__main__":
    main()
