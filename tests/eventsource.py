"""A small real event source: the real JournalWriter + the real EventServer, fake work.

It stands in for ``eagle3d run`` where a test or a benchmark needs a daemon-shaped process
that emits records at a chosen rate: it takes the shard lock like the daemon, journals
``run_started``, then ``sample_sent``/``sample_dumped``/``sample_saved`` (and a
``sample_failed`` every ``--fail-every`` samples) plus ``stats`` every second, and serves
them on the socket. Run: ``python tests/eventsource.py --output DIR --total N --rate R``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import os
import signal
import socket
import sys

from eagle3d.serve.server import EventServer
from eagle3d.serve.telemetry import Telemetry
from eagle3proto import events as ev
from eagle3proto import paths, reducer
from eagle3proto.journal import JournalWriter


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--output", required=True)
    p.add_argument("--socket", default="")
    p.add_argument("--shard", default="0/1")
    p.add_argument("--total", type=int, default=100)
    p.add_argument("--rate", type=float, default=50.0, help="records per second")
    p.add_argument("--fail-every", type=int, default=0)
    p.add_argument("--bytes", type=int, default=1 << 20, help="bytes per saved sample")
    p.add_argument("--finish", action="store_true", help="journal run_finished at the end")
    p.add_argument("--stop-after", type=int, default=-1, help="exit hard after N samples")
    p.add_argument("--linger", type=float, default=3600.0, help="seconds to stay up after")
    p.add_argument("--no-server", action="store_true")
    p.add_argument("--dump-dir", action="store_true", help="report a dump area too")
    return p.parse_args(argv)


async def run(a: argparse.Namespace) -> int:
    shard = paths.Shard.parse(a.shard)
    output = os.path.abspath(a.output)
    os.makedirs(paths.state_dir(output), exist_ok=True)
    lock_fd = os.open(paths.lock_path(output, shard), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    loop = asyncio.get_running_loop()
    state = reducer.new_state()
    sock_path = a.socket or paths.default_socket_path(output, shard)
    server: EventServer | None = None

    def on_event(e: ev.Event) -> None:
        reducer.apply(state, e)
        if server is not None:
            server.publish(e)

    jdir = paths.journal_dir(output, shard)
    writer = JournalWriter(
        jdir,
        shard_index=shard.index,
        shard_count=shard.count,
        listener=lambda e: loop.call_soon_threadsafe(on_event, e),
    )
    writer.open(sink=lambda batch: reducer.apply_all(state, batch))
    if not a.no_server:
        server = EventServer(
            sock_path,
            journal_dir=jdir,
            snapshot=lambda: state,
            shard=shard,
            output=output,
            host=socket.gethostname(),
        )
        await server.start()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    writer.append(
        ev.RunStarted(
            job=ev.JobInfo(model="fake", dataset="fake.jsonl", output=output),
            total=a.total,
            pid=os.getpid(),
            host=socket.gethostname(),
            socket=sock_path if server else "",
        )
    )
    telemetry = Telemetry(output, os.path.join(output, "dumps") if a.dump_dir else None)
    print(f"ready {sock_path}", flush=True)
    per_sample = 3
    delay = per_sample / a.rate if a.rate > 0 else 0.0
    next_stats = loop.time()
    start = loop.time()
    done = 0
    idx = shard.index
    while done < a.total and not stop.is_set():
        if a.stop_after >= 0 and done >= a.stop_after:
            os._exit(9)  # die like a crashed daemon: no run_stopped, lock released by exit
        writer.append(ev.SampleSent(idx=idx, rid=f"r{idx}", tokens=100))
        writer.append(ev.SampleDumped(idx=idx, rid=f"r{idx}", bytes=a.bytes))
        if a.fail_every and (done + 1) % a.fail_every == 0:
            writer.append(ev.SampleFailed(idx=idx, error="ValueError", message="bad dump"))
        else:
            rel = paths.sample_relpath(idx)
            writer.append(
                ev.SampleSaved(idx=idx, path=rel, bytes=a.bytes, tokens=100, checksum="0")
            )
        done += 1
        idx += shard.count
        now = loop.time()
        if now >= next_stats:
            health = ev.ProducerHealth(name="fake", up=True, latency_s=0.01)
            writer.append(telemetry.sample(producer_health=health, inflight=1))
            next_stats = now + 1.0
        target = start + done * delay
        if target > now:
            await asyncio.sleep(target - now)
        elif done % 64 == 0:
            await asyncio.sleep(0)
    if done >= a.total and a.finish:
        writer.append(ev.RunFinished(saved=state.saved, failed=state.failed))
    elif stop.is_set():
        writer.append(ev.RunStopped(reason="signal"))
    writer.flush()
    if not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), a.linger)
    if server is not None:
        await server.close()
    writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(run(parse())))
