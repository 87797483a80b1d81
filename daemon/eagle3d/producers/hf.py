"""Hugging Face producer: the model runs in worker processes, never in the daemon.

Each worker (:mod:`eagle3d.producers.hf_worker`) is a child process fed over a pipe. When one
dies, its in-flight requests are reported failed (retryable) so the daemon resends them, and
the worker is restarted with capped back-off. When work was sent to one and it reports no
progress for ``hang_timeout`` seconds (even if the work was taken away meanwhile) it is killed
and restarted the same way.

A request goes to the worker with the fewest tokens outstanding. Each worker batches from its
own queue; a worker that runs dry takes over the newest waiting requests of the busiest one
(``give``/``given``), so at the end of the dataset the workers finish together.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from eagle3proto.codec import encode_frame
from eagle3proto.events import ProducerHealth
from eagle3proto.wire import FrameBuffer

from .base import DumpGrace, Producer, ProducerEvents, Request

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(dict[str, Any])


class ProducerStartError(RuntimeError):
    """The worker could not load the model."""


def worker_device(device: str, slot: int, gpus: int) -> str:
    """The ``--device`` for worker ``slot``: on CUDA, workers go round-robin over the GPUs.

    Without this, ``--workers 8`` on an 8-GPU node would load eight copies of the model onto
    the first GPU. ``gpus`` counts the GPUs this process sees (``CUDA_VISIBLE_DEVICES``
    applies); with none, ``auto`` stays ``auto`` and the worker takes the CPU.
    """
    if device in ("auto", "cuda") and gpus > 0:
        return f"cuda:{slot % gpus}"
    return device


# More CPU workers than this gain little: each holds a copy of the model and its activations.
MAX_CPU_WORKERS = 8


def worker_layout(
    workers: int, threads: int, *, gpus: int, cpus: int, model_bytes: int, mem_available: int
) -> tuple[int, int]:
    """(worker processes, torch threads in each) for ``--workers``/``--worker-threads``.

    0 means automatic. On GPUs: one worker per GPU. On a CPU: one worker per core, at most
    :data:`MAX_CPU_WORKERS`, and no more copies of the model than half the available memory
    holds (counting each copy twice, for an fp32 upcast and the activations). The CPUs are
    then divided among the workers. Why several single-threaded workers rather than one
    worker using every core: a multi-threaded forward meets at a barrier after each operator,
    so CPU time the daemon takes from one core stalls all of them, while independent workers
    lose only the time taken (docs/benchmarks.md, fifth session).
    """
    cpus = max(1, cpus)
    if workers <= 0:
        if gpus > 0:
            workers = gpus
        else:
            fits = mem_available // max(1, 4 * model_bytes)
            workers = max(1, min(cpus, MAX_CPU_WORKERS, fits))
    if threads <= 0:
        threads = max(1, cpus // workers)
    return workers, threads


def model_weight_bytes(model_dir: str) -> int:
    """Bytes of the weight files in a model directory (0 when there are none to count)."""
    total = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(model_dir):
            if entry.name.endswith((".safetensors", ".bin", ".pt", ".pth")) and entry.is_file():
                total += entry.stat().st_size
    return total


def usable_cpus() -> int:
    """CPUs this process may run on (Slurm and cgroup affinity apply), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def visible_gpus(device: str) -> int:
    """How many CUDA devices this process sees; 0 for a CPU job or a CPU-only torch."""
    if device == "cpu":
        return 0
    try:
        import torch
    except ImportError:  # pragma: no cover - the extract extra brings torch
        return 0
    # device_count() asks the driver without creating a context: no GPU memory is taken
    # in the daemon, and the workers are exec'd, never forked from it.
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


@dataclass(slots=True)
class _Worker:
    slot: int
    proc: asyncio.subprocess.Process
    inflight: dict[str, int] = field(default_factory=dict)  # rid -> tokens, oldest first
    running: set[str] = field(default_factory=set)  # the batch it is computing now
    asked: bool = False  # a "give" to it is unanswered
    last_progress: float = 0.0
    # Work was sent here since the worker last made progress or said it was idle: its hang
    # clock runs, whatever then took the work away (the daemon's timeout, another worker).
    owes: bool = False
    ready: asyncio.Future[dict[str, Any]] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    stopping: bool = False


class HFProducer(Producer):
    """Runs a transformers model in ``workers`` child processes (0: see :func:`worker_layout`)."""

    name = "hf"

    def __init__(
        self,
        model: str,
        *,
        dump_dir: str,
        aux_layers: list[int] | None = None,
        workers: int = 0,
        batch_tokens: int = 8192,
        device: str = "auto",
        dtype: str = "auto",
        store_dtype: str = "",
        hang_timeout: float = 600.0,
        window: int = 0,
        threads: int = 0,
    ) -> None:
        self.model = model
        self.dump_dir = dump_dir
        self.aux_layers = aux_layers or []
        self.n_workers = workers
        self.batch_tokens = batch_tokens
        self.device = device
        self.dtype = dtype
        self.store_dtype = store_dtype  # '' keeps the compute dtype (the commit casts)
        self.hang_timeout = hang_timeout
        self.threads = threads
        self._window = window
        self._workers: list[_Worker | None] = [None] * max(1, workers)
        self._events: ProducerEvents | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._restarts = 0
        self._latency: list[float] = []
        self._stopped = False
        self.info: dict[str, Any] = {}
        self._rr = 0
        self._gpus = 0
        self._backlog: list[Request] = []  # submitted while no worker was up
        self._grace = DumpGrace()  # dumps the workers wrote that the daemon has not seen
        self._requests: dict[str, Request] = {}  # at a worker: kept to move it elsewhere
        self._moved = 0  # requests handed from a busy worker to an idle one
        self._real = 0  # tokens computed for real, and with padding, over all batches
        self._padded = 0

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self, events: ProducerEvents) -> None:
        self._events = events
        self._gpus = visible_gpus(self.device)
        import psutil

        self.n_workers, self.threads = worker_layout(
            self.n_workers,
            self.threads,
            gpus=self._gpus,
            cpus=usable_cpus(),
            model_bytes=model_weight_bytes(self.model),
            mem_available=psutil.virtual_memory().available,
        )
        self._workers = [None] * self.n_workers
        await asyncio.gather(*(self._spawn(i) for i in range(self.n_workers)))
        devices = sorted({str(w.info.get("device")) for w in self._workers if w is not None})
        # As the workers report it (torch.get_num_threads()), not as asked.
        told = sorted({int(w.info.get("threads", 0)) for w in self._workers if w is not None})
        each = f"{'/'.join(map(str, told))} thread{'s' if told[-1:] != [1] else ''} each"
        malloc = sorted({str(w.info.get("malloc", "")) for w in self._workers if w is not None})
        events.producer_state(
            "up",
            f"{self.n_workers} worker(s) on {', '.join(devices)}, {each}; "
            f"malloc: {'/'.join(malloc)}",
        )

    async def _spawn(self, slot: int) -> _Worker:
        cmd = [
            sys.executable,
            "-m",
            "eagle3d.producers.hf_worker",
            "--model",
            self.model,
            "--dump-dir",
            self.dump_dir,
            "--batch-tokens",
            str(self.batch_tokens),
            "--device",
            worker_device(self.device, slot, self._gpus),
            "--dtype",
            self.dtype,
        ]
        if self.aux_layers:
            cmd += ["--aux-layers", ",".join(map(str, self.aux_layers))]
        if self.store_dtype:
            cmd += ["--store-dtype", self.store_dtype]
        cmd += ["--threads", str(self.threads)]
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env={
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                # A worker never downloads, and its progress bars would only clutter the log.
                "HF_HUB_OFFLINE": "1",
                "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                "TRANSFORMERS_VERBOSITY": "error",
            },
        )
        w = _Worker(slot, proc, last_progress=time.monotonic())
        w.ready = asyncio.get_running_loop().create_future()
        self._workers[slot] = w
        self._track(asyncio.create_task(self._read(w)))
        info = await w.ready
        self.info = info
        w.info = info
        w.last_progress = time.monotonic()
        self._track(asyncio.create_task(self._watch(w)))
        return w

    def _track(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read(self, w: _Worker) -> None:
        frames = FrameBuffer()
        assert w.proc.stdout is not None
        while True:
            chunk = await w.proc.stdout.read(1 << 16)
            if not chunk:
                break
            for payload in frames.feed(chunk):
                self._on_message(w, _dec.decode(payload))
        if w.ready is not None and not w.ready.done():
            code = await w.proc.wait()
            w.ready.set_exception(ProducerStartError(f"hf worker exited with {code} while loading"))

    def _on_message(self, w: _Worker, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        now = time.monotonic()
        if op == "ready":
            assert w.ready is not None
            if not w.ready.done():  # a stop during the load cancelled the wait for it
                w.ready.set_result(msg)
        elif op == "fatal":
            assert w.ready is not None
            if not w.ready.done():
                w.ready.set_exception(
                    ProducerStartError(f"{msg.get('error')}: {msg.get('message')}")
                )
        elif op == "start":
            w.last_progress = now
            w.running = set(msg["rids"])
            if self._events is not None:
                self._events.requests_started(list(msg["rids"]))
        elif op == "done":
            w.last_progress = now
            w.running = set()
            for rid in msg["rids"]:
                w.inflight.pop(rid, None)
                self._requests.pop(rid, None)
            w.owes = bool(w.inflight)
            self._latency = ([*self._latency, float(msg.get("secs", 0.0))])[-20:]
            self._real += int(msg.get("tokens", 0))
            self._padded += int(msg.get("padded", 0))
        elif op == "idle":  # the worker's own loop waits for work: alive and owing nothing
            w.last_progress = now
            w.owes = bool(w.inflight)
            # Only a loop that says it waits takes work over: a worker that hangs after a
            # batch's "done" must not pull others' requests into its queue.
            self._balance(w)
        elif op == "given":
            w.asked = False
            for rid in msg["rids"]:
                if w.inflight.pop(rid, None) is None:
                    continue  # cancelled meanwhile
                request = self._requests.pop(rid, None)
                if request is not None:
                    self._moved += 1
                    self.submit(request)
        elif op == "written":
            # Usually the daemon has seen most of a batch's dumps before the batch's
            # "written" arrives (it is sent after the last one): only the rest is awaited.
            for rid in msg["rids"]:
                self._grace.written(rid, now)
        elif op == "fail" and self._events is not None:
            w.inflight.pop(msg["rid"], None)
            self._requests.pop(msg["rid"], None)
            self._events.request_failed(msg["rid"], msg["error"], msg.get("message", ""), True)

    def _balance(self, idle: _Worker) -> None:
        """``idle`` waits for work with nothing queued: take over part of the requests
        waiting at the busiest worker, so that both run out at about the same time.

        Dispatching by tokens outstanding balances the workers while the daemon refills its
        window; at the end of the dataset nothing is refilled, and one worker used to sit
        idle while another still had a queue behind its running batch (about 1 s of a 7.5 s
        demo run on this machine's two single-threaded workers). The worker hands back only
        what it has not started (its "given" answer); those are resubmitted here.
        """
        if idle.inflight or idle.stopping:
            return
        best: tuple[int, _Worker, list[str]] | None = None
        for v in self._workers:
            if v is None or v is idle or v.asked or v.stopping:
                continue
            waiting = [r for r in v.inflight if r not in v.running]
            tokens = sum(v.inflight[r] for r in waiting)
            if waiting and (best is None or tokens > best[0]):
                best = (tokens, v, waiting)
        if best is None:
            return
        waiting_tokens, victim, waiting = best
        # Half of what the victim has left, counting its running batch as half done: the
        # newest requests go, so the victim keeps its oldest-first order.
        running = sum(victim.inflight[r] for r in victim.running if r in victim.inflight)
        share = (waiting_tokens + running / 2) / 2
        take: list[str] = []
        taken = 0
        for rid in reversed(waiting):
            if take and taken + victim.inflight[rid] > share:
                break
            take.append(rid)
            taken += victim.inflight[rid]
        assert victim.proc.stdin is not None
        victim.asked = True
        with contextlib.suppress(ConnectionError, RuntimeError):
            victim.proc.stdin.write(encode_frame(_enc.encode({"op": "give", "rids": take})))

    def dump_arrived(self, rid: str) -> None:
        self._grace.arrived(rid, time.monotonic())

    def _missing_dumps(self, now: float) -> None:
        """Requests whose dump the worker wrote long ago but the daemon never saw (removed
        with the dump area before it looked): retried now rather than at the request
        timeout (see :class:`DumpGrace`)."""
        for rid in self._grace.late(now):
            if self._events is not None:
                why = f"the worker wrote its dump {self._grace.grace:.0f} s ago and none arrived"
                self._events.request_failed(rid, "DumpMissing", why, True)

    async def _watch(self, w: _Worker) -> None:
        """Restart the worker when it dies or hangs; its in-flight requests are resent."""
        while True:
            try:
                code: int | None = await asyncio.wait_for(w.proc.wait(), timeout=1.0)
            except TimeoutError:
                if w.slot == 0:
                    self._missing_dumps(time.monotonic())
                hung = self._hung(w, time.monotonic())
                if not hung:
                    continue
                reason = f"worker {w.proc.pid} made no progress for {self.hang_timeout:.0f} s"
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
                await w.proc.wait()
            else:
                reason = f"worker {w.proc.pid} exited with code {code}"
            if w.stopping or self._stopped:
                return
            await self._restart(w, reason)
            return

    async def _restart(self, w: _Worker, reason: str) -> None:
        assert self._events is not None
        lost = list(w.inflight)
        w.inflight.clear()
        w.running = set()
        for rid in lost:
            self._requests.pop(rid, None)
        self._workers[w.slot] = None
        self._restarts += 1
        self._events.producer_state("restarting", reason)
        for rid in lost:
            self._events.request_failed(rid, "ProducerCrashed", reason, True)
        delay = 0.5
        while not self._stopped:
            try:
                await self._spawn(w.slot)
                self._events.producer_state("up", f"worker restarted after: {reason}")
                backlog, self._backlog = self._backlog, []
                for request in backlog:
                    self.submit(request)
                return
            except ProducerStartError as e:
                self._events.producer_state("down", str(e))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    async def stop(self) -> None:
        self._stopped = True
        for w in self._workers:
            if w is None:
                continue
            w.stopping = True
            if w.proc.stdin is not None and not w.proc.stdin.is_closing():
                with contextlib.suppress(Exception):
                    w.proc.stdin.write(encode_frame(_enc.encode({"op": "stop"})))
                    w.proc.stdin.close()
        for w in self._workers:
            if w is None:
                continue
            try:
                await asyncio.wait_for(w.proc.wait(), timeout=10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
                await w.proc.wait()
        for t in list(self._tasks):
            t.cancel()

    # -- requests -----------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        live = [w for w in self._workers if w is not None and w.ready and w.ready.done()]
        if not live:
            assert self._events is not None
            if not self._stopped:
                # Every worker is (re)starting: hold the request until one is up. Failing it
                # here made the daemon resend at once, and a single-worker producer burned
                # all attempts of everything in flight in a few milliseconds.
                self._backlog.append(request)
                return
            self._events.request_failed(request.rid, "ProducerDown", "no live worker", True)
            return
        # To the worker with the fewest tokens outstanding (its running batch included): the
        # work each has left, so the workers run out at about the same time at the end of
        # the dataset. Counting only waiting requests left one single-threaded worker idle
        # for the length of a batch (1.2-1.8 s of 8.6 s on the demo set); outstanding
        # requests or tokens leave 0.2-0.7 s (docs/benchmarks.md, fifth session).
        w = min(live, key=lambda x: (sum(x.inflight.values()), x.slot))
        if not w.owes:
            w.last_progress = time.monotonic()  # it was idle, not stuck: the clock starts now
            w.owes = True
        w.inflight[request.rid] = len(request.input_ids)
        self._requests[request.rid] = request
        msg = {"op": "req", "rid": request.rid, "ids": request.input_ids}
        assert w.proc.stdin is not None
        # A dead worker's pipe refuses the write; its watcher resends everything in flight.
        with contextlib.suppress(ConnectionError, RuntimeError):
            w.proc.stdin.write(encode_frame(_enc.encode(msg)))

    def cancel(self, rid: str) -> None:
        self._grace.forget(rid)
        self._requests.pop(rid, None)
        self._backlog = [r for r in self._backlog if r.rid != rid]
        for w in self._workers:
            if w is not None and rid in w.inflight:
                del w.inflight[rid]
                assert w.proc.stdin is not None
                with contextlib.suppress(ConnectionError, RuntimeError):
                    w.proc.stdin.write(encode_frame(_enc.encode({"op": "cancel", "rid": rid})))

    def window(self) -> int:
        if self._window:
            return self._window
        # Enough queued work for the worker to sort by length and fill two budgets.
        return max(16, 4 * self.n_workers * max(1, self.batch_tokens // 512))

    def is_stuck(self, now: float) -> bool:
        return any(w is not None and self._hung(w, now) for w in self._workers)

    def _hung(self, w: _Worker, now: float) -> bool:
        """Work was sent to ``w`` and it made no progress (a batch started or done, or its
        loop waiting for work) for ``hang_timeout``, even if the work has since been taken
        away: by the daemon's own request timeout (the same length) or by an idle worker
        (``give``, which the worker's reader thread answers even when its loop is stuck).
        Otherwise a hung worker looked idle, was sent more, and was never restarted."""
        return w.owes and now - w.last_progress > self.hang_timeout

    def health(self) -> ProducerHealth:
        live = [w for w in self._workers if w is not None and w.ready and w.ready.done()]
        lat = sum(self._latency) / len(self._latency) if self._latency else 0.0
        return ProducerHealth(
            name=f"hf:{os.path.basename(self.model.rstrip('/'))}",
            up=len(live) == self.n_workers and not self._stopped,
            latency_s=lat,
            restarts=self._restarts,
            detail={
                "workers": float(len(live)),
                "threads_per_worker": float(self.threads),
                "device": ", ".join(sorted({str(w.info.get("device", "")) for w in live})),
                "dtype": str(self.info.get("dtype", "")),
                "store_dtype": str(self.info.get("store_dtype", "")),
                "inflight": float(sum(len(w.inflight) for w in live)),
                # Real tokens over computed ones: what the length-sorted batching saves.
                "batch_fill": round(self._real / self._padded, 3) if self._padded else 0.0,
                "moved": float(self._moved),
            },
        )
