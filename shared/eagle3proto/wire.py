"""The live protocol spoken on the daemon's Unix socket (and relayed by ``eagle3-top --stream``).

Same framing as the journal (:mod:`eagle3proto.codec`). Every message is a msgpack map with a
``kind``: control messages below, or journal event records as they are.

1. client -> ``hello`` {proto, since_seq, mode}
2. daemon -> ``snapshot`` {proto, shard, state} (the reducer state at ``state.seq``), then
   every record after ``since_seq`` or after the snapshot, then live records.
3. a subscriber that falls behind gets ``resync`` (a fresh snapshot follows) or ``bye``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from . import events as ev
from .codec import FRAME_OVERHEAD, MAX_RECORD, Scan, Stop, encode_frame, scan
from .reducer import ShardState

PROTO = 1


class Hello(msgspec.Struct, tag="hello", tag_field="kind", kw_only=True):
    proto: int = PROTO
    since_seq: int = -1
    mode: str = "live"  # live | once
    client: str = ""


class StartInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Where a daemon's start stands (its start beacon's snapshots only): the stage, since
    when (wall seconds, from the daemon's monotonic clock), and the stage's progress."""

    stage: str = ""  # "reading dataset big.jsonl", "checking the space", ...
    detail: str = ""  # "120,000 rows, 107 MB of 188 MB (57 %)"
    since: float = 0.0
    rows: int = 0  # rows read (or sampled) so far
    bytes_read: int = 0
    bytes_total: int = 0  # 0: unknown
    pid: int = 0


class Snapshot(msgspec.Struct, tag="snapshot", tag_field="kind", kw_only=True):
    proto: int = PROTO
    shard_index: int = 0
    shard_count: int = 1
    host: str = ""
    output: str = ""
    state: ShardState = msgspec.field(default_factory=ShardState)
    start: StartInfo | None = None  # a start beacon's: the daemon is not up yet


class Resync(msgspec.Struct, tag="resync", tag_field="kind", kw_only=True):
    reason: str = ""


class Bye(msgspec.Struct, tag="bye", tag_field="kind", kw_only=True):
    reason: str = ""
    last_seq: int = -1


class Error(msgspec.Struct, tag="error", tag_field="kind", kw_only=True):
    message: str = ""


Control = Hello | Snapshot | Resync | Bye | Error
Message = Control | ev.KnownEvent

_enc = msgspec.msgpack.Encoder()
_dec: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(Message)


def encode(msg: msgspec.Struct) -> bytes:
    """One framed message, ready to write."""
    return encode_frame(_enc.encode(msg))


def decode_payload(payload: bytes | memoryview) -> Message | ev.Unknown:
    """Decode one message payload; unknown kinds become :class:`events.Unknown`."""
    try:
        return _dec.decode(payload)  # type: ignore[no-any-return,unused-ignore]
    except msgspec.ValidationError:
        return ev.decode(payload)


class ProtocolError(ValueError):
    """The peer sent something that is not a valid frame."""


class FrameBuffer:
    """Incremental frame splitter for a byte stream: feed bytes, take whole payloads."""

    def __init__(self, max_record: int = MAX_RECORD) -> None:
        self._buf = bytearray()
        self.max_record = max_record

    def feed(self, data: bytes) -> list[bytes]:
        """Add bytes; return complete payloads. Raises ProtocolError on garbage."""
        self._buf += data
        # Scan a copy: views into a bytearray would pin it against the resize below.
        res: Scan = scan(bytes(self._buf))
        out = [bytes(p) for p in res.payloads]
        rest = len(self._buf) - res.end
        if res.stop in (Stop.BAD_CRC, Stop.BAD_LENGTH) or (
            res.stop is Stop.ZEROS and rest >= FRAME_OVERHEAD
        ):
            raise ProtocolError(f"bad frame from peer: {res.stop.value}")
        if rest >= FRAME_OVERHEAD:
            n = int.from_bytes(self._buf[res.end + 4 : res.end + 8], "little")
            if n > self.max_record:
                raise ProtocolError(f"frame of {n} bytes exceeds {self.max_record}")
        del self._buf[: res.end]
        return out


class FrameReader(FrameBuffer):
    """Like :class:`FrameBuffer`, but decodes each payload into a protocol message."""

    def feed_messages(self, data: bytes) -> list[Message | ev.Unknown]:
        return [decode_payload(p) for p in self.feed(data)]
