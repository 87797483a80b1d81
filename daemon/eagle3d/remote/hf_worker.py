"""Hugging Face worker process: ``python -m eagle3d.remote.hf_worker --model DIR ...``.

Reads request frames on stdin, runs the model in token-budget batches (nearby samples sorted
by length to limit padding, :mod:`eagle3d.remote.hf_batching`; padding is never stored),
writes one dump per request into the dump directory through :mod:`eagle3d.remote.dumpfile`,
and reports on stdout (:mod:`eagle3d.remote.hf_protocol`). It runs in its own process so
that a crash here is survivable by the daemon.

Requests land in ``pending`` as they are read, on the reader thread, even while a forward
runs: a ``give`` is answered at once, so an idle worker can take over another's waiting
requests without waiting for the other's batch to end (see ``HFProducer._balance``).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any

from eagle3proto.wire import FrameBuffer

from eagle3d.remote import faults, storedtype
from eagle3d.remote import hf_protocol as pr
from eagle3d.remote.dumpfile import default_aux_layers
from eagle3d.remote.hf_batching import batch_budget, next_batch, tune_malloc
from eagle3d.remote.hostcopy import HostCopy
from eagle3d.remote.threadnames import name_threads

_out_lock = threading.Lock()
_WRITTEN = object()  # marks the end of a batch in the writer's queue


def send(msg: pr.FromWorker) -> None:
    """Write one frame to the daemon; if the daemon is gone, end the process at once."""
    data = pr.frame(msg)
    with _out_lock:
        try:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        except (BrokenPipeError, ValueError):
            # The daemon died (kill -9, crash): nobody will read our reports and its
            # successor cleans the dump directory, so there is nothing left worth finishing.
            _exit(1, "eagle3d-hf-worker: the daemon closed its end of the pipe; exiting")


def _exit(code: int, message: str = "") -> None:
    """End the process without interpreter finalization.

    Tearing the interpreter down while torch's native threads (intra-op pool, the dump
    writer inside ``torch.save``) are still alive can abort the process in C++ static
    destructors ("terminate called without an active exception", SIGABRT) after all the
    work is done. On a normal end every result has been reported and the dump writer joined
    before we get here; on a lost daemon a dump cut off mid-write keeps its temporary name
    (dumps are renamed into place), so it is never taken for a complete one.
    """
    if message:
        print(message, file=sys.stderr)
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os._exit(code)


class Capture:
    """Forward pre-hooks that keep the states entering the aux layers (no full hidden list)."""

    def __init__(self, model: Any, layers: list[int]) -> None:
        self.layers = layers
        self.states: dict[int, Any] = {}
        self._handles = []
        decoder_layers = model.model.layers
        for i in sorted(set(layers)):
            if i >= len(decoder_layers):
                raise ValueError(f"aux layer {i} >= number of layers {len(decoder_layers)}")
            self._handles.append(
                decoder_layers[i].register_forward_pre_hook(self._hook(i), with_kwargs=True)
            )

    def _hook(self, i: int) -> Any:
        def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.states[i] = args[0] if args else kwargs["hidden_states"]

        return hook


class Worker:
    def __init__(self, args: argparse.Namespace, malloc: str = "") -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        self.malloc = malloc  # what tune_malloc applied, for the ready message

        # A progress bar is noise in a service log (the journal keeps every redraw).
        hf_logging.disable_progress_bar()

        self.torch = torch
        self.dump_dir = args.dump_dir
        self.budget = args.batch_tokens
        if args.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        else:
            self.device = args.device
        if args.dtype == "auto":
            dtype = torch.float32 if self.device == "cpu" else torch.bfloat16
        else:
            dtype = getattr(torch, args.dtype)
        # The states leave in the job's storage dtype: cast on the device before the copy to
        # the host on a GPU (half the bytes over PCIe), in the dump writer on a CPU (no cast
        # of the padding); either way the dump carries half the bytes of float32.
        self.store = storedtype.get(args.store_dtype) if args.store_dtype else None
        slow = faults.armed("worker_slow_load")
        if slow is not None:
            time.sleep(slow.n / 1000)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        model.eval().to(self.device)
        self.model = model
        n_layers = model.config.num_hidden_layers
        self.layers = args.aux_layers or default_aux_layers(n_layers)
        self.capture = Capture(model, self.layers)
        self.pad_id = 0
        self.pending: dict[str, list[int]] = {}
        self.alone: set[str] = set()  # pending requests to compute in a batch of their own
        # Guards ``pending`` and ``closed``; the main loop waits on it for requests.
        self.cond = threading.Condition()
        self.closed = False  # stdin closed or "stop": finish the running batch and exit
        self.writes: queue.Queue[tuple[Any, ...] | None] = queue.Queue(maxsize=256)
        self.host = HostCopy(self.device)
        self.stored_dtype = getattr(torch, self.store.torch_dtype) if self.store else None
        self.batches = 0
        self.dumps = 0
        send(
            pr.Ready(
                pid=os.getpid(),
                device=self.device,
                dtype=str(dtype).removeprefix("torch."),
                store_dtype=self.store.name if self.store else "",
                layers=self.layers,
                num_layers=n_layers,
                hidden=model.config.hidden_size,
                threads=torch.get_num_threads(),
                malloc=self.malloc,
            )
        )

    def read_stdin(self) -> None:
        frames = FrameBuffer()
        fd = sys.stdin.fileno()
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.receive(pr.Stop())
                return
            for payload in frames.feed(chunk):
                self.receive(pr.to_worker(payload))

    def receive(self, msg: pr.ToWorker) -> None:
        """Apply one message from the daemon to ``pending`` (reader thread)."""
        given: list[str] | None = None
        with self.cond:
            if self.closed:
                return
            if isinstance(msg, pr.Req):
                self.pending[msg.rid] = msg.ids
                if msg.alone:
                    self.alone.add(msg.rid)
            elif isinstance(msg, pr.Cancel):
                self.pending.pop(msg.rid, None)
            elif isinstance(msg, pr.Give):
                given = [r for r in msg.rids if self.pending.pop(r, None) is not None]
            else:
                self.closed = True
            self.cond.notify()
        if given is not None:
            send(pr.Given(given))

    def write_loop(self) -> None:
        from eagle3d.remote import dumpfile as dump

        while True:
            item = self.writes.get()
            if item is None:
                return
            if item[0] is _WRITTEN:  # the batch's dumps are all out: say so, once per batch
                send(pr.Written(item[1]))
                continue
            rid, ids, aux, hid, scales, pending, row = item
            pending.wait()  # the batch's copy to the host (at once on a CPU device)
            # None: checked by the dump writer (a CPU device, where the states are anyway).
            finite = None if row is None else bool(row[0].wait()[0][row[1]])
            if self.store is not None and scales is None and aux.dtype != self.stored_dtype:
                (aux, aux_s), (hid, hid_s) = (
                    storedtype.to_stored(x, self.store) for x in (aux, hid)
                )
                scales = None if aux_s is None or hid_s is None else (aux_s, hid_s)
            self.dumps += 1
            fault = faults.hit("bad_dump")
            if fault is not None:
                ids, aux, hid = self._corrupt(fault.arg, ids, aux, hid)
            # A producer set up for another capture (one layer fewer, as an SGLang server
            # launched without the job's layer arguments) for the "layers" fault.
            layers = self.layers[:-1] if fault is not None and fault.arg == "layers" else None
            finite = None if fault is not None else finite
            try:
                path = self._write(dump, rid, ids, aux, hid, scales, layers, finite)
            except OSError as e:
                # A full or vanished dump area must not kill this thread: the worker would
                # go on computing batches nobody receives until its queue blocked it.
                # The daemon retries the request (and records it failed if this persists).
                err = errno.errorcode.get(e.errno or 0, "OSError")
                send(
                    pr.Fail(
                        rid, "DumpWriteError", f"writing the dump failed: {err}: {e.strerror or e}"
                    )
                )
                continue
            if fault is not None and fault.arg == "truncate":
                os.truncate(path, os.path.getsize(path) // 2)
            elif fault is not None and fault.arg == "vanish":
                os.unlink(path)

    def _write(
        self,
        dump: Any,
        rid: str,
        ids: Any,
        aux: Any,
        hid: Any,
        scales: Any,
        layers: Any,
        finite: bool | None,
    ) -> str:
        layers = self.layers if layers is None else layers
        args = (self.dump_dir, rid, ids, aux, hid, layers, scales)
        try:
            return str(dump.write_dump(*args, finite=finite))
        except FileNotFoundError:
            # The dump area was removed under us (a /dev/shm cleanup): make it again, once.
            os.makedirs(self.dump_dir, 0o700, exist_ok=True)  # the daemon's alone, as it was
            return str(dump.write_dump(*args, finite=finite))

    def _corrupt(self, how: str, ids: Any, aux: Any, hid: Any) -> tuple[Any, Any, Any]:
        if how == "ids":
            ids = ids.clone()
            ids[0] += 1
        elif how == "shape":
            aux = aux[:-1]
        elif how == "layers":  # the states of one layer fewer
            aux = aux[..., : aux.shape[-1] - aux.shape[-1] // len(self.layers)].contiguous()
        elif how == "nan":
            hid = hid.clone()
            hid[0, 0] = float("nan")
        return ids, aux, hid

    def next_rids(self, linger: float = 0.02) -> tuple[list[str], list[list[int]]] | None:
        """Wait for requests and take the next batch out of ``pending``; None once closed.

        A batch that is not full waits ``linger`` seconds for more: the daemon sends a window
        of requests at once, and without this the first batch (and any batch started
        mid-burst) would hold whatever one pipe read happened to deliver.
        """
        with self.cond:
            waited = False
            while True:
                while not self.pending and not self.closed:
                    if not waited:  # the producer's hang clock stops: this loop is alive
                        send(pr.Idle())
                    self.cond.wait()
                    waited = True
                # Only a worker that had to wait for work lingers: one that just finished a
                # batch has had the daemon's refill for the whole forward, and lingering then
                # (at the end of the dataset, where nothing more comes) only idled it.
                deadline = time.monotonic() + (linger if waited else 0.0)
                while not self.closed and sum(map(len, self.pending.values())) < self.budget:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self.cond.wait(left)
                if self.closed:
                    return None
                if self.pending:  # else a "give" took them all meanwhile
                    break
            self.alone &= self.pending.keys()  # cancelled or given away meanwhile
            if self.alone:
                rid = next(r for r in self.pending if r in self.alone)
                self.alone.discard(rid)
                return [rid], [self.pending.pop(rid)]
            lengths = {rid: len(ids) for rid, ids in self.pending.items()}
            rids = next_batch(lengths, batch_budget(sum(lengths.values()), self.budget))
            return rids, [self.pending.pop(r) for r in rids]

    def run(self) -> None:
        threading.Thread(target=self.read_stdin, name="reader", daemon=True).start()
        writer = threading.Thread(target=self.write_loop, name="dump-writer", daemon=True)
        writer.start()
        name_threads()
        while (batch := self.next_rids()) is not None:
            self.run_batch(*batch)
        self.writes.put(None)
        writer.join()

    def run_batch(self, rids: list[str], seqs: list[list[int]]) -> None:
        # Said before the forward, so the daemon sends replacements while this batch runs
        # and the next batch is chosen from a full window, as in the bare loop.
        send(pr.Start(rids))
        self.forward_split(rids, seqs)
        slow = faults.armed("worker_slow")
        if slow is not None:
            time.sleep(slow.n / 1000)
        if faults.hit("worker_exit") is not None:
            os._exit(3)
        if faults.hit("worker_hang") is not None:
            while True:
                time.sleep(3600)

    def forward_split(self, rids: list[str], seqs: list[list[int]]) -> None:
        """Run the batch; out of memory (host or device), run each half of it instead. A
        sample that does not fit even alone fails with ``OutOfMemory`` (its own attempt:
        the one-sample run proves it); no other sample of the batch is charged."""
        try:
            self.forward(rids, seqs)
            return
        except MemoryError as e:
            error: BaseException = e
        except RuntimeError as e:  # torch's OutOfMemoryError (CUDA, MPS) is one
            if not is_oom(e):
                raise
            error = e
        self.capture.states.clear()
        free_memory(self.torch)
        if len(rids) == 1:
            tokens = len(seqs[0])
            why = f"out of memory with this sample alone ({tokens} tokens): {type(error).__name__}"
            send(pr.Fail(rids[0], "OutOfMemory", why))
            return
        half = len(rids) // 2
        self.forward_split(rids[:half], seqs[:half])
        self.forward_split(rids[half:], seqs[half:])

    def forward(self, rids: list[str], seqs: list[list[int]]) -> None:
        torch = self.torch
        t0 = time.perf_counter()
        longest = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), longest), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
        ids_host = ids
        ids = ids.to(self.device)
        mask = mask.to(self.device)
        with torch.inference_mode():
            faults.allocate_for(int(mask.sum()))
            faults.crash_in_forward(longest)
            out = self.model.model(input_ids=ids, attention_mask=mask, use_cache=False)
        final = out.last_hidden_state
        aux = torch.cat([self.capture.states[i] for i in self.layers], dim=-1)
        self.capture.states.clear()
        checked = None
        parts = [final, aux]
        if final.device.type != "cpu":
            # In the stored format on the device (the daemon only moves the bytes), and
            # checked finite there as stored (the dump writer never passes over them).
            (final, hid_s, ok_f), (aux, aux_s, ok_a) = (
                storedtype.to_stored_checked(x, self.store) for x in parts
            )
            checked = self.host.start([finite_rows(ok_f & ok_a, mask)])
            parts = [final, aux, *(x for x in (hid_s, aux_s) if x is not None)]
        pending = self.host.start(parts)  # queued behind the forward; the writer waits
        final_cpu, aux_cpu, *scale_cpu = pending.tensors
        for i, (rid, s) in enumerate(zip(rids, seqs, strict=True)):
            n = len(s)  # cut to the real length: padding is never stored
            sc = (scale_cpu[1][i, :n], scale_cpu[0][i, :n]) if scale_cpu else None
            row = (checked, i) if checked is not None else None
            self.writes.put(
                (rid, ids_host[i, :n], aux_cpu[i, :n], final_cpu[i, :n], sc, pending, row)
            )
        self.batches += 1
        send(
            pr.Done(rids, sum(len(s) for s in seqs), len(seqs) * longest, time.perf_counter() - t0)
        )
        # Queued only once "done" is sent: the daemon counts a batch's dumps as owed from its
        # "done", so a "written" ahead of it (the writer is quick on a CPU device) would leave
        # them owed for ever.
        self.writes.put((_WRITTEN, rids, None, None, None, None, None))


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` is an allocation failure (torch's OutOfMemoryError, on any device)."""
    return type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower()


def free_memory(torch: Any) -> None:
    """Give back what a failed forward held, before the smaller batches run."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eagle3d-hf-worker")
    p.add_argument("--model", required=True)
    p.add_argument("--dump-dir", required=True)
    p.add_argument("--aux-layers", type=lambda s: [int(x) for x in s.split(",") if x], default=[])
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--store-dtype", default="", choices=("", *storedtype.FORMATS))
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    # A terminal's Ctrl-C, and SIGTERM or SIGHUP sent to the whole process group (scancel,
    # kill -- -PGID, a container stop), are the daemon's to act on: it stops this worker in
    # order ("stop" on stdin) once the batches in flight are done. SIGKILL still ends it.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    malloc = tune_malloc()  # before the model loads: its blocks follow the new rule too
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        worker = Worker(args, malloc)
    except Exception as e:
        send(pr.LoadFailed(type(e).__name__, str(e)))
        return 1
    try:
        worker.run()
    except MemoryError:
        # Outside a forward (those split their batch): the host's memory, not a sample's
        # fault. The daemon resends what this worker held without charging an attempt.
        traceback.print_exc()
        return pr.EXIT_OUT_OF_MEMORY
    except Exception:
        # Reported in the daemon's log (it inherits our stderr); the daemon sees the exit
        # code, resends this worker's in-flight requests and starts a new worker.
        traceback.print_exc()
        return 1
    with contextlib.suppress(BrokenPipeError, ValueError):
        sys.stdout.flush()
    return 0


def finite_rows(ok: Any, mask: Any) -> Any:
    """Per sample of a padded batch (``[B, T]`` per-token finiteness from
    :func:`eagle3d.remote.storedtype.to_stored_checked`, ``[B, T]`` attention mask), on the
    states' device: whether its real tokens' states are all finite (the padding's are never
    stored, so never checked)."""
    return (ok | (mask == 0)).all(-1)


if __name__ == "__main__":
    _exit(main())
