"""Small files written whole and sealed: ``magic | u32 crc | u64 length | payload`` (the
CRC-32 of the payload from a per-kind seed), put in place by a temp file, fsync, rename and a
directory fsync, so that a reader finds either the old file or the new one, whole, and knows
a damaged one (the state checkpoint, the dataset's pin and the tokenizer kept beside a
journal)."""

from __future__ import annotations

import os
import struct
import zlib
from typing import Protocol, TypeVar

import msgspec

HEAD = struct.Struct("<8sIQ")


class Unsealed(ValueError):
    """The bytes are not a whole, undamaged file of this kind; the message says why."""


def seal(magic: bytes, seed: int, payload: bytes) -> bytes:
    return HEAD.pack(magic, zlib.crc32(payload, seed), len(payload)) + payload


def unseal(data: bytes, magic: bytes, seed: int) -> memoryview:
    """The payload of ``data``; raises :class:`Unsealed`."""
    if len(data) < HEAD.size:
        raise Unsealed("it is cut short")
    got, crc, length = HEAD.unpack_from(data)
    if got != magic:
        raise Unsealed("it is not a file of this kind and version")
    payload = memoryview(data)[HEAD.size :]
    if len(payload) != length or zlib.crc32(payload, seed) != crc:
        raise Unsealed("its checksum does not match (damaged)")
    return payload


class Versioned(Protocol):
    @property
    def version(self) -> int: ...


V = TypeVar("V", bound=Versioned)


def open_struct(
    data: bytes, magic: bytes, seed: int, decoder: msgspec.msgpack.Decoder[V], version: int
) -> V:
    """The msgpack struct sealed in ``data``, of ``version``; ValueError naming what is wrong
    (:class:`Unsealed`, a payload that does not decode, another version)."""
    payload = unseal(data, magic, seed)
    try:
        got = decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"it does not decode ({e})") from e
    if got.version != version:
        raise ValueError(f"version {got.version}, not {version}")
    return got


def write_atomic(path: str, data: bytes, mode: int = 0o640) -> None:
    """``data`` at ``path`` (temp file ``path.tmp``, fsync, rename, fsync the directory)."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


__all__ = ["HEAD", "Unsealed", "Versioned", "open_struct", "seal", "unseal", "write_atomic"]
