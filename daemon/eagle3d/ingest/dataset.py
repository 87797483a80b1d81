"""Streaming JSONL dataset: line ids, sharding and per-line parsing.

API::

    count_lines(path) -> int
    iter_lines(path, shard_index=0, shard_count=1) -> Iterator[tuple[int, bytes]]
    parse_line(idx, raw) -> Conversation | PreTokenized        # raises BadSample
    iter_samples(path, shard_index=0, shard_count=1)
        -> Iterator[tuple[int, Conversation | PreTokenized | BadSample]]

Sample ids. The id of a line is its 0-based line number ``idx``: stable across runs and
shards, and it names the output file. Every line consumes an id, blank ones included (the
daemon skips a blank line and counts it as skipped; :func:`parse_line` reports one as a
:class:`BadSample`), so ids never shift when a line is fixed. A final line without a
trailing newline is still a line. Other formats (compressed JSONL, JSON arrays, parquet)
are read by :mod:`eagle3d.ingest.dataformats`, with the same ids: the row number.

Line numbers for humans. Messages say ``line N`` with ``N = idx + 1`` (what editors,
``sed -n Np`` and ``grep -n`` show) and also give the sample id: ``line 42 (sample 41): ...``.

Accepted line formats:

* ``{"conversations": [{"role": ..., "content": ...}, ...]}``
* ``{"conversations": [{"from": ..., "value": ...}, ...]}`` (ShareGPT)
* ``{"messages": [{"role": ..., "content": ...}, ...]}`` (OpenAI; ``content`` may also be a
  list of ``{"type": "text", "text": ...}`` parts, which are joined)
* ``{"input_ids": [int, ...], "loss_mask": [0|1, ...]}`` (pre-tokenized, equal lengths)

Roles map to ``system``/``user``/``assistant``: ``human`` -> user, ``gpt``/``chatgpt`` ->
assistant. Any other role is an error (the chat template could not format it faithfully).
Other keys on a line (``id``, ``source``, ...) are ignored.

Memory. Lines are read one at a time from a buffered binary file, so memory is bounded by
the longest line, whatever the file's length. Lines of other shards are skipped without
being decoded or parsed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = [
    "ROLE_MAP",
    "BadSample",
    "Conversation",
    "PreTokenized",
    "Sample",
    "Turn",
    "count_lines",
    "iter_lines",
    "iter_samples",
    "parse_line",
    "parse_obj",
]

#: Accepted role names (``role`` or ShareGPT ``from``) and the role they mean.
ROLE_MAP: dict[str, str] = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
}

_CHUNK = 1 << 20
_BOM = b"\xef\xbb\xbf"


class BadSample(ValueError):
    """A sample that cannot be used; ``error`` is a short code, ``reason`` the human detail.

    Codes raised here: ``blank``, ``bad_json``, ``bad_format``, ``no_turns``,
    ``unknown_role``, ``bad_type``, ``length_mismatch``. :mod:`eagle3d.ingest.chat` adds
    ``template_error``, ``empty``, ``no_assistant``, ``too_long``, ``no_loss``, ``bad_token_id``.
    The ``str()`` of the exception is ready for a ``sample failed`` record.
    """

    def __init__(self, idx: int, error: str, reason: str) -> None:
        self.idx = idx
        self.error = error
        self.reason = reason
        #: What a row of the dataset's format is called: "line" (JSONL), "row" (parquet),
        #: "item" (a JSON array); the reader of a format sets it (``dataformats.unit``).
        self.unit = "line"
        super().__init__(f"line {idx + 1} (sample {idx}): {reason}")

    def __str__(self) -> str:
        return f"{self.unit} {self.idx + 1} (sample {self.idx}): {self.reason}"

    def __reduce__(self) -> tuple[type[BadSample], tuple[int, str, str]]:  # picklable
        return (type(self), (self.idx, self.error, self.reason))


@dataclass(frozen=True, slots=True)
class Turn:
    """One message; ``role`` is always ``system``, ``user`` or ``assistant``."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class Conversation:
    """A chat sample still to be formatted by the chat template."""

    idx: int
    turns: tuple[Turn, ...]

    def messages(self) -> list[dict[str, str]]:
        """The turns as chat-template messages (``[{"role", "content"}, ...]``)."""
        return [{"role": t.role, "content": t.content} for t in self.turns]


@dataclass(frozen=True, slots=True)
class PreTokenized:
    """A sample given as token ids and loss mask; it bypasses the chat template."""

    idx: int
    input_ids: list[int]
    loss_mask: list[int]


Sample = Conversation | PreTokenized


def count_lines(path: str | os.PathLike[str]) -> int:
    """Number of lines (= sample ids) in the file, in the same sense as :func:`iter_lines`.

    Reads fixed-size chunks and counts newline bytes, so it is fast and uses constant memory.
    """
    n = 0
    last = b"\n"
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n if last == b"\n" else n + 1


def iter_lines(
    path: str | os.PathLike[str], shard_index: int = 0, shard_count: int = 1
) -> Iterator[tuple[int, bytes]]:
    """Yield ``(idx, raw_line)`` for the lines with ``idx % shard_count == shard_index``.

    ``raw_line`` has its line ending (``\\n`` or ``\\r\\n``) removed and is not decoded.
    """
    if shard_count < 1 or not 0 <= shard_index < shard_count:
        raise ValueError(f"bad shard {shard_index}/{shard_count}")
    with open(path, "rb") as f:
        if f.peek(3)[:3] == _BOM:  # a UTF-8 byte order mark is not part of line 1's JSON
            f.read(3)
        if shard_count == 1:
            for idx, line in enumerate(f):
                yield idx, _strip_eol(line)
        else:
            for idx, line in enumerate(f):
                if idx % shard_count == shard_index:
                    yield idx, _strip_eol(line)


def _strip_eol(line: bytes) -> bytes:
    if line.endswith(b"\n"):
        line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
    return line


def iter_samples(
    path: str | os.PathLike[str], shard_index: int = 0, shard_count: int = 1
) -> Iterator[tuple[int, Sample | BadSample]]:
    """Yield ``(idx, sample)`` for a shard's lines; a bad line yields its :class:`BadSample`."""
    for idx, raw in iter_lines(path, shard_index, shard_count):
        try:
            yield idx, parse_line(idx, raw)
        except BadSample as bad:
            yield idx, bad


_decode = msgspec.json.Decoder().decode


def parse_line(idx: int, raw: bytes | str) -> Sample:
    """Parse one JSONL line into a sample, or raise :class:`BadSample` saying why not."""
    if not raw.strip():
        raise BadSample(idx, "blank", "blank line")
    try:
        obj = _decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise BadSample(idx, "bad_json", f"bad JSON: {e}") from None
    return parse_obj(idx, obj)


def parse_obj(idx: int, obj: Any) -> Sample:
    """Parse one decoded sample (a JSON value, or a parquet row's columns)."""
    if not isinstance(obj, dict):
        raise BadSample(idx, "bad_format", f"expected a JSON object, got {_tname(obj)}")
    if "input_ids" in obj or "loss_mask" in obj:
        return _pretokenized(idx, obj)
    for key in ("conversations", "messages"):
        if key in obj:
            return _conversation(idx, key, obj[key])
    raise BadSample(
        idx,
        "bad_format",
        "expected a 'conversations', 'messages' or 'input_ids'/'loss_mask' key, got "
        + (", ".join(repr(k) for k in list(obj)[:5]) or "an empty object"),
    )


def _tname(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(v), type(v).__name__
    )


def _conversation(idx: int, key: str, turns: Any) -> Conversation:
    if not isinstance(turns, list):
        raise BadSample(idx, "bad_type", f"'{key}' must be an array, got {_tname(turns)}")
    if not turns:
        raise BadSample(idx, "no_turns", f"'{key}' has no turns")
    out = []
    for n, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadSample(idx, "bad_type", f"turn {n} must be an object, got {_tname(turn)}")
        if "role" in turn:
            content_key = "content"
            role, content = turn["role"], _get(turn, content_key)
        elif "from" in turn:
            content_key = "value"
            role, content = turn["from"], _get(turn, content_key)
        else:
            raise BadSample(idx, "bad_format", f"turn {n} has neither 'role' nor 'from'")
        if not isinstance(role, str):
            raise BadSample(idx, "bad_type", f"turn {n}: role must be a string, got {_tname(role)}")
        mapped = ROLE_MAP.get(role.strip().lower())
        if mapped is None:
            raise BadSample(idx, "unknown_role", f"turn {n}: unknown role {role!r}")
        out.append(Turn(mapped, _content(idx, n, content_key, content)))
    return Conversation(idx, tuple(out))


#: A key present with a null value (told apart from a missing key: "content is null").
_NULL = object()


def _get(turn: dict[str, Any], key: str) -> Any:
    if key in turn and turn[key] is None:
        return _NULL
    return turn.get(key)


def _content(idx: int, n: int, key: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text parts can be templated
        texts = []
        for part in content:
            if (
                isinstance(part, dict)
                and part.get("type", "text") == "text"
                and isinstance(part.get("text"), str)
            ):
                texts.append(part["text"])
            else:
                raise BadSample(idx, "bad_type", f"turn {n}: only text content parts are supported")
        return "".join(texts)
    if content is None:
        raise BadSample(idx, "bad_type", f"turn {n}: missing '{key}'")
    if content is _NULL:
        raise BadSample(idx, "bad_type", f"turn {n}: {key} is null")
    raise BadSample(idx, "bad_type", f"turn {n}: '{key}' must be a string, got {_tname(content)}")


def _int_list(idx: int, key: str, v: Any) -> list[int]:
    if not isinstance(v, list):
        raise BadSample(idx, "bad_type", f"'{key}' must be an array of integers, got {_tname(v)}")
    if v and set(map(type, v)) != _INT:  # one pass in C; the first bad one found for the words
        for i, x in enumerate(v):
            if type(x) is not int:  # bool is an int subclass: reject true/false too
                raise BadSample(
                    idx, "bad_type", f"'{key}'[{i}] must be an integer, got {_tname(x)}"
                )
    return v


_INT = {int}
_BITS = {0, 1}


def _pretokenized(idx: int, obj: dict[str, Any]) -> PreTokenized:
    for key in ("input_ids", "loss_mask"):
        if key not in obj:
            raise BadSample(idx, "bad_format", f"pre-tokenized sample without '{key}'")
    ids = _int_list(idx, "input_ids", obj["input_ids"])
    mask = _int_list(idx, "loss_mask", obj["loss_mask"])
    if not ids:
        raise BadSample(idx, "no_turns", "'input_ids' is empty")
    if len(ids) != len(mask):
        raise BadSample(
            idx,
            "length_mismatch",
            f"'input_ids' has {len(ids)} tokens but 'loss_mask' has {len(mask)}",
        )
    if min(ids) < 0:
        raise BadSample(idx, "bad_type", "'input_ids' has a negative id")
    if not _BITS.issuperset(mask):
        raise BadSample(idx, "bad_type", "'loss_mask' values must be 0 or 1")
    return PreTokenized(idx, ids, mask)
