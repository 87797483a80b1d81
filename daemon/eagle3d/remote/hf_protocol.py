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
    rids: list[str]
    tokens: int  # real tokens in the batch
    padded: int  # tokens computed, padding included
    secs: float


class Written(msgspec.Struct, tag="written", tag_field="op"):
    rids: list[str]


class Given(msgspec.Struct, tag="given", tag_field="op"):
    rids: list[str]


class Idle(msgspec.Struct, tag="idle", tag_field="op"):
    pass


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
