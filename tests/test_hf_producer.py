"""The HF producer's worker layout and dispatch.

How many workers and torch threads each (automatic: one per GPU, or one single-threaded
worker per core on a CPU within memory), which device each gets (round-robin over the GPUs),
and which worker a request goes to (the one with the fewest tokens outstanding).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import psutil
import runkit
from eagle3d.core.sample import Request
from eagle3d.produce.base import DUMP_GRACE_S
from eagle3d.produce.hf import HFProducer
from eagle3d.produce.hf_layout import (
    CPU_BATCH_TOKENS,
    GPU_BATCH_TOKENS,
    model_weight_bytes,
    token_budget,
    usable_cpus,
    visible_gpus,
    worker_device,
    worker_layout,
)
from eagle3d.produce.hf_workers import Worker as _Worker
from eagle3d.remote import hf_protocol as pr

GiB = 1 << 30


def test_cpu_layout_is_one_single_threaded_worker_per_core_up_to_8() -> None:
    def cpu(cpus: int) -> tuple[int, int]:
        return worker_layout(0, 0, gpus=0, cpus=cpus, model_bytes=GiB, mem_available=512 * GiB)

    assert [cpu(n) for n in (1, 2, 4, 8, 16, 64)] == [
        (1, 1),
        (2, 1),
        (4, 1),
        (8, 1),
        (8, 2),
        (8, 8),
    ]


def test_cpu_workers_are_bounded_by_memory() -> None:
    # Each copy is counted four times its weights (an fp32 upcast, then activations),
    # against all of the available memory: 16 GiB holds two copies of a 2 GiB model.
    assert worker_layout(0, 0, gpus=0, cpus=16, model_bytes=2 * GiB, mem_available=16 * GiB) == (
        2,
        8,
    )
    # Too big for even one copy by that count: still one worker (loading will tell).
    assert worker_layout(0, 0, gpus=0, cpus=4, model_bytes=64 * GiB, mem_available=GiB) == (1, 4)


def test_gpu_layout_is_one_worker_per_gpu() -> None:
    assert worker_layout(0, 0, gpus=8, cpus=64, model_bytes=GiB, mem_available=GiB) == (8, 8)
    assert worker_layout(0, 0, gpus=1, cpus=16, model_bytes=GiB, mem_available=GiB) == (1, 16)


def test_explicit_settings_win() -> None:
    assert worker_layout(3, 0, gpus=0, cpus=2, model_bytes=GiB, mem_available=GiB) == (3, 1)
    assert worker_layout(1, 0, gpus=0, cpus=2, model_bytes=0, mem_available=GiB) == (1, 2)
    assert worker_layout(0, 4, gpus=2, cpus=2, model_bytes=0, mem_available=GiB) == (2, 4)
    assert worker_layout(2, 2, gpus=0, cpus=16, model_bytes=0, mem_available=GiB) == (2, 2)


def test_model_weight_bytes_counts_weight_files_only(tmp_path: Path) -> None:
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x" * 500)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}" * 100)
    assert model_weight_bytes(str(tmp_path)) == 1500
    assert model_weight_bytes(str(tmp_path / "missing")) == 0


def test_cuda_workers_spread_round_robin_over_the_gpus() -> None:
    assert [worker_device("cuda", slot, 4) for slot in range(6)] == [
        "cuda:0",
        "cuda:1",
        "cuda:2",
        "cuda:3",
        "cuda:0",
        "cuda:1",
    ]
    assert [worker_device("auto", slot, 2) for slot in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]


def test_without_gpus_or_on_the_cpu_the_setting_passes_through() -> None:
    assert worker_device("auto", 3, 0) == "auto"  # the worker falls back to the CPU itself
    assert worker_device("cpu", 1, 8) == "cpu"  # asked for the CPU on a GPU node
    assert worker_device("cuda", 0, 0) == "cuda"  # the worker then fails with torch's message


def test_the_batch_budget_is_small_on_a_cpu_and_large_on_a_gpu_unless_given() -> None:
    assert CPU_BATCH_TOKENS < GPU_BATCH_TOKENS
    assert token_budget(0, "auto", 0) == CPU_BATCH_TOKENS  # no GPU: the worker takes the CPU
    assert token_budget(0, "cpu", 8) == CPU_BATCH_TOKENS  # asked for the CPU on a GPU node
    assert token_budget(0, "auto", 2) == GPU_BATCH_TOKENS
    assert token_budget(0, "cuda", 1) == GPU_BATCH_TOKENS
    assert token_budget(3000, "cpu", 0) == 3000  # --batch-tokens wins on either
    assert token_budget(3000, "cuda", 1) == 3000


def test_a_cpu_job_or_a_cpu_only_machine_sees_no_gpu() -> None:
    assert visible_gpus("cpu") == 0
    import torch

    if not torch.cuda.is_available():  # this machine (CI): the CPU wheel of torch
        assert visible_gpus("auto") == 0
    else:  # a GPU node: what torch sees
        assert visible_gpus("auto") == torch.cuda.device_count()


class _Pipe:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.frames.append(data)


class _Proc:
    def __init__(self) -> None:
        self.stdin = _Pipe()


def _live_workers(n: int) -> list[_Worker]:
    """``n`` workers that are up, with fake pipes (call inside a running loop)."""
    loop = asyncio.get_running_loop()
    ws = []
    for slot in range(n):
        w = _Worker(slot, _Proc())
        w.ready = loop.create_future()
        w.ready.set_result({})
        ws.append(w)
    return ws


def test_a_request_goes_to_the_worker_with_the_fewest_tokens_outstanding() -> None:
    async def scenario() -> list[int]:
        p = HFProducer("m", dump_dir="/nonexistent", workers=2)
        ws = _live_workers(2)
        p._workers = list(ws)
        # Worker 0 is running one 100-token request; worker 1 has three of 10 tokens waiting.
        ws[0].inflight = {"a": 100}
        ws[1].inflight = {f"b{i}": 10 for i in range(3)}
        chosen = []
        for i in range(5):
            p.submit(Request(rid=f"n{i}", idx=i, input_ids=[1] * 20))
            chosen.append(0 if f"n{i}" in ws[0].inflight else 1)
        p._on_message(ws[0], _msg({"op": "done", "rids": ["a"], "secs": 0.1}))
        assert "a" not in ws[0].inflight  # a finished request no longer counts
        return chosen

    # Worker 1 takes 20-token requests until it has more outstanding than worker 0's 100
    # (30, 50, 70, 90, then 110); counting requests would have sent the first to worker 0.
    assert asyncio.run(scenario()) == [1, 1, 1, 1, 0]


class _Events:
    def __init__(self) -> None:
        self.failed: list[tuple[str, str, bool]] = []

    def request_failed(self, rid: str, error: str, message: str, retryable: bool) -> None:
        self.failed.append((rid, error, retryable))

    def producer_state(self, state: str, message: str = "") -> None:
        pass

    def requests_started(self, rids: list[str]) -> None:
        pass


def test_a_written_dump_the_daemon_never_saw_is_retried_after_the_grace() -> None:
    p = HFProducer("m", dump_dir="/nonexistent", workers=1)
    events = _Events()
    p._events = events
    w = _Worker(0, _Proc())
    p.dump_arrived("early")  # seen before its batch's "written" (the usual order)
    p._on_message(w, _msg({"op": "written", "rids": ["early", "seen", "lost"]}))
    p.dump_arrived("seen")  # seen after it
    assert p._grace.awaiting == ["lost"] and not p._grace.arrived_early
    t = time.monotonic()
    p._missing_dumps(t + DUMP_GRACE_S / 2)
    assert events.failed == []  # within the grace: nothing yet
    p._missing_dumps(t + DUMP_GRACE_S + 1)
    assert events.failed == [("lost", "DumpMissing", True)]
    p._missing_dumps(t + 2 * DUMP_GRACE_S)
    assert len(events.failed) == 1  # once


def test_a_default_cpu_run_starts_the_automatic_layout(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    valid, malformed = runkit.dataset(data, 30)
    r = runkit.run(tiny_model_dir, data, out)
    assert r.returncode == 0, r.stderr[-3000:]
    runkit.assert_complete(out, valid, malformed)
    workers, threads = worker_layout(
        0,
        0,
        gpus=0,
        cpus=usable_cpus(),
        model_bytes=model_weight_bytes(str(tiny_model_dir)),
        mem_available=psutil.virtual_memory().available,
    )
    ups: list[Any] = [rec for rec in runkit.records(out, "producer") if rec["state"] == "up"]
    plural = "s" if threads > 1 else ""
    # The thread count in the message is what each worker's torch reported, not the request.
    assert ups and ups[0]["message"] == (
        f"{workers} worker(s) on cpu, {threads} thread{plural} each, batches of "
        f"{CPU_BATCH_TOKENS:,} tokens; malloc: mmap threshold 32 MiB, trim threshold 1 GiB"
    )
    health = [rec["producer"] for rec in runkit.records(out, "stats") if rec.get("producer")]
    assert health and health[-1]["detail"]["workers"] == workers


def _msg(d: dict[str, Any]) -> pr.FromWorker:
    """A worker's message, typed as the pipe's decoder gives it (a batch's token counts
    default to none)."""
    import msgspec

    if d["op"] == "done":
        d = {"tokens": 0, "padded": 0, **d}
    return msgspec.convert(d, pr.FromWorker)  # type: ignore[arg-type]


def _frames(w: _Worker) -> list[dict[str, Any]]:
    """The messages the producer wrote to a fake worker's stdin."""
    import msgspec
    from eagle3proto.wire import FrameBuffer

    pipe: Any = w.proc.stdin  # a _Pipe
    dec = msgspec.msgpack.Decoder(dict[str, Any])
    return [dec.decode(p) for p in FrameBuffer().feed(b"".join(pipe.frames))]


def test_an_idle_worker_takes_over_half_of_what_waits_at_a_busy_one() -> None:
    """At the end of the dataset nothing refills the workers: one that runs dry asks the
    busiest for the newest of its waiting requests (half its remaining work, the running
    batch counted half done); what comes back ("given": not started meanwhile) is
    resubmitted, to the idle worker."""

    async def scenario() -> None:
        p = HFProducer("m", dump_dir="/nonexistent", workers=2)
        p._events = _Events()
        ws = _live_workers(2)
        p._workers = list(ws)
        # Worker 1 gets a running batch of 100 tokens and six waiting requests of 50.
        p._workers = [ws[1]]
        for i in range(7):
            p.submit(Request(rid=f"r{i}", idx=i, input_ids=[1] * (100 if i == 0 else 50)))
        p._workers = list(ws)
        p._on_message(ws[1], _msg({"op": "start", "rids": ["r0"]}))
        p._on_message(ws[0], _msg({"op": "done", "rids": [], "secs": 0.1}))
        assert [m for m in _frames(ws[1]) if m["op"] == "give"] == []  # not yet: it may hang
        p._on_message(ws[0], _msg({"op": "idle"}))  # worker 0's loop waits for work
        asked = [m for m in _frames(ws[1]) if m["op"] == "give"]
        # Waiting 300 + running 100/2 = 350 left; half is 175: the newest four of 50 (200)
        # would pass it, so three go (150), newest first.
        assert asked == [{"op": "give", "rids": ["r6", "r5", "r4"]}]
        assert ws[1].asked
        p._on_message(ws[0], _msg({"op": "idle"}))
        assert len([m for m in _frames(ws[1]) if m["op"] == "give"]) == 1  # one at a time
        p.cancel("r5")  # the daemon gave up on one meanwhile
        # r4 had started at worker 1 by then: only r6 and r5 come back, and r5 is cancelled.
        p._on_message(ws[1], _msg({"op": "given", "rids": ["r6", "r5"]}))
        assert not ws[1].asked
        moved = [m["rid"] for m in _frames(ws[0]) if m["op"] == "req"]
        assert moved == ["r6"]
        assert "r6" not in ws[1].inflight and ws[0].inflight == {"r6": 50}
        assert p.health().detail["moved"] == 1.0
        # A worker with requests of its own waiting never asks.
        p._on_message(ws[1], _msg({"op": "done", "rids": ["r0"], "secs": 0.1}))
        p._on_message(ws[1], _msg({"op": "idle"}))
        assert [m for m in _frames(ws[0]) if m["op"] == "give"] == []

    asyncio.run(scenario())


def test_a_worker_owes_progress_for_work_sent_even_after_it_is_taken_away() -> None:
    """The daemon's request timeout (as long as the hang timeout) or an idle worker's "give"
    can take a hung worker's requests away; it must still count as hung, not as idle and
    fresh. Only progress, or the worker's own loop saying it waits for work, clears it."""

    async def scenario() -> None:
        p = HFProducer("m", dump_dir="/nonexistent", workers=2, hang_timeout=5.0)
        p._events = _Events()
        w, other = _live_workers(2)
        p._workers = [w]
        p.submit(Request(rid="a", idx=0, input_ids=[1] * 10))
        t = w.last_progress
        p.cancel("a")  # timed out at the daemon
        assert not w.inflight and p._hung(w, t + 6.0) and p.is_stuck(t + 6.0)
        p.submit(Request(rid="b", idx=1, input_ids=[1] * 10))  # no fresh clock for it
        assert w.last_progress == t and p._hung(w, t + 6.0)
        w.asked = True
        other.inflight = {"x": 1}  # busy, yet less than w: "b" goes there when given
        p._workers = [w, other]
        w.inflight["y"] = 100
        p._on_message(w, _msg({"op": "given", "rids": ["b"]}))  # taken by another: still owed
        assert "b" in other.inflight and "b" not in w.inflight
        p.cancel("y")
        p._workers = [w]
        assert p._hung(w, t + 6.0)
        p._on_message(w, _msg({"op": "idle"}))  # its loop is alive and waits: nothing owed
        assert not p._hung(w, time.monotonic() + 60.0)
        p.submit(Request(rid="c", idx=2, input_ids=[1] * 10))
        p._on_message(w, _msg({"op": "start", "rids": ["c"]}))  # progress: a fresh clock
        assert not p._hung(w, time.monotonic() + 1.0) and p._hung(w, time.monotonic() + 6.0)
        p._on_message(w, _msg({"op": "done", "rids": ["c"], "secs": 0.1}))
        assert not w.inflight and not p._hung(w, time.monotonic() + 60.0)  # idle is not hung

    asyncio.run(scenario())
