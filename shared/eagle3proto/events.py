"""Typed, versioned progress events: the contract between eagle3d and every monitor.

Every record is a msgpack map with ``kind`` (the tag), ``seq`` (strictly +1 within a
journal shard), ``ts`` (wall-clock seconds), ``run`` (the job's run id) and, from a daemon
session's ``run_started`` on, ``bt``: the machine's ``CLOCK_BOOTTIME`` when it was written
(seconds since boot, the same for every process of that boot, never moved by a wall-clock
step). With the session's ``boot_id`` (in ``run_started``) a reader of the same boot takes
ages, rates and ETAs from ``bt``, not from wall-clock differences (docs/monitor.md).

Schema evolution follows msgspec's rules: a new field always gets a default, an existing
field never changes type, unknown fields are ignored on decode and unknown kinds decode
to :class:`Unknown` so that old readers skip what newer writers add.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

#: Bumped only for incompatible changes; additive changes keep it.
SCHEMA_VERSION = 1


class Event(msgspec.Struct, tag_field="kind", kw_only=True, omit_defaults=True, gc=False):
    """Fields every record carries."""

    seq: int = 0
    ts: float = 0.0
    run: str = ""
    #: CLOCK_BOOTTIME seconds when written (0: not recorded: an older eagle3d, a record
    #: before its session's run_started, or another tool's).
    bt: float = 0.0

    #: Records of a commit-carrying kind are made durable (fdatasync) before anyone is told.
    durable: ClassVar[bool] = False

    @property
    def kind(self) -> str:
        return str(type(self).__struct_config__.tag)


class JobInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a job is: enough to refuse resuming against a different dataset or config."""

    model: str = ""
    dataset: str = ""
    dataset_bytes: int = 0
    dataset_sha: str = ""
    aux_layers: list[int] = []  # the captured layers (eagle3d.remote.recipes' convention)
    #: The drafter recipe (eagle3d.remote.recipes); '' = eagle3, as in journals before it.
    recipe: str = ""
    output: str = ""
    shard_index: int = 0
    shard_count: int = 1
    backend: str = "hf"
    max_length: int = 0
    on_overflow: str = "truncate"
    #: The states' dtype in the files (eagle3d.storedtype); '' in journals before it existed.
    store_dtype: str = ""
    version: str = ""
    fingerprint: str = ""


class RunStarted(Event, tag="run_started"):
    """A daemon session began (or resumed) a job."""

    durable: ClassVar[bool] = True
    schema: int = SCHEMA_VERSION
    job: JobInfo = msgspec.field(default_factory=JobInfo)
    total: int = -1
    session: int = 1
    pid: int = 0
    host: str = ""
    socket: str = ""
    already_saved: int = 0
    already_failed: int = 0
    skipped: int = 0  # blank lines of this shard: no samples, not counted in total
    #: The run's failure rule (``--max-failed-fraction``): more samples failed for good than
    #: this share of the total makes it exit 9, and the monitor warns by the same rule
    #: (:func:`eagle3proto.views.too_many_failed`). -1: a journal from before it was recorded.
    max_failed_fraction: float = -1.0
    #: The job's space reserve in bytes (``--space-reserve``, resolved on the output's
    #: filesystem): the monitor calls the output disk full only below it. -1: not recorded.
    space_reserve_bytes: int = -1
    # The session reads the dataset pinned (a changed file stops it; no line is ever cut
    # short by a file that ended early). An older version's bad_json failures are retried.
    dataset_pinned: bool = False
    # Who the daemon is, beyond a pid that may be reused: its start time (clock ticks since
    # boot, /proc/<pid>/stat) and the boot's id. A monitor takes a lock for the daemon's
    # only when its holder is this process (eagle3proto.locks).
    pid_start: int = 0
    boot_id: str = ""
    #: rows of this shard that a journal of another shard count settled (saved or failed
    #: for good) before this session: theirs, not counted in total (docs/slurm.md)
    inherited: int = 0


class SampleSent(Event, tag="sample_sent"):
    """The daemon sent one attempt of a sample to the producer."""

    idx: int
    rid: str = ""
    attempt: int = 1
    tokens: int = 0


class SampleDumped(Event, tag="sample_dumped"):
    """A dump for a request of ours arrived in the dump area."""

    idx: int
    rid: str = ""
    bytes: int = 0


class SampleSaved(Event, tag="sample_saved"):
    """A sample is durably committed to the output (the commit record)."""

    durable: ClassVar[bool] = True
    idx: int
    path: str
    bytes: int
    tokens: int
    checksum: str
    #: Cut to the job's ``max_length`` (``--on-overflow truncate``): ``tokens`` were kept of
    #: ``original_tokens`` (0 in journals written before it was recorded).
    truncated: bool = False
    original_tokens: int = 0
    #: ``original_tokens`` is an estimate: the row's text was cut before tokenizing (over
    #: ``max_length`` x 64 characters) and its length scaled from the tokens of the part kept.
    original_estimated: bool = False


class SampleFailed(Event, tag="sample_failed"):
    """An attempt failed; ``retry`` says whether the sample will be tried again.

    ``environment``: the failure was not the sample's own (a stop, a signal, a full or
    unwritable disk); it counts no attempt and the sample is always tried again.
    """

    durable: ClassVar[bool] = True
    idx: int
    error: str
    message: str = ""
    attempt: int = 1
    retry: bool = False
    environment: bool = False


class SampleInvalid(Event, tag="sample_invalid"):
    """A committed sample was found damaged or missing (``eagle3d verify --repair``): it is
    no longer saved, its file (if any) was moved to ``kept``, and the next run redoes it."""

    durable: ClassVar[bool] = True
    idx: int
    path: str = ""
    reason: str = ""
    kept: str = ""


class DiskUsage(msgspec.Struct, kw_only=True, omit_defaults=True):
    label: str
    path: str = ""
    total_bytes: int = 0
    used_bytes: int = 0
    free_bytes: int = 0


class GpuInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One device's health as NVML reports it (a field NVML cannot read stays at its default).

    ``ecc_errors`` counts uncorrected errors since the driver loaded (volatile),
    ``ecc_corrected`` corrected ones (volatile), ``ecc_uncorrected_total`` uncorrected ones
    over the board's life (aggregate). ``xid_errors`` counts the critical XID events seen
    since the daemon started, ``last_xid`` is the newest one's code and ``last_xid_ts`` when
    the daemon saw it (wall time).
    """

    index: int
    name: str = ""
    util_percent: float = 0.0
    mem_used_bytes: int = 0
    mem_total_bytes: int = 0
    temperature_c: float = 0.0
    power_w: float = 0.0
    ecc_errors: int = 0
    throttle: list[str] = []
    power_limit_w: float = 0.0
    ecc_corrected: int = 0
    ecc_uncorrected_total: int = 0
    xid_errors: int = 0
    last_xid: int = 0
    last_xid_ts: float = 0.0
    last_xid_bt: float = 0.0


class ProducerHealth(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str = ""
    up: bool = False
    latency_s: float = 0.0
    restarts: int = 0
    detail: dict[str, float | str] = {}


class Stats(Event, tag="stats"):
    """Periodic facts a remote monitor cannot observe itself."""

    state: str = "running"
    disk: list[DiskUsage] = []
    gpus: list[GpuInfo] = []
    gpu_note: str = ""
    producer: ProducerHealth = msgspec.field(default_factory=ProducerHealth)
    cpu_percent: float = 0.0
    rss_bytes: int = 0
    inflight: int = 0
    orphans: int = 0
    #: RSS of the daemon's child processes (the HF workers), sent while the producer starts:
    #: memory that still grows is a model load making progress.
    producer_rss_bytes: int = 0


#: The states a :class:`RunState` record names. ``starting`` and ``loading`` come before the
#: producer is up (``reason`` says what is being started or loaded); ``running`` follows it.
RUN_STATES = ("starting", "loading", "running", "paused", "draining")


class RunState(Event, tag="run_state"):
    """The pipeline changed state: one of :data:`RUN_STATES` (e.g. loading the model, paused on
    a full disk, draining, resumed)."""

    durable: ClassVar[bool] = True
    state: str
    reason: str = ""


#: The states a :class:`ProducerEvent` names. ``waiting``: the daemon is waiting for a
#: producer that is not up yet at start (an SGLang server still loading), the message says
#: where and for how long (``waiting for SGLang at URL (N s)``).
PRODUCER_STATES = ("up", "down", "restarting", "waiting")


class ProducerEvent(Event, tag="producer"):
    """The producer went up or down, is being restarted, or is being waited for
    (:data:`PRODUCER_STATES`); ``message`` gives the reason (the URL, the last error)."""

    state: str
    message: str = ""


class DumpOrphan(Event, tag="dump_orphan"):
    """A dump nobody asked for (unknown request, or left by an earlier run) was removed."""

    rid: str = ""
    path: str = ""
    reason: str = ""


class RunStopped(Event, tag="run_stopped"):
    """The session stopped before the job finished (signal, fatal error)."""

    durable: ClassVar[bool] = True
    reason: str = ""
    exit_code: int = 0


class RunFinished(Event, tag="run_finished"):
    """Every sample of the shard is saved or recorded as failed.

    ``exit_code`` is the run's outcome: 0, or non-zero when every sample failed or more
    than the allowed share did (``eagle3d run --max-failed-fraction``).
    """

    durable: ClassVar[bool] = True
    saved: int = 0
    failed: int = 0
    exit_code: int = 0


class Recovered(Event, tag="recovered"):
    """What the journal reader dropped at open, and why."""

    durable: ClassVar[bool] = True
    segment: str = ""
    offset: int = 0
    dropped_bytes: int = 0
    reason: str = ""
    kept: str = ""


class Unknown(msgspec.Struct, kw_only=True):
    """A record of a kind this reader does not know (written by a newer eagle3d)."""

    kind: str = ""
    seq: int = 0
    ts: float = 0.0
    run: str = ""
    bt: float = 0.0


KnownEvent = (
    RunStarted
    | SampleSent
    | SampleDumped
    | SampleSaved
    | SampleFailed
    | SampleInvalid
    | Stats
    | RunState
    | ProducerEvent
    | DumpOrphan
    | RunStopped
    | RunFinished
    | Recovered
)
AnyEvent = KnownEvent | Unknown

KINDS: dict[str, type[Event]] = {
    str(t.__struct_config__.tag): t
    for t in (
        RunStarted,
        SampleSent,
        SampleDumped,
        SampleSaved,
        SampleFailed,
        SampleInvalid,
        Stats,
        RunState,
        ProducerEvent,
        DumpOrphan,
        RunStopped,
        RunFinished,
        Recovered,
    )
}

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(KnownEvent)
_list_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(list[KnownEvent])
_unknown_decoder = msgspec.msgpack.Decoder(Unknown)


def encode(event: Event) -> bytes:
    """Encode one event as a msgpack map."""
    return _encoder.encode(event)


def decode(payload: bytes | memoryview) -> AnyEvent:
    """Decode one event; a kind this version does not know decodes to :class:`Unknown`.

    Raises:
        msgspec.DecodeError: the payload is not a valid event of a known shape.
    """
    try:
        return _decoder.decode(payload)  # type: ignore[no-any-return,unused-ignore]
    except msgspec.ValidationError:
        unknown = _unknown_decoder.decode(payload)
        if unknown.kind in KINDS:  # a known kind with a bad field: that is corruption
            raise
        return unknown


def decode_many(payloads: list[bytes]) -> list[AnyEvent]:
    """Decode many payloads at once (one C call on the fast path)."""
    if not payloads:
        return []
    n = len(payloads)
    # A msgpack array32 header in front of the concatenated maps lets msgspec decode the
    # whole batch in one call; this is what keeps a 1M-record replay under two seconds.
    head = b"\xdd" + n.to_bytes(4, "big")
    try:
        return _list_decoder.decode(b"".join([head, *payloads]))  # type: ignore[no-any-return,unused-ignore]
    except msgspec.ValidationError:
        return [decode(p) for p in payloads]
