"""One sample on its way through the daemon, and what the ledger is fed.

Statuses (one byte per dataset row, the ledger's ``status``): :data:`PENDING`, :data:`SAVED`,
:data:`FAILED` (for good), :data:`SKIPPED` (a blank line: no sample). Stages of a sample in
flight are the journal's own (:data:`eagle3proto.reducer.SENT`, ``DUMPED``), so the daemon
and every reader of the journal count the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle3proto.reducer import DUMPED, SENT

PENDING, SAVED, FAILED, SKIPPED = 0, 1, 2, 3

__all__ = [
    "DUMPED",
    "FAILED",
    "PENDING",
    "SAVED",
    "SENT",
    "SKIPPED",
    "CommitJob",
    "Ended",
    "Rejected",
    "Request",
    "Sample",
]


@dataclass(slots=True)
class Sample:
    """One sample the daemon is working on (a tokenized dataset row)."""

    idx: int
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False
    full_length: int = 0  # the row's length before truncation (0: not known)
    length_estimated: bool = False  # full_length estimated (cut before tokenizing)
    attempt: int = 0  # counted attempts (the sample's own failures), this one included
    sends: int = 0  # every send, uncounted ones included: names the request
    rid: str = ""
    stage: int = 0  # 0 (not in flight), SENT or DUMPED
    sent_at: float = 0.0
    dump_path: str = ""
    dump_bytes: int = 0
    started: bool = False  # the producer said it is computing this attempt
    recount: bool = True  # the next send is a new attempt (False after an uncounted failure)
    commit_retried: bool = False  # a commit that lost its row directory was tried again


@dataclass(frozen=True, slots=True)
class CommitJob:
    """What a commit thread needs of a dumped sample: a frozen snapshot, made on the loop
    thread, so that nothing the ledger keeps changing crosses to another thread. The token
    lists are the feeder's own, which nobody changes once it handed them over."""

    rid: str
    idx: int
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool
    full_length: int  # the row's length before truncation (0: not known)
    dump_path: str
    dump_bytes: int
    length_estimated: bool = False  # full_length estimated (cut before tokenizing)

    @classmethod
    def of(cls, p: Sample) -> CommitJob:
        return cls(
            p.rid,
            p.idx,
            p.input_ids,
            p.loss_mask,
            p.truncated,
            p.full_length,
            p.dump_path,
            p.dump_bytes,
            p.length_estimated,
        )


@dataclass(frozen=True, slots=True)
class Rejected:
    """A dataset row that cannot become a sample (bad JSON, no assistant turn, too long):
    the sample's own fault, failed for good with the reason."""

    idx: int
    error: str
    message: str


@dataclass(frozen=True, slots=True)
class Ended:
    """The feeder has read the shard's last row."""


@dataclass(slots=True)
class Request:
    """One attempt at one sample, as a producer receives it."""

    rid: str  # unique per send; the dump file is named after it
    idx: int  # the sample id (0-based dataset row)
    input_ids: list[int]
    attempt: int = 1
    sent_at: float = 0.0  # monotonic time the daemon sent it
    extra: dict[str, object] = field(default_factory=dict)
