"""The daemon's side of the HF workers' zygote (:mod:`eagle3d.remote.hf_zygote`).

Each worker process imports torch and transformers before it loads the model: about 2.5
CPU-seconds each, which on a small CPU host competes with the daemon's own start and the other
workers' (docs/benchmarks.md, "Whole short job"). The zygote pays them once and forks each CPU
worker; a GPU worker is still exec'd (:func:`forkable`), since the zygote never touches CUDA.
``EAGLE3D_WORKER_ZYGOTE=0`` turns it off (every worker exec'd, as before).

A forked worker is the zygote's child, not the daemon's: :class:`ForkedWorker` gives the
producer what :class:`asyncio.subprocess.Process` gives (pid, pipes, ``wait``, ``kill``). The
pipes are made here and their child ends travel with the ``fork`` message; the pid and a pidfd
come back with ``forked`` (a kill through the pidfd can never hit a reused pid); the exit status
comes from the zygote, which reaps. If the zygote dies, the workers it forked go on: their end
is still seen on the pidfd, with no status (``wait`` gives None); a worker it had not forked yet
fails like a worker that could not load, and later workers are exec'd.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from typing import Protocol

from eagle3d.produce.hf_layout import cpu_worker
from eagle3d.remote import hf_protocol as pr
from eagle3d.remote.hf_zygote import ABANDON

ENV = "EAGLE3D_WORKER_ZYGOTE"


def wanted() -> bool:
    """Whether CPU workers are forked from a zygote (the default), per ``EAGLE3D_WORKER_ZYGOTE``."""
    return os.environ.get(ENV, "1") != "0" and hasattr(os, "pidfd_open")


def forkable(device: str, gpus: int) -> bool:
    """A worker on this ``--device`` may be forked: it is a CPU worker (never touches CUDA)."""
    return cpu_worker(device, gpus)


class Ending(Protocol):
    """A process this side can wait for and kill: an exec'd child or a forked worker."""

    async def wait(self) -> int | None: ...
    def kill(self) -> None: ...


async def wait_or_kill(proc: Ending, grace: float) -> None:
    """``proc`` ended: ``grace`` seconds to leave by itself, then SIGKILLed and reaped."""
    try:
        await asyncio.wait_for(proc.wait(), timeout=grace)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


class ForkedWorker:
    """A worker forked by the zygote, as the producer drives it."""

    def __init__(self, zygote: Zygote, ident: int) -> None:
        self._zygote = zygote
        self.id = ident
        self.pid: int | None = None
        self.stdin: asyncio.StreamWriter | None = None
        self.stdout: asyncio.StreamReader | None = None
        self.error = ""  # why it never ran, if it did not
        self._pidfd: int | None = None
        self._ended = False  # its pidfd said so
        self._code: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()

    async def wait(self) -> int | None:
        """Its exit status (-N: signal N), once it has ended; None if the zygote, gone, could
        not say."""
        return await asyncio.shield(self._code)

    def kill(self) -> None:
        if self._code.done():
            raise ProcessLookupError(self.pid)
        if self._pidfd is not None:
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        else:  # not forked yet: the zygote kills it as soon as it is
            self._zygote.send(pr.Kill(self.id))

    def forked(self, pid: int, pidfd: int) -> None:
        self.pid, self._pidfd = pid, pidfd
        asyncio.get_running_loop().add_reader(pidfd, self._pidfd_ready)

    def _pidfd_ready(self) -> None:
        assert self._pidfd is not None
        asyncio.get_running_loop().remove_reader(self._pidfd)
        self._ended = True
        if self._zygote.gone:
            self.ended(None)

    def ended(self, code: int | None, error: str = "") -> None:
        if self._code.done():
            return
        self.error = self.error or error
        if self._pidfd is not None:
            if not self._ended:
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        self._code.set_result(code)

    def orphaned(self, why: str) -> None:
        """The zygote is gone: a worker it forked ends on its own; one it had not, now."""
        if self.pid is None:
            self.ended(None, why)
        elif self._ended:
            self.ended(None)


class Zygote:
    """One zygote process and the workers it forked."""

    def __init__(self, proc: asyncio.subprocess.Process, sock: socket.socket) -> None:
        self.proc = proc
        self._sock = sock
        self.hello: pr.Hello | None = None
        self.gone = False
        self._error = ""
        self._next = 0
        self._workers: dict[int, ForkedWorker] = {}
        self._reaper: asyncio.Task[None] | None = None  # held: the loop keeps only weak refs
        asyncio.get_running_loop().add_reader(sock, self._readable)

    @classmethod
    async def launch(cls, model: str, env: dict[str, str], flags: list[str]) -> Zygote:
        """The zygote started; ``flags``, a worker's, only show on its command line (and
        leave the room its workers' titles take there)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            cmd = [sys.executable, "-m", "eagle3d.remote.hf_zygote", "--fd", str(theirs.fileno())]
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                "--model",
                model,
                "--",
                *flags,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                env=env,
            )
        ours.setblocking(False)
        return cls(proc, ours)

    def send(self, msg: pr.ToZygote, fds: list[int] | None = None) -> None:
        if self.gone:
            return
        try:
            socket.send_fds(self._sock, [pr.encode(msg)], fds or [])
        except OSError:
            self._died()

    async def fork(self, flags: list[str]) -> ForkedWorker | None:
        """A worker started with ``flags`` (its pipes ready at once; it is forked when the
        zygote has imported); None if the zygote is gone."""
        if self.gone:
            return None
        loop = asyncio.get_running_loop()
        self._next += 1
        w = ForkedWorker(self, self._next)
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        self._workers[w.id] = w
        self.send(pr.Fork(w.id, flags), [in_r, out_w])
        os.close(in_r)
        os.close(out_w)
        if self.gone:
            os.close(in_w)
            os.close(out_r)
            del self._workers[w.id]
            return None
        w.stdout = asyncio.StreamReader(limit=1 << 20)
        reader = asyncio.StreamReaderProtocol(w.stdout)
        await loop.connect_read_pipe(lambda: reader, os.fdopen(out_r, "rb", 0))
        transport, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(in_w, "wb", 0)
        )
        w.stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        return w

    def _readable(self) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(self._sock, 1 << 16, 4)
        except (BlockingIOError, ConnectionResetError):
            # A reset is said once, when the zygote ends with our messages unread; what it
            # sent before (an import failure) is still to be read, then the end.
            return
        except OSError:
            data, fds = b"", []
        if not data:
            self._died()
            return
        msg = pr.from_zygote(data)
        if isinstance(msg, pr.Hello):
            self.hello = msg
        elif isinstance(msg, pr.ImportFailed):
            self._error = f"the worker zygote could not import: {msg.error}: {msg.message}"
        elif isinstance(msg, pr.Forked):
            self._workers[msg.id].forked(msg.pid, fds[0])
        elif isinstance(msg, pr.ForkFailed):
            why = f"the worker zygote could not fork: {msg.error}: {msg.message}"
            self._workers.pop(msg.id).ended(None, why)
        else:
            self._workers.pop(msg.id).ended(msg.code)

    def _died(self) -> None:
        if self.gone:
            return
        self.gone = True
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self._sock)
        self._sock.close()
        self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        code = await self.proc.wait()
        why = self._error or f"the worker zygote exited with code {code} before forking it"
        for w in list(self._workers.values()):
            w.orphaned(why)

    def abandon(self) -> None:
        """A stop while starting: end the zygote now if it still imports (it has forked
        nothing then, and ``ABANDON`` ends it); after, it ignores that, and kills in order."""
        if self.hello is None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(ABANDON)

    async def close(self) -> None:
        """Let the zygote go (it leaves on the closed socket) and wait for it."""
        self._died()
        await wait_or_kill(self.proc, 10)
