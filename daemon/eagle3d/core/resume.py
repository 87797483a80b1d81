"""What a replayed journal says is done, and what a finished run's numbers mean. Pure.

:class:`ResumeFold` folds replayed records into the per-sample status the ledger starts
from; :func:`finish_code` is the exit status of a finished shard; :func:`describe_counts`
and :func:`outcome_words` are how the daemon says where a shard stands.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import msgspec
from eagle3proto import events as ev
from eagle3proto import reducer, views

from eagle3d.core.envfault import recorded_failure_is_environment
from eagle3d.core.sample import FAILED, PENDING, SAVED
from eagle3d.exitcodes import EXIT_FAILED, EXIT_OK


def finish_code(saved: int, failed: int, total: int, max_failed_fraction: float) -> int:
    """The exit status of a finished shard: EXIT_FAILED when it had samples and every one
    failed, or more than ``max_failed_fraction`` of them did; else EXIT_OK."""
    if total <= 0 or failed == 0:
        return EXIT_OK
    if saved == 0 or views.too_many_failed(failed, total, max_failed_fraction):
        return EXIT_FAILED
    return EXIT_OK


def describe_counts(saved: int, failed: int, total: int) -> str:
    """``saved 0 / 218 (0 %), 218 failed``: percentages are saved of total, never failed."""
    pct = 100.0 * saved / total if total > 0 else 100.0
    shown = f"{pct:.0f}" if pct in (0.0, 100.0) or pct >= 10 else f"{pct:.1f}"
    return f"saved {saved} / {total} ({shown} %), {failed} failed"


def outcome_words(code: int, failed: int, total: int, max_failed_fraction: float) -> str:
    """Why a finished run exits with ``code`` ('' for a success)."""
    if code == EXIT_OK:
        return ""
    return (
        f"{'every sample failed' if failed >= total else 'too many samples failed'}: "
        f"{failed} of {total} sample(s) failed for good, more than --max-failed-fraction "
        f"{max_failed_fraction:g} allows (the first failures are above; every one, by reason:"
        " eagle3d report --output OUTPUT)"
    )


@dataclass(slots=True)
class ResumeFold:
    """Folds replayed records: per-sample status, the live reducer state, the last session.

    The latest record of a sample wins: saved, failed for good, pending again (a retry
    after a failure, ``sample_invalid`` after a save). A failure for good that an older
    eagle3d recorded for the environment's fault (:func:`recorded_failure_is_environment`)
    is pending again, and listed in :attr:`reopen` for the daemon to journal; so is a
    line an older eagle3d (a session whose dataset was not pinned) failed as bad JSON: it
    may have been a valid line cut short by a file that ended early under the run.
    """

    status: bytearray
    state: reducer.ShardState
    last_started: ev.RunStarted | None = None
    finished_last: bool = False  # the journal's last session ended with run_finished
    reopen: dict[int, ev.SampleFailed] = field(default_factory=dict)
    pinned: bool = False  # the session being folded read its dataset pinned

    def sink(self, batch: list[ev.AnyEvent]) -> None:
        status = self.status
        for e in batch:
            reducer.apply(self.state, e)
            if isinstance(e, ev.SampleSaved):
                if e.idx < len(status):
                    status[e.idx] = SAVED
                self.reopen.pop(e.idx, None)
            elif isinstance(e, ev.SampleFailed):
                if e.idx >= len(status) or status[e.idx] == SAVED:
                    continue
                if e.retry:
                    status[e.idx] = PENDING
                    self.reopen.pop(e.idx, None)
                elif recorded_failure_is_environment(e.error, e.message) or (
                    e.error == "bad_json" and not self.pinned
                ):
                    status[e.idx] = PENDING
                    self.reopen[e.idx] = e
                else:
                    status[e.idx] = FAILED
            elif isinstance(e, ev.SampleInvalid):
                if e.idx < len(status) and status[e.idx] == SAVED:
                    status[e.idx] = PENDING
                self.finished_last = False
            elif isinstance(e, ev.RunStarted):
                self.last_started = e
                self.pinned = e.dataset_pinned
            if isinstance(e, ev.RunFinished):
                self.finished_last = True
            elif isinstance(e, ev.RunStarted):
                self.finished_last = False

    def extra(self) -> bytes:
        """What a checkpoint keeps of this fold beyond the reducer's state."""
        return _extra_encoder.encode(
            _Extra(
                # Mostly one value (saved, or pending): a few KB at a million rows.
                status=zlib.compress(self.status, 1),
                last_started=self.last_started,
                finished_last=self.finished_last,
                reopen=list(self.reopen.values()),
            )
        )

    def restore(self, state: reducer.ShardState, extra: bytes) -> str:
        """Take a checkpoint's fold (``state`` and :meth:`extra`'s bytes) as this one's;
        '' when done, else why it does not fit (and nothing changed)."""
        try:
            x = _extra_decoder.decode(extra)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return f"its resume fold does not decode ({e})"
        try:
            status = zlib.decompress(x.status)
        except zlib.error as e:
            return f"its status does not decompress ({e})"
        if len(status) != len(self.status):
            return f"it covers {len(status)} dataset rows, the dataset has {len(self.status)}"
        self.status[:] = status
        for name in reducer.ShardState.__struct_fields__:
            setattr(self.state, name, getattr(state, name))
        self.last_started = x.last_started
        self.finished_last = x.finished_last
        self.reopen = {e.idx: e for e in x.reopen}
        return ""

    def copy(self) -> ResumeFold:
        """An independent fold with the same content (the checkpoint writer's own)."""
        fold = ResumeFold(
            bytearray(self.status), reducer.decode_state(reducer.encode_state(self.state))
        )
        fold.last_started = self.last_started
        fold.finished_last = self.finished_last
        fold.reopen = dict(self.reopen)
        return fold

    def apply(self, e: ev.Event) -> None:
        self.sink([e])  # type: ignore[list-item]

    def reopening_records(self) -> list[ev.SampleFailed]:
        """The records that journal each failure in :attr:`reopen` as pending again, so
        that every reader of the journal agrees it is."""
        return [
            ev.SampleFailed(
                idx=e.idx,
                error=e.error,
                message=(
                    f"read by an older eagle3d that did not pin the dataset (the line may have been cut short), retried: {e.message}"
                    if e.error == "bad_json"
                    else f"not the sample's fault, retried: {e.message}"
                ),
                attempt=0,
                retry=True,
                environment=True,
            )
            for e in self.reopen.values()
        ]


class _Extra(msgspec.Struct, kw_only=True):
    status: bytes  # zlib
    last_started: ev.RunStarted | None
    finished_last: bool
    reopen: list[ev.SampleFailed]


_extra_encoder = msgspec.msgpack.Encoder()
_extra_decoder = msgspec.msgpack.Decoder(_Extra)
