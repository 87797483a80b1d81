"""Dataset files: which format a file is, how many rows it has, and its rows in order.

Formats, told apart by their content (never trusted from the name alone):

* ``jsonl`` - one JSON object per line (:mod:`eagle3d.ingest.dataset` parses each line);
* ``jsonl.gz`` / ``jsonl.zst`` - the same, gzip- or zstandard-compressed;
* ``json`` - one JSON array of sample objects;
* ``parquet`` - a table with a ``messages`` or ``conversations`` column (lists of
  role/content or from/value structs) or pre-tokenized ``input_ids`` and ``loss_mask``
  columns (pyarrow, from the ``extract`` extra).

The sample id is the 0-based row number in every format: a line of a JSONL file, an element
of a JSON array, a row of a parquet table. Blank lines keep their id but are no samples:
:func:`count` returns them so that the daemon skips them (counted as skipped, not failed).
Anything else (a directory, an unknown binary, a text file with no JSON object in it) is a
:class:`DatasetError` naming what was found, raised before a run starts.

Given a :class:`~eagle3d.ingest.pin.Pin`, :func:`count` and :func:`iter_rows` read the file
through its :class:`~eagle3d.ingest.pin.PinnedReader` (every format: the compressed ones are
checked before they are decompressed): a file changed since it was pinned raises
:class:`~eagle3d.ingest.pin.DatasetChanged` instead of yielding rows of another content.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

import msgspec

from eagle3d.ingest.dataset import BadSample, Sample, parse_line, parse_obj
from eagle3d.ingest.pin import Pin, open_pinned

if TYPE_CHECKING:
    from eagle3d.ingest.lineindex import Lines

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
PARQUET_MAGIC = b"PAR1"
_BOM = b"\xef\xbb\xbf"
_HEAD = 1 << 16
HINT = "eagle3d reads JSONL (.jsonl, .jsonl.gz, .jsonl.zst), a JSON array, or parquet"
_INSTALL = "install it with the extract extra: pip install 'eagle3d[extract]'"

#: The longest JSONL line read (``--max-line-bytes``): far above any real sample; a longer
#: line fails alone (its id named), read in pieces and never held whole.
MAX_LINE_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class TooLong:
    """A line longer than the limit, in place of its bytes (which were never held); or a
    JSON array's item, a parquet row, over the same limit (``unit``), never decoded."""

    nbytes: int
    limit: int
    unit: str = "line"


#: A row as read: a JSONL line's bytes or a parquet row's columns (or a line too long).
Row = bytes | dict[str, Any] | TooLong


class DatasetError(ValueError):
    """The file is not a dataset eagle3d can read; the message says what it is instead."""


@dataclass(frozen=True, slots=True)
class Format:
    name: str  # jsonl | jsonl.gz | jsonl.zst | json | parquet
    columns: tuple[str, ...] = ()  # parquet: the columns a sample is read from


def detect(path: str) -> Format:
    """The format of the dataset at ``path``. Raises DatasetError for anything else."""
    with open(path, "rb") as f:
        head = f.read(_HEAD)
    if head.startswith(GZIP_MAGIC):
        return _check_text(Format("jsonl.gz"), _peek(path, "jsonl.gz"))
    if head.startswith(ZSTD_MAGIC):
        return _check_text(Format("jsonl.zst"), _peek(path, "jsonl.zst"))
    if head.startswith(PARQUET_MAGIC):
        return Format("parquet", _parquet_columns(path))
    body = head.removeprefix(_BOM).lstrip()
    if body.startswith(b"["):
        try:
            _array(path)
        except msgspec.DecodeError as e:
            first = head.removeprefix(_BOM).split(b"\n", 1)[0]
            try:
                msgspec.json.decode(first)
            except msgspec.DecodeError:
                raise DatasetError(
                    f"starts like a JSON array but is not valid JSON ({e})"
                ) from None
            return Format("jsonl")  # JSONL whose first line happens to be an array
        return Format("json")
    return _check_text(Format("jsonl"), head)


def _check_text(fmt: Format, head: bytes) -> Format:
    """A JSONL body: text, with a JSON object starting one of its first lines."""
    if not head.strip():
        return fmt  # empty: no samples
    if b"\0" in head:
        raise DatasetError(f"a binary file, not {fmt.name} (starts with {head[:8]!r}); {HINT}")
    lines = head.removeprefix(_BOM).splitlines()
    if len(head) == _HEAD and len(lines) > 1:
        lines = lines[:-1]  # the last one may be cut
    bad = []
    for n, ln in enumerate(lines, 1):
        try:
            ln.decode()
        except UnicodeDecodeError as e:
            bad.append((n, e.start))
    # A line that is not UTF-8 fails alone (its id named); a file most of whose lines are
    # not is no text at all, and is refused naming where its first bad byte is.
    if bad and 2 * len(bad) > len(lines):
        n, at = bad[0]
        raise DatasetError(
            f"not UTF-8 text: {len(bad)} of its first {len(lines)} lines are not; the first"
            f" bad byte is on line {n}, byte {at + 1} of the line; {HINT}"
        )
    if not any(ln.lstrip().startswith(b"{") for ln in lines):
        raise DatasetError(f"no line starts a JSON object ({lines[0][:40]!r}...); {HINT}")
    return fmt


def _peek(path: str, name: str) -> bytes:
    try:
        with _open_text(path, name) as f:
            return f.read(_HEAD)
    except DatasetError:
        raise
    except Exception as e:  # gzip's OSError/EOFError, zstandard's ZstdError
        kind = {"jsonl.gz": "gzip", "jsonl.zst": "zstandard"}[name]
        raise DatasetError(f"a {kind} file that does not decompress ({e})") from e


def _open_raw(path: str, pin: Pin | None) -> IO[bytes]:
    """The file's bytes as stored: through the pin's checks when there is one."""
    if pin is not None:
        return open_pinned(pin)
    return open(path, "rb")


def _open_text(path: str, name: str, pin: Pin | None = None) -> IO[bytes]:
    if name == "jsonl.gz":
        return io.BufferedReader(gzip.GzipFile(fileobj=_open_raw(path, pin), mode="rb"))
    if name == "jsonl.zst":
        try:
            import zstandard
        except ImportError:
            raise DatasetError(f"a zstandard file, and zstandard is missing; {_INSTALL}") from None
        raw = _open_raw(path, pin)
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return _open_raw(path, pin)


def _parquet_columns(path: str) -> tuple[str, ...]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"a parquet file, and pyarrow is missing; {_INSTALL}") from None
    try:
        names = pq.ParquetFile(path).schema_arrow.names
    except Exception as e:
        raise DatasetError(f"a parquet file that does not open ({e})") from e
    if "input_ids" in names or "loss_mask" in names:
        return tuple(k for k in ("input_ids", "loss_mask") if k in names)
    for key in ("messages", "conversations"):
        if key in names:
            return (key,)
    raise DatasetError(
        "a parquet file without a 'messages', 'conversations' or 'input_ids'/'loss_mask'"
        f" column (columns: {', '.join(names[:10]) or 'none'})"
    )


def _array(path: str, pin: Pin | None = None) -> list[msgspec.Raw]:
    """A JSON array file's elements, each kept as its raw bytes (decoded one by one later)."""
    with _open_raw(path, pin) as f:
        data = f.read()
    if not data.strip():
        return []
    return msgspec.json.decode(data.removeprefix(_BOM), type=list[msgspec.Raw])


def count(
    path: str,
    fmt: Format,
    pin: Pin | None = None,
    max_line: int = MAX_LINE_BYTES,
    progress: Callable[[int, int], object] | None = None,
) -> tuple[int, list[int]]:
    """(rows, ids of blank lines) of the dataset: rows are the sample ids 0..rows-1;
    ``progress(rows, bytes)`` every chunk of a JSONL file (bytes: of the lines as read, after
    any decompression)."""
    found = index(path, fmt, pin, max_line, progress)
    return found.rows, found.blank


def index(
    path: str,
    fmt: Format,
    pin: Pin | None = None,
    max_line: int = MAX_LINE_BYTES,
    progress: Callable[[int, int], object] | None = None,
) -> Lines:
    """:func:`count`'s rows and blank ids, and for an uncompressed JSONL file each row's byte
    offset (:func:`rows_at` reads a row by it); a JSONL file is scanned with numpy, not a
    Python step a line (:mod:`eagle3d.ingest.lineindex`, numpy: imported here)."""
    from eagle3d.ingest.lineindex import Lines, scan

    if fmt.name == "json":
        return Lines(len(_array(path, pin)), [])
    if fmt.name == "parquet":
        import pyarrow.parquet as pq

        with _open_raw(path, pin) as f:
            return Lines(int(pq.ParquetFile(f).metadata.num_rows), [])
    with _open_text(path, fmt.name, pin) as f:
        return scan(f, max_line, fmt.name == "jsonl", progress)


def rows_at(
    path: str, fmt: Format, ids: Sequence[int], starts: Any = None, max_line: int = MAX_LINE_BYTES
) -> Iterator[tuple[int, Row]]:
    """``(idx, row)`` for the rows ``ids`` (ascending): each read at its offset in ``starts``
    (:func:`index`'s, an uncompressed JSONL file); otherwise the file is read in order up to
    the last of them."""
    if not ids:
        return
    if starts is None or fmt.name != "jsonl":
        wanted, last = set(ids), ids[-1]
        for idx, row in iter_rows(path, fmt, max_line=max_line):
            if idx in wanted:
                yield idx, row
            if idx >= last:
                return
        return
    with open(path, "rb") as f:
        for idx in ids:
            f.seek(int(starts[idx]))
            yield idx, _one_line(f, max_line)


def _one_line(f: IO[bytes], max_line: int) -> bytes | TooLong:
    """The line at ``f``'s position (see :func:`_finish_line`)."""
    return _finish_line(f, f.readline(max_line + 2), max_line)  # room for its own \r\n


def _finish_line(f: IO[bytes], line: bytes, max_line: int) -> bytes | TooLong:
    """``line`` as read by ``readline(max_line + 2)``, its ending removed; a
    :class:`TooLong` past ``max_line`` bytes, the rest of it read past in pieces."""
    ended = line.endswith(b"\n")
    if ended:
        line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
    if len(line) > max_line or (not ended and len(line) == max_line + 2):
        n = len(line)
        while not ended and (more := f.readline(1 << 20)):  # the rest, not held
            ended = more.endswith(b"\n")
            n += len(more) - (1 if ended else 0)
        return TooLong(n, max_line)
    return line


def _lines(
    path: str, fmt: Format, pin: Pin | None = None, max_line: int = MAX_LINE_BYTES, at: int = 0
) -> Iterator[bytes | TooLong]:
    """The lines of a JSONL file (compressed or not), line endings removed; a line longer
    than ``max_line`` bytes is a :class:`TooLong`, read past in pieces. ``at``: the byte
    offset of a line to start from (an uncompressed file)."""
    with _open_text(path, fmt.name, pin) as f:
        first = not at
        if at:
            f.seek(at)
        while line := f.readline(max_line + 2):  # room for the line's own \r\n
            if first:
                line = line.removeprefix(_BOM)  # not part of line 1's JSON
                first = False
            yield _finish_line(f, line, max_line)


def iter_rows(
    path: str,
    fmt: Format,
    shard_index: int = 0,
    shard_count: int = 1,
    pin: Pin | None = None,
    max_line: int = MAX_LINE_BYTES,
    skip_to: tuple[int, int] | None = None,
) -> Iterator[tuple[int, Row]]:
    """``(idx, row)`` for the rows with ``idx % shard_count == shard_index``, in order;
    ``skip_to``: (a row id, its byte offset from :func:`index`) of an uncompressed JSONL file,
    where reading starts (the rows before it are not read)."""
    if fmt.name == "parquet":
        yield from _parquet_rows(path, fmt, shard_index, shard_count, pin, max_line)
        return
    first, at = skip_to if skip_to is not None and fmt.name == "jsonl" else (0, 0)
    rows: Iterator[Any] = (
        _items(path, pin, max_line) if fmt.name == "json" else _lines(path, fmt, pin, max_line, at)
    )
    for idx, row in enumerate(rows, first):
        if idx % shard_count == shard_index:
            yield idx, row if isinstance(row, TooLong) else bytes(row)


def _items(path: str, pin: Pin | None, max_line: int) -> Iterator[msgspec.Raw | TooLong]:
    """A JSON array's items; one over ``max_line`` bytes is a :class:`TooLong`, never
    decoded (the array itself is read whole: its format has no lines to read by)."""
    for raw in _array(path, pin):
        yield TooLong(len(raw), max_line, "item") if len(raw) > max_line else raw


def _parquet_rows(
    path: str, fmt: Format, shard_index: int, shard_count: int, pin: Pin | None, max_line: int
) -> Iterator[tuple[int, Row]]:
    """A parquet table's rows; one whose columns take over ``max_line`` bytes is a
    :class:`TooLong`, never made into Python objects."""
    import pyarrow.parquet as pq

    idx = 0
    with _open_raw(path, pin) as f:
        table = pq.ParquetFile(f)
        for batch in table.iter_batches(batch_size=1024, columns=list(fmt.columns)):
            for i in range(batch.num_rows):
                if idx % shard_count == shard_index:
                    one = batch.slice(i, 1)
                    size = int(one.nbytes)  # the buffers this row's slice refers to
                    if size > max_line:
                        yield idx, TooLong(size, max_line, "row")
                    else:
                        yield idx, {k: _drop_nulls(v) for k, v in one.to_pylist()[0].items()}
                idx += 1


def _drop_nulls(v: Any) -> Any:
    # A parquet struct has every field of its schema: a ShareGPT turn read from a table that
    # also has role/content rows carries role=None. Absent, not null, is what a line means.
    if isinstance(v, list):
        return [_drop_nulls(x) for x in v]
    if isinstance(v, dict):
        return {k: _drop_nulls(x) for k, x in v.items() if x is not None}
    return v


def unit(fmt: Format) -> str:
    """What one row of ``fmt`` is called in messages: a JSONL ``line``, a parquet ``row``,
    a JSON array's ``item`` (numbered from 1, with the sample id beside it)."""
    return {"parquet": "row", "json": "item"}.get(fmt.name, "line")


def parse_row(idx: int, row: Row) -> Sample:
    """Parse one row of any format, or raise :class:`BadSample` saying why not."""
    if isinstance(row, dict):
        return parse_obj(idx, row)
    if isinstance(row, TooLong):
        raise BadSample(
            idx,
            f"{row.unit}_too_long",
            f"the {row.unit} is {row.nbytes:,} bytes, over the limit of {row.limit:,}"
            " (--max-line-bytes); not read",
        )
    return parse_line(idx, row)


__all__ = [
    "HINT",
    "MAX_LINE_BYTES",
    "BadSample",
    "DatasetError",
    "Format",
    "TooLong",
    "count",
    "detect",
    "index",
    "iter_rows",
    "parse_row",
    "rows_at",
    "unit",
]
