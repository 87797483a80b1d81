"""The HF producer's worker processes: how one is started, and what the producer knows of it."""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass, field
from typing import Protocol

from eagle3d.produce.hf_zygote import ForkedWorker, Zygote, forkable, wanted
from eagle3d.remote import hf_protocol as pr


class ProducerStartError(RuntimeError):
    """The worker could not load the model."""


class WorkerProc(Protocol):
    """A worker process as the producer drives it: an exec'd child
    (:class:`asyncio.subprocess.Process`) or one forked by the zygote (:class:`ForkedWorker`)."""

    @property
    def pid(self) -> int | None: ...
    @property
    def stdin(self) -> asyncio.StreamWriter | None: ...
    @property
    def stdout(self) -> asyncio.StreamReader | None: ...
    async def wait(self) -> int | None: ...
    def kill(self) -> None: ...


@dataclass(slots=True)
class Worker:
    """One worker process, as the producer tracks it."""

    slot: int
    proc: WorkerProc
    inflight: dict[str, int] = field(default_factory=dict)  # rid -> tokens, oldest first
    running: set[str] = field(default_factory=set)  # the batch it is computing now
    asked: bool = False  # a "give" to it is unanswered
    last_progress: float = 0.0
    # Work was sent here since the worker last made progress or said it was idle: its hang
    # clock runs, whatever then took the work away (the daemon's timeout, another worker).
    owes: bool = False
    ready: asyncio.Future[pr.Ready] | None = None
    info: pr.Ready | None = None
    stopping: bool = False
    reader: asyncio.Task[None] | None = None  # reads its reports until its pipe ends
    unwritten: set[str] = field(default_factory=set)  # computed ("done"), not yet "written"


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    """What a worker is started with (its command line)."""

    model: str
    dump_dir: str
    batch_tokens: int
    device: str
    dtype: str
    aux_layers: list[int]
    store_dtype: str
    threads: int

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "eagle3d.remote.hf_worker", *self.flags()]

    def flags(self) -> list[str]:
        cmd = ["--model", self.model]
        cmd += ["--dump-dir", self.dump_dir, "--batch-tokens", str(self.batch_tokens)]
        cmd += ["--device", self.device, "--dtype", self.dtype]
        if self.aux_layers:
            cmd += ["--aux-layers", ",".join(map(str, self.aux_layers))]
        if self.store_dtype:
            cmd += ["--store-dtype", self.store_dtype]
        return [*cmd, "--threads", str(self.threads)]


def worker_env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        # A worker never downloads, and its progress bars would only clutter the log.
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }


async def launch(args: WorkerArgs) -> asyncio.subprocess.Process:
    """Start a worker process with a pipe each way."""
    return await asyncio.create_subprocess_exec(
        *args.argv(),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env=worker_env(),
    )


class Launcher:
    """Starts the workers: CPU workers forked from one zygote (started with the first), the
    others, and all of them once the zygote is gone or turned off, exec'd
    (:mod:`eagle3d.produce.hf_zygote`)."""

    def __init__(self) -> None:
        self.zygote: Zygote | None = None
        self._use = wanted()

    async def start(self, args: WorkerArgs, gpus: int) -> WorkerProc:
        if self._use and forkable(args.device, gpus):
            if self.zygote is None:
                self.zygote = await Zygote.launch(args.model, worker_env(), args.flags())
            forked = await self.zygote.fork(args.flags())
            if forked is not None:
                return forked
        return await launch(args)

    def abandon(self) -> None:
        """A stop while the workers load (see :meth:`Zygote.abandon`)."""
        if self.zygote is not None:
            self.zygote.abandon()

    async def close(self) -> None:
        if self.zygote is not None:
            await self.zygote.close()

    @staticmethod
    def load_exit(proc: WorkerProc, code: int | None) -> str:
        """Why a worker that ended while loading did not come up."""
        if isinstance(proc, ForkedWorker) and proc.error:
            return proc.error
        return f"hf worker exited with {code} while loading"


def to_take(workers: list[Worker | None], idle: Worker) -> tuple[Worker, list[str]] | None:
    """What ``idle`` (waiting for work) takes over: the busiest worker and the requests of
    its queue to ask back (half of what it has left, counting its running batch as half
    done; the newest go, so it keeps its oldest-first order). None: nothing to take."""
    if idle.inflight or idle.stopping:
        return None
    best: tuple[int, Worker, list[str]] | None = None
    for v in workers:
        if v is None or v is idle or v.asked or v.stopping:
            continue
        waiting = [r for r in v.inflight if r not in v.running]
        tokens = sum(v.inflight[r] for r in waiting)
        if waiting and (best is None or tokens > best[0]):
            best = (tokens, v, waiting)
    if best is None:
        return None
    waiting_tokens, victim, waiting = best
    running = sum(victim.inflight[r] for r in victim.running if r in victim.inflight)
    share = (waiting_tokens + running / 2) / 2
    take: list[str] = []
    taken = 0
    for rid in reversed(waiting):
        if take and taken + victim.inflight[rid] > share:
            break
        take.append(rid)
        taken += victim.inflight[rid]
    return victim, take
