"""The space check's tokenized rows, kept beside the journal, so that a resume does not
tokenize them again.

``eagle3d run``'s space check (:mod:`eagle3d.run.spacecheck`) reads the shard's rows still to
do as the feeder will: every one, or a seeded uniform random sample of 20,000 of them. That
is a pass of the tokenizer over up to 20,000 rows (CPU-seconds, and the wall time before the
first request) at every start, a resume's included. Once a start is accepted, the daemon
keeps what it found of each row read (its tokens; a row cut at ``max_length``, refused as
too long, or invalid, with its words) in ``estimate.e3r`` in the shard's journal directory,
with the set of rows that were still to do then (the *pool*). A later start takes the kept
rows still to do (:func:`take`) instead of reading any row, when:

* the key matches: the dataset's hash, the model's tokenizer files and libraries
  (:func:`eagle3d.ingest.tokcache.key`), ``max_length``, ``--on-overflow``, the format and
  line limit, the shard and this eagle3d's version — everything a row's tokens depend on;
* every row still to do was in the pool. Rows only leave the pool as the run settles them,
  in the dataset's order, whichever were sampled; so the sampled rows still to do are a
  uniform random sample of the rows still to do, and the estimate stays unbiased (its
  margin widens as the sample thins);
* the pool was read whole (then the estimate stays exact), or at least :data:`MIN_ROWS`
  sampled rows are still to do (else the rows are sampled and read afresh, and kept).

A kept file that is damaged, of another version or key, is ignored with a message. The
file: ``magic | u32 crc | u64 length``, then a msgpack :class:`Kept` (the arrays as
little-endian bytes, the pool a zlib-compressed bitmap over the dataset's rows); written to
a temp file, synced and renamed into place.
"""

from __future__ import annotations

import hashlib
import logging
import os
import zlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
from eagle3proto import sealed
from eagle3proto.paths import Shard

import eagle3d

log = logging.getLogger("eagle3d")

NAME = "estimate.e3r"
MAGIC = b"E3DEST\x00\x01"
VERSION = 1
_SEED = zlib.crc32(b"eagle3d-kept-rows-v1")
#: Fewer sampled rows still to do than this (and a pool not read whole): read afresh.
MIN_ROWS = 1_000
#: The invalid rows whose words are kept (the plan names the first five still to do).
MESSAGES = 100

#: What reading a row found: a sample (``OK``), a sample cut at ``max_length`` (``CUT``), a
#: row refused as longer than ``max_length`` (``TOO_LONG``, ``--on-overflow skip``), a row
#: the run fails as its own fault (``INVALID``).
OK, CUT, TOO_LONG, INVALID = 0, 1, 2, 3


class Found(NamedTuple):
    """What reading one row as the run will found."""

    tokens: int  # the sample's tokens (0: no sample)
    kind: int  # OK, CUT, TOO_LONG or INVALID
    dropped: int = 0  # tokens the cut dropped
    message: str = ""  # an invalid row's words


@dataclass(frozen=True, slots=True)
class Read:
    """The rows one start read (ascending) and what it found of each; ``pool``: the rows
    still to do then (ascending); ``complete``: every row of the pool was read."""

    rows: list[int]
    found: list[Found]
    pool: Any  # a numpy array of row ids
    complete: bool


class Kept(msgspec.Struct, kw_only=True):
    """A :class:`Read` as stored."""

    version: int
    key: str
    lines: int  # the dataset's rows: the pool's bitmap covers them
    pool: bytes  # zlib of a bitmap over the rows (numpy's packbits, little bit order)
    complete: bool
    rows: bytes  # int64 each
    tokens: bytes  # int32 each
    kinds: bytes  # uint8 each
    dropped: bytes  # int32 each
    messages: dict[int, str]  # row -> words, for the first MESSAGES invalid rows


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Kept)


def path_in(jdir: str) -> str:
    return os.path.join(jdir, NAME)


def key(
    *,
    dataset_sha: str,
    tokenizer: str,
    max_length: int,
    on_overflow: str,
    fmt: str,
    max_line: int,
    shard: Shard,
) -> str:
    """What a row's tokens depend on, hashed (``tokenizer``: :func:`~eagle3d.ingest.tokcache.key`
    of the model)."""
    parts = (
        eagle3d.__version__,
        dataset_sha,
        tokenizer,
        str(max_length),
        on_overflow,
        fmt,
        str(max_line),
        f"{shard.index}/{shard.count}",
    )
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=16).hexdigest()


def encode(read: Read, key_: str, lines: int) -> bytes:
    import numpy as np

    bits = np.zeros(lines, np.uint8)
    bits[np.asarray(read.pool, np.int64)] = 1
    invalid = [(r, f.message) for r, f in zip(read.rows, read.found, strict=True) if f.message]
    k = Kept(
        version=VERSION,
        key=key_,
        lines=lines,
        pool=zlib.compress(np.packbits(bits, bitorder="little").tobytes(), 1),
        complete=read.complete,
        rows=np.asarray(read.rows, "<i8").tobytes(),
        tokens=np.asarray([f.tokens for f in read.found], "<i4").tobytes(),
        kinds=np.asarray([f.kind for f in read.found], np.uint8).tobytes(),
        dropped=np.asarray([f.dropped for f in read.found], "<i4").tobytes(),
        messages=dict(invalid[:MESSAGES]),
    )
    return sealed.seal(MAGIC, _SEED, _encoder.encode(k))


def decode(data: bytes) -> Kept:
    """The kept rows in ``data``; ValueError naming what is wrong with them."""
    k = sealed.open_struct(data, MAGIC, _SEED, _decoder, VERSION)
    n = len(k.rows) // 8
    if len(k.rows) % 8 or (len(k.tokens), len(k.kinds), len(k.dropped)) != (4 * n, n, 4 * n):
        raise ValueError("its arrays are of different lengths")
    return k


#: The kept rows still to do, what was found of each, and whether they are a sample.
Taken = tuple[list[int], list[Found], bool]


def take(jdir: str, key_: str, pending: Any, lines: int) -> Taken | None:
    """The kept rows among ``pending`` (the rows still to do, ascending), what was found of
    each and whether they are a sample, when they may stand for a fresh read (see the
    module's docstring); else None, said in the log when a kept file was there."""
    import numpy as np

    where = path_in(jdir)
    try:
        with open(where, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.info("%s was not used: %s", where, e.strerror)
        return None
    why, got = _usable(data, key_, np.asarray(pending, np.int64), lines)
    if got is None:
        log.info("%s was not used: %s", where, why)
    return got


def _usable(data: bytes, key_: str, pending: Any, lines: int) -> tuple[str, Taken | None]:
    import numpy as np

    try:
        k = decode(data)
    except ValueError as e:
        return str(e), None
    if k.key != key_ or k.lines != lines:
        return "the dataset, the tokenizer or the job's settings changed since", None
    try:
        pool = np.unpackbits(
            np.frombuffer(zlib.decompress(k.pool), np.uint8), count=lines, bitorder="little"
        )
    except (zlib.error, ValueError) as e:
        return f"its pool does not decode ({e})", None
    if len(pending) and not pool[pending].all():
        return "rows are to do that were not then (settled rows made pending again)", None
    rows = np.frombuffer(k.rows, "<i8")
    at = np.flatnonzero(np.isin(rows, pending, assume_unique=True))
    if not k.complete and len(at) < min(MIN_ROWS, len(pending)):
        return f"only {len(at)} of its sampled rows are still to do", None
    tokens, dropped = np.frombuffer(k.tokens, "<i4"), np.frombuffer(k.dropped, "<i4")
    kinds = np.frombuffer(k.kinds, np.uint8)
    found = [
        Found(int(tokens[i]), int(kinds[i]), int(dropped[i]), k.messages.get(int(rows[i]), ""))
        for i in at
    ]
    return "", ([int(r) for r in rows[at]], found, not k.complete)


@dataclass(frozen=True, slots=True)
class Keep:
    """Rows a start read, with their key and the dataset's row count: what the daemon keeps
    in the journal directory once the start is accepted."""

    read: Read
    key: str
    lines: int

    def save(self, jdir: str) -> None:
        """Keep the rows in ``jdir``; a failure to write only costs the next start the read."""
        try:
            sealed.write_atomic(path_in(jdir), encode(self.read, self.key, self.lines))
        except OSError as e:
            log.warning("the space check's rows were not kept in %s (%s)", jdir, e.strerror)


__all__ = ["MIN_ROWS", "NAME", "Found", "Keep", "Kept", "Read", "Taken", "key", "path_in", "take"]
