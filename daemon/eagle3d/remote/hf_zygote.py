"""The HF workers' zygote: ``python -m eagle3d.remote.hf_zygote --fd N [--model DIR] [-- FLAGS]``.

It imports torch, transformers and the worker once, then forks one worker per ``fork`` message
(:mod:`eagle3d.remote.hf_protocol`) on the socket ``N``: the child takes the two pipe ends that
came with the message as its stdin and stdout and runs :func:`eagle3d.remote.hf_worker.main`
with the message's flags, which loads the model and applies the thread settings (after the
fork, so no torch thread pool is ever copied). The zygote reaps its children and reports each
exit status; each child's pidfd goes to the daemon, which kills and watches it directly.

Only single-threaded state is forked: the zygote refuses (``fork_failed``) when it runs more
than one native thread, and it never touches CUDA (the daemon exec's GPU workers). Like a
worker it ignores SIGINT, SIGTERM and SIGHUP sent to the process group (the daemon stops the
workers in order). SIGUSR1, the daemon's "give up" at a stop during the start, ends it while it
imports (it has forked nothing yet) and is ignored after. When the daemon closes its end, the
zygote leaves; the workers it forked keep their own pipes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import socket
import sys
import time
import traceback

from eagle3d.remote import hf_protocol as pr

_BLAS = "OPENBLAS_NUM_THREADS"
ABANDON = signal.SIGUSR1  # default action: the process ends


def tasks() -> int:
    """This process's native threads."""
    return len(os.listdir("/proc/self/task"))


def send(sock: socket.socket, msg: pr.FromZygote, fds: list[int] | None = None) -> None:
    with contextlib.suppress(OSError):  # the daemon is gone: its EOF ends the loop
        socket.send_fds(sock, [pr.encode(msg)], fds or [])


def preload(model: str) -> None:
    """What a worker imports before it loads the model, and the model's own module."""
    import torch  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401
    from transformers.utils import logging  # noqa: F401

    from eagle3d.remote import dumpfile, hf_worker  # noqa: F401

    if model:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        # The architecture's modeling module (modeling_llama, ...): a worker would import it
        # in from_pretrained. A model it cannot read is the worker's to report.
        with contextlib.suppress(Exception):
            MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(model))]


def set_title(words: list[str]) -> None:
    """Show ``words`` as this process's command line (``ps``, psutil): a forked worker reads
    as a worker, not as the zygote. Written over the original argv area as setproctitle(3)
    does (one string, then NULs, and a last byte that is not: the kernel then shows the
    string alone, and psutil splits it at its spaces), truncated to fit."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48, 49)
        title = " ".join(words).encode()[: end - start - 2]
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(title.ljust(end - start - 1, b"\0") + b" ")


def child(sock: socket.socket, fds: list[int], flags: list[str], pidfds: list[int]) -> None:
    """The forked worker: never returns."""
    code = 1
    try:
        sock.close()
        for fd in pidfds:
            os.close(fd)
        os.dup2(fds[0], 0)
        os.dup2(fds[1], 1)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if os.environ.get("EAGLE3D_ZYGOTE_BLAS") == "1":  # ours, not the user's: drop it
            os.environ.pop(_BLAS, None)
        os.environ.pop("EAGLE3D_ZYGOTE_BLAS", None)
        set_title([sys.executable, "-m", "eagle3d.remote.hf_worker", *flags])
        from eagle3d.remote import hf_worker

        code = hf_worker.main(flags)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(code)


def serve(sock: socket.socket) -> int:
    """Fork on request, reap and report, until the daemon closes its end."""
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    children: dict[int, tuple[int, int]] = {}  # pidfd -> (id, pid)
    by_id: dict[int, int] = {}  # id -> pid, until reaped
    while True:
        for fd, event in poll.poll():
            if fd == sock.fileno() and event & (select.POLLHUP | select.POLLERR):
                # The daemon is gone (killed): forks it asked for and never got to read
                # would only load the model for nobody.
                return 0
            if fd != sock.fileno():
                ident, pid = children.pop(fd)
                poll.unregister(fd)
                _, status = os.waitpid(pid, 0)
                os.close(fd)
                by_id.pop(ident, None)
                send(sock, pr.Exited(ident, pid, os.waitstatus_to_exitcode(status)))
                continue
            try:
                data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 4)
            except ConnectionResetError:  # the daemon left with our reports unread
                return 0
            if not data:
                return 0
            msg = pr.to_zygote(data)
            if isinstance(msg, pr.Kill):
                if msg.id in by_id:  # not reaped yet: the pid is still this child's
                    os.kill(by_id[msg.id], signal.SIGKILL)
                continue
            try:
                running = tasks()
                if running != 1 or len(fds) != 2:
                    why = f"the zygote runs {running} threads" if running != 1 else "no pipes"
                    send(sock, pr.ForkFailed(msg.id, "ForkUnsafe", why))
                    continue
                pid = os.fork()
                if pid == 0:
                    child(sock, fds, msg.flags, list(children))
                pidfd = os.pidfd_open(pid)
            finally:
                for f in fds:
                    os.close(f)
            children[pidfd] = (msg.id, pid)
            by_id[msg.id] = pid
            poll.register(pidfd, select.POLLIN)
            send(sock, pr.Forked(msg.id, pid), [pidfd])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eagle3d-hf-zygote")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--model", default="")
    p.add_argument("shown", nargs="*", help="a worker's flags: room for its title (unused)")
    args = p.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    if _BLAS not in os.environ:
        # numpy's OpenBLAS starts a thread pool when loaded; one thread is none, so the zygote
        # stays single-threaded. The children drop the setting (it is read at load only).
        os.environ[_BLAS] = "1"
        os.environ["EAGLE3D_ZYGOTE_BLAS"] = "1"
    t0 = time.perf_counter()
    try:
        preload(args.model)
    except Exception as e:
        send(sock, pr.ImportFailed(type(e).__name__, str(e)))
        return 1
    signal.signal(ABANDON, signal.SIG_IGN)  # from now on, children may exist
    send(sock, pr.Hello(os.getpid(), time.perf_counter() - t0, tasks()))
    return serve(sock)


if __name__ == "__main__":
    os._exit(main())
