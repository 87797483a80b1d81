"""The pipe between the daemon and a Hugging Face worker: msgspec tagged structs (``op`` is
the tag) in :mod:`eagle3proto.codec` frames, on the worker's stdin and stdout.

To the worker: :class:`Req` (compute these ids, dump them as ``rid``), :class:`Cancel`,
:class:`Give` (hand these back unless started), :class:`Stop`. From the worker:
:class:`Ready` (the model is loaded), :class:`LoadFailed`, :class:`Start` (a batch's forward
begins), :class:`Done` (it ended), :class:`Written` (its dumps are in the dump area),
:class:`Given`, :class:`Idle` (its loop waits for work), :class:`Fail` (a request's dump
could not be written). A message of another shape is a decode error, not a guess.
"""

from __future__ import annotations

import msgspec
from eagle3proto.codec import encode_frame


class Req(msgspec.Struct, tag="req", tag_field="op"):
    rid: str
    ids: list[int]
    alone: bool = False  # computed in a batch of its own (a worker died with it in a batch)


class Cancel(msgspec.Struct, tag="cancel", tag_field="op"):
    rid: str


class Give(msgspec.Struct, tag="give", tag_field="op"):
    rids: list[str]


class Stop(msgspec.Struct, tag="stop", tag_field="op"):
    pass


class Ready(msgspec.Struct, tag="ready", tag_field="op"):
    pid: int
    device: str
    dtype: str
    store_dtype: str
    layers: list[int]
    num_layers: int
    hidden: int
    threads: int
    malloc: str


class LoadFailed(msgspec.Struct, tag="fatal", tag_field="op"):
    error: str
    message: str


class Start(msgspec.Struct, tag="start", tag_field="op"):
    rids: list[str]


class Done(msgspec.Struct, tag="done", tag_field="op"):
    """A batch computed: from here its dumps are owed until its ``Written``."""

    rids: list[str]
    tokens: int  # real tokens in the batch
    padded: int  # tokens computed, padding included
    secs: float


class Written(msgspec.Struct, tag="written", tag_field="op"):
    """A batch's dumps are all in the dump area; always sent after that batch's ``Done``."""

    rids: list[str]


class Given(msgspec.Struct, tag="given", tag_field="op"):
    rids: list[str]


class Idle(msgspec.Struct, tag="idle", tag_field="op"):
    pass


#: A worker's exit status after a MemoryError outside a forward: the environment's fault.
EXIT_OUT_OF_MEMORY = 75


class Fail(msgspec.Struct, tag="fail", tag_field="op"):
    rid: str
    error: str
    message: str


ToWorker = Req | Cancel | Give | Stop
FromWorker = Ready | LoadFailed | Start | Done | Written | Given | Idle | Fail

_encode = msgspec.msgpack.Encoder().encode
to_worker = msgspec.msgpack.Decoder(ToWorker).decode
from_worker = msgspec.msgpack.Decoder(FromWorker).decode


def frame(msg: ToWorker | FromWorker) -> bytes:
    """``msg`` as one frame for the pipe."""
    return encode_frame(_encode(msg))


# The worker zygote's socket (:mod:`eagle3d.remote.hf_zygote`): one message per packet of a
# SOCK_SEQPACKET socket pair, its file descriptors in that packet's ancillary data.


class Fork(msgspec.Struct, tag="fork", tag_field="op"):
    """Fork a worker with these flags; fds: its stdin's read end, its stdout's write end."""

    id: int
    flags: list[str]


class Kill(msgspec.Struct, tag="kill", tag_field="op"):
    """SIGKILL the worker forked for ``id`` (sent only after its ``fork``: a stop while the
    zygote still imports is answered in order, so no worker is left unknown)."""

    id: int


class Hello(msgspec.Struct, tag="hello", tag_field="op"):
    """The zygote has imported what a worker needs; ``tasks``: its native threads then."""

    pid: int
    secs: float
    tasks: int


class ImportFailed(msgspec.Struct, tag="import_failed", tag_field="op"):
    error: str
    message: str


class Forked(msgspec.Struct, tag="forked", tag_field="op"):
    """The worker for ``id`` runs as ``pid``; fds: a pidfd of it."""

    id: int
    pid: int


class ForkFailed(msgspec.Struct, tag="fork_failed", tag_field="op"):
    id: int
    error: str
    message: str


class Exited(msgspec.Struct, tag="exited", tag_field="op"):
    """The worker for ``id`` ended; ``code`` as asyncio reports it (-N: killed by signal N)."""

    id: int
    pid: int
    code: int


ToZygote = Fork | Kill
FromZygote = Hello | ImportFailed | Forked | ForkFailed | Exited

encode = _encode
to_zygote = msgspec.msgpack.Decoder(ToZygote).decode
from_zygote = msgspec.msgpack.Decoder(FromZygote).decode
