"""Hugging Face producer: the model runs in worker processes, never in the daemon.

Each worker (:mod:`eagle3d.remote.hf_worker`) is a child process fed over a pipe. When one
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
import time
from typing import Any

from eagle3proto.events import ProducerHealth
from eagle3proto.wire import FrameBuffer

from eagle3d.core.envfault import ALONE, OUT_OF_MEMORY
from eagle3d.core.sample import Request
from eagle3d.produce.base import DumpGrace, Producer, ProducerEvents
from eagle3d.produce.hf_layout import (
    GPU_BATCH_TOKENS,
    model_weight_bytes,
    token_budget,
    usable_cpus,
    visible_gpus,
    worker_device,
    worker_layout,
)
from eagle3d.produce.hf_workers import Launcher, ProducerStartError, Worker, WorkerArgs, to_take
from eagle3d.produce.hf_zygote import wait_or_kill
from eagle3d.remote import hf_protocol as pr


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
        batch_tokens: int = 0,  # 0: by the device (token_budget)
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
        self._budget = batch_tokens  # by the device when 0, once the GPUs are counted
        self.device = device
        self.dtype = dtype
        self.store_dtype = store_dtype  # '' keeps the compute dtype (the commit casts)
        self.hang_timeout = hang_timeout
        self.threads = threads
        self._window = window
        self._workers: list[Worker | None] = [None] * max(1, workers)
        self._launched: list[Worker] = []  # started by launch(), not yet awaited
        self._launcher = Launcher()
        self._is_up = False  # start() returned (a restart's load is then waited for at stop)
        self._events: ProducerEvents | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._restarts = 0
        self._latency: list[float] = []
        self._stopped = False
        self.info: pr.Ready | None = None
        self._rr = 0
        self._gpus = 0
        self._backlog: list[Request] = []  # submitted while no worker was up
        self._grace = DumpGrace()  # dumps the workers wrote that the daemon has not seen
        self._requests: dict[str, Request] = {}  # at a worker: kept to move it elsewhere
        # Samples a worker died computing in a batch of several: each is computed alone
        # until it ends, so that a second death proves which one it was (envfault.ALONE).
        self._suspects: set[int] = set()
        self._moved = 0  # requests handed from a busy worker to an idle one
        self._real = 0  # tokens computed for real, and with padding, over all batches
        self._padded = 0

    # -- lifecycle ----------------------------------------------------------------------------

    async def launch(self, events: ProducerEvents) -> None:
        """The worker processes started (each loads the model); :meth:`start` awaits them."""
        self._events = events
        self._gpus = visible_gpus(self.device)
        self._budget = token_budget(self.batch_tokens, self.device, self._gpus)
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
        self._launched = [await self._begin(i) for i in range(self.n_workers)]

    async def start(self, events: ProducerEvents) -> None:
        if not self._launched:
            await self.launch(events)
        launched, self._launched = self._launched, []
        await asyncio.gather(*(self._up(w) for w in launched))
        infos = [w.info for w in self._workers if w is not None and w.info is not None]
        devices = sorted({i.device for i in infos})
        # As the workers report it (torch.get_num_threads()), not as asked.
        told = sorted({i.threads for i in infos})
        each = f"{'/'.join(map(str, told))} thread{'s' if told[-1:] != [1] else ''} each"
        malloc, budget = "/".join(sorted({i.malloc for i in infos})), f"{self._budget:,}"
        on = f"{self.n_workers} worker(s) on {', '.join(devices)}, {each}"
        events.producer_state("up", f"{on}, batches of {budget} tokens; malloc: {malloc}")
        self._is_up = True

    async def _spawn(self, slot: int) -> Worker:
        return await self._up(await self._begin(slot))

    async def _begin(self, slot: int) -> Worker:
        """Worker ``slot``'s process started, its reports read."""
        device = worker_device(self.device, slot, self._gpus)
        args = WorkerArgs(
            self.model,
            self.dump_dir,
            self._budget,
            device,
            self.dtype,
            self.aux_layers,
            self.store_dtype,
            self.threads,
        )
        proc = await self._launcher.start(args, self._gpus)
        w = Worker(slot, proc, last_progress=time.monotonic())
        w.ready = asyncio.get_running_loop().create_future()
        self._workers[slot] = w
        w.reader = asyncio.create_task(self._read(w))
        self._track(w.reader)
        return w

    async def _up(self, w: Worker) -> Worker:
        """``w`` once it has loaded the model (raises ProducerStartError if it could not)."""
        assert w.ready is not None
        info = await w.ready
        self.info = info
        w.info = info
        w.last_progress = time.monotonic()
        self._track(asyncio.create_task(self._watch(w)))
        return w

    def _track(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read(self, w: Worker) -> None:
        frames = FrameBuffer()
        assert w.proc.stdout is not None
        while True:
            chunk = await w.proc.stdout.read(1 << 16)
            if not chunk:
                break
            for payload in frames.feed(chunk):
                self._on_message(w, pr.from_worker(payload))
        if w.ready is not None and not w.ready.done():
            code = await w.proc.wait()
            w.ready.set_exception(ProducerStartError(Launcher.load_exit(w.proc, code)))

    def _on_message(self, w: Worker, msg: pr.FromWorker) -> None:
        now = time.monotonic()
        if isinstance(msg, pr.Ready):
            assert w.ready is not None
            if not w.ready.done():  # a stop during the load cancelled the wait for it
                w.ready.set_result(msg)
        elif isinstance(msg, pr.LoadFailed):
            assert w.ready is not None
            if not w.ready.done():
                w.ready.set_exception(ProducerStartError(f"{msg.error}: {msg.message}"))
        elif isinstance(msg, pr.Start):
            w.last_progress = now
            w.running = set(msg.rids)
            if self._events is not None:
                self._events.requests_started(list(msg.rids))
        elif isinstance(msg, pr.Done):
            w.last_progress = now
            w.running = set()
            for rid in msg.rids:
                w.inflight.pop(rid, None)
                self._forget(rid)
            w.unwritten.update(msg.rids)
            w.owes = bool(w.inflight)
            self._latency = [*self._latency, msg.secs][-20:]
            self._real += msg.tokens
            self._padded += msg.padded
        elif isinstance(msg, pr.Idle):  # its loop waits for work: alive, and owing nothing
            w.last_progress = now
            w.owes = bool(w.inflight)
            # Only a loop that says it waits takes work over: a worker that hangs after a
            # batch's "done" must not pull others' requests into its queue.
            self._balance(w)
        elif isinstance(msg, pr.Given):
            w.asked = False
            for rid in msg.rids:
                if w.inflight.pop(rid, None) is None:
                    continue  # cancelled meanwhile
                request = self._requests.pop(rid, None)
                if request is not None:
                    self._moved += 1
                    self.submit(request)
        elif isinstance(msg, pr.Written):
            # Usually the daemon has seen most of a batch's dumps before the batch's
            # "written" arrives (it is sent after the last one): only the rest is awaited.
            w.unwritten.difference_update(msg.rids)
            for rid in msg.rids:
                self._grace.written(rid, now)
        elif isinstance(msg, pr.Fail) and self._events is not None:
            w.inflight.pop(msg.rid, None)
            w.unwritten.discard(msg.rid)
            self._forget(msg.rid)
            self._events.request_failed(msg.rid, msg.error, msg.message, True)

    def _balance(self, idle: Worker) -> None:
        """``idle`` waits for work with nothing queued: take over part of the requests
        waiting at the busiest worker, so that both run out at about the same time.

        At the end of the dataset nothing refills the window, and one worker sat idle while
        another still had a queue (about 1 s of a 7.5 s demo run on two CPU workers). The
        worker hands back only what it has not started ("given"); those are resubmitted.
        """
        found = to_take(self._workers, idle)
        if found is None:
            return
        victim, take = found
        assert victim.proc.stdin is not None
        victim.asked = True
        with contextlib.suppress(ConnectionError, RuntimeError):
            victim.proc.stdin.write(pr.frame(pr.Give(take)))

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

    async def _watch(self, w: Worker) -> None:
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
                if code == pr.EXIT_OUT_OF_MEMORY:
                    reason += f" ({OUT_OF_MEMORY})"
            if w.stopping or self._stopped:
                return
            await self._restart(w, reason)
            return

    def _forget(self, rid: str) -> None:
        """Request ``rid`` ended (done, failed, cancelled): it is no longer a suspect."""
        request = self._requests.pop(rid, None)
        if request is not None:
            self._suspects.discard(request.idx)

    def _blame(self, w: Worker, reason: str) -> dict[str, str]:
        """What each request in flight at dead worker ``w`` is told (see envfault.ALONE):
        the batch it was computing, alone, is charged; in a batch of several, each is sent
        again alone and nothing is charged; one not yet started, or computed but its dump not
        yet written, was not involved."""
        running = w.running & set(w.inflight)
        said: dict[str, str] = {}
        for rid in w.inflight:
            request = self._requests.pop(rid, None)
            if rid not in running:
                said[rid] = f"{reason}, before this request started"
            elif len(running) == 1:
                said[rid] = f"{reason}, {ALONE}"
            else:
                said[rid] = (
                    f"{reason}, computing a batch of {len(running)}: each is sent again alone"
                )
                if request is not None:
                    self._suspects.add(request.idx)
        for rid in w.unwritten:
            # Computed, its dump still in the worker's writer queue when it died: without
            # this it waited for the request timeout, and was charged an attempt there.
            said[rid] = f"{reason}, before the dump it computed was written"
        return said

    async def _restart(self, w: Worker, reason: str) -> None:
        assert self._events is not None
        if w.reader is not None:
            # The worker's last reports (a batch's start) are read before its requests are
            # judged: the pipe ends soon after the process.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(w.reader), 5.0)
        lost = self._blame(w, reason)
        w.inflight.clear()
        w.unwritten.clear()
        w.running = set()
        self._workers[w.slot] = None
        self._restarts += 1
        self._events.producer_state("restarting", reason)
        for rid, said in lost.items():
            self._events.request_failed(rid, "ProducerCrashed", said, True)
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
        self._launcher.abandon()  # a zygote still importing (nothing forked yet) ends now
        for w in self._workers:
            if w is None:
                continue
            w.stopping = True
            if not self._is_up and w.info is None:
                # A start cut short: it holds no request, and would read "stop" once loaded.
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
                continue
            if w.proc.stdin is not None and not w.proc.stdin.is_closing():
                with contextlib.suppress(Exception):
                    w.proc.stdin.write(pr.frame(pr.Stop()))
                    w.proc.stdin.close()
        for w in self._workers:
            if w is not None:
                await wait_or_kill(w.proc, 10)
        await self._launcher.close()
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
        # the dataset (counting only waiting requests left a single-threaded worker idle for
        # a batch's length at the end: 1.2-1.8 s of 8.6 s on the demo set).
        w = min(live, key=lambda x: (sum(x.inflight.values()), x.slot))
        if not w.owes:
            w.last_progress = time.monotonic()  # it was idle, not stuck: the clock starts now
            w.owes = True
        w.inflight[request.rid] = len(request.input_ids)
        self._requests[request.rid] = request
        assert w.proc.stdin is not None
        # A dead worker's pipe refuses the write; its watcher resends everything in flight.
        with contextlib.suppress(ConnectionError, RuntimeError):
            alone = request.idx in self._suspects
            w.proc.stdin.write(pr.frame(pr.Req(request.rid, request.input_ids, alone)))

    def cancel(self, rid: str) -> None:
        self._grace.forget(rid)
        self._forget(rid)
        self._backlog = [r for r in self._backlog if r.rid != rid]
        for w in self._workers:
            if w is not None:
                w.unwritten.discard(rid)
            if w is not None and rid in w.inflight:
                del w.inflight[rid]
                assert w.proc.stdin is not None
                with contextlib.suppress(ConnectionError, RuntimeError):
                    w.proc.stdin.write(pr.frame(pr.Cancel(rid)))

    def window(self) -> int:
        if self._window:
            return self._window
        # Enough queued work for each worker to choose batches of similar lengths from: by
        # default 64 requests (a CPU's small budget pads least with the most to choose from).
        return max(16, 4 * self.n_workers * max(1, (self.batch_tokens or GPU_BATCH_TOKENS) // 512))

    def is_stuck(self, now: float) -> bool:
        return any(w is not None and self._hung(w, now) for w in self._workers)

    def _hung(self, w: Worker, now: float) -> bool:
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
                "device": ", ".join(sorted({w.info.device for w in live if w.info})),
                "dtype": self.info.dtype if self.info else "",
                "store_dtype": self.info.store_dtype if self.info else "",
                "inflight": float(sum(len(w.inflight) for w in live)),
                # Real tokens over computed ones: what the length-sorted batching saves.
                "batch_fill": round(self._real / self._padded, 3) if self._padded else 0.0,
                "moved": float(self._moved),
            },
        )
