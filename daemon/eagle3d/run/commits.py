"""The commit scheduler: dumps in, typed outcomes out, on a pool of commit threads.

The loop thread queues each dumped sample's frozen snapshot (:meth:`Commits.submit`, the
ledger's ``Commit`` effect: a :class:`~eagle3d.core.sample.CommitJob`, never the ledger's own
sample, which the loop thread goes on changing). An idle thread takes its share of what is queued, up to :data:`COMMIT_BATCH`, and
:func:`commit_batch` validates, writes, syncs and journals it, with one directory sync, one
journal sync and one wakeup of the loop for all of it instead of one of each per sample: on
a CPU producer every wakeup and syscall here is taken from the forward beside it. While the
threads are busy the queue fills, so batches grow with the load and stay single samples
when the daemon keeps up. The outcomes go back through the inbox
(:class:`~eagle3d.core.messages.Committed`, keyed by request id); nothing else crosses back.
"""

from __future__ import annotations

import errno
import logging
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from eagle3proto import events as ev
from eagle3proto.paths import sample_relpath

from eagle3d.core import outcome as oc
from eagle3d.core.envfault import env_errno
from eagle3d.core.sample import CommitJob
from eagle3d.dumps.format import BadDump, ContractBroken, DumpVanished
from eagle3d.remote import faults
from eagle3d.run.diskguard import OutputIdentity
from eagle3d.run.inbox import Committed
from eagle3d.run.reaper import Reaper
from eagle3d.run.recorder import Recorder
from eagle3d.store.committer import CommitError, Committer

log = logging.getLogger("eagle3d")

COMMIT_BATCH = 8  # samples a commit thread takes at once


def commit_batch(
    batch: list[CommitJob],
    committer: Committer,
    recorder: Recorder,
    identity: OutputIdentity,
    hidden_size: int,
    layers: list[int],
    reaper: Reaper,
) -> list[oc.AnyOutcome]:
    """A commit thread's work: validate, write and journal ``batch``, then hand the saved
    samples' dumps to ``reaper``; one outcome per sample, in order. Never raises: a bug is
    an :class:`~eagle3d.core.outcome.Internal`."""
    gone = recorder.lost or identity.check()
    if gone:  # never commit into a directory nobody sees, nor make one again
        return [oc.OutputGone(gone)] * len(batch)
    out: list[oc.AnyOutcome] = [oc.Internal("not committed")] * len(batch)
    try:
        written = committer.commit_files(
            [(p.idx, p.input_ids, p.loss_mask, p.dump_path) for p in batch], hidden_size, layers
        )
        saved: list[tuple[int, ev.SampleSaved]] = []
        for k, (p, done) in enumerate(zip(batch, written, strict=True)):
            if isinstance(done, DumpVanished):
                out[k] = oc.DumpLost(str(done))
            elif isinstance(done, ContractBroken):
                out[k] = oc.ContractBroken(f"{done} (dump {p.dump_path})")
            elif isinstance(done, BadDump):
                out[k] = oc.BadDump(str(done))
            elif isinstance(done, CommitError):
                out[k] = _write_error(p, done, committer.output, identity)
            else:
                faults.kill_point("before_journal_append")
                rec = ev.SampleSaved(
                    idx=p.idx,
                    path=done.relpath,
                    bytes=done.nbytes,
                    tokens=len(p.input_ids),
                    checksum=done.checksum,
                    truncated=p.truncated,
                    original_tokens=p.full_length if p.truncated else 0,
                    original_estimated=p.truncated and p.length_estimated,
                )
                saved.append((k, rec))
        if saved and not recorder.append_many([rec for _, rec in saved]):
            # Unrecorded files would be samples the journal does not know of: taken back.
            committer.withdraw([rec.path for _, rec in saved])
            for k, _ in saved:
                out[k] = oc.NotRecorded("the journal refused the sample_saved record")
            return out
        for k, rec in saved:
            out[k] = oc.Saved(rec.path, rec.bytes, rec.checksum)
        # Journaled, so removable: off this thread (a dump left by a crash is an orphan).
        if saved:
            faults.kill_point("before_dump_removal")
        reaper.remove([(batch[k].dump_path, batch[k].dump_bytes) for k, _ in saved])
    except Exception as e:  # a bug must not wedge the samples forever
        log.exception("commit of samples %s failed", [p.idx for p in batch])
        why = f"{type(e).__name__}: {e}"
        return [r if isinstance(r, oc.Saved) else oc.Internal(why) for r in out]
    return out


def _write_error(
    p: CommitJob, e: CommitError, output: str, identity: OutputIdentity
) -> oc.AnyOutcome:
    message = f"CommitError: {e}"
    gone = identity.check()  # a row folder removed, replaced or a link: the run stops
    if gone:
        return oc.OutputGone(gone)
    if env_errno(e.errno):  # the environment's, never the sample's: pause, then commit again
        where = os.path.dirname(os.path.join(output, sample_relpath(p.idx)))
        return oc.WriteRefused(e.errno or 0, where, message)
    if e.errno == errno.ENOENT:
        # A directory vanished under the commit, yet the identity holds: opened again.
        return oc.DirGone(message)
    return oc.WriteFailed(message)


class Commits:
    """Queues samples for the commit threads; ``post`` hands each batch's outcomes back."""

    def __init__(
        self,
        body: Callable[[list[CommitJob]], list[oc.AnyOutcome]],
        post: Callable[[Committed], None],
        threads: int,
        committer: Committer,
    ) -> None:
        self.body = body
        self.post = post
        self.threads = threads
        self.committer = committer
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="commit")
        self.queue: deque[CommitJob] = deque()
        self.busy = 0  # batches running on commit threads
        self.closed = False

    def submit(self, job: CommitJob, forget_dirs: bool = False) -> None:
        if forget_dirs:
            self.committer.forget_dirs()
        self.queue.append(job)
        self.start()

    def start(self) -> None:
        """Hand queued samples to idle threads, each its share (up to COMMIT_BATCH)."""
        while self.queue and self.busy < self.threads and not self.closed:
            free = self.threads - self.busy
            take = min(COMMIT_BATCH, -(-len(self.queue) // free))
            batch = [self.queue.popleft() for _ in range(take)]
            self.busy += 1
            self.pool.submit(self._run, batch)

    def batch_done(self) -> None:
        """A batch's outcomes reached the loop: its thread is free."""
        self.busy -= 1
        self.start()

    def _run(self, batch: list[CommitJob]) -> None:
        results: list[oc.AnyOutcome] = [oc.Internal("the commit thread failed")] * len(batch)
        try:
            results = self.body(batch)
        finally:  # always answered, or the samples would wait for ever
            self.post(Committed({j.rid: r for j, r in zip(batch, results, strict=True)}))

    def close(self) -> None:
        """What is still queued is redone on resume; what runs is finished first."""
        self.closed = True
        self.pool.shutdown(wait=True)
