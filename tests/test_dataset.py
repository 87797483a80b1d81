"""Tests of eagle3d.ingest.dataset: line ids, formats, malformed lines, sharding, bounded memory."""

from __future__ import annotations

import json
import pickle
import tracemalloc
from pathlib import Path

import pytest
from eagle3d.ingest.dataset import (
    BadSample,
    Conversation,
    PreTokenized,
    Turn,
    count_lines,
    iter_lines,
    iter_samples,
    parse_line,
)

DEMO = Path(__file__).resolve().parent.parent / "daemon" / "eagle3d" / "data" / "demo.jsonl"


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("data", "lines"),
    [
        (b"", 0),
        (b"a\n", 1),
        (b"a", 1),
        (b"a\nb", 2),
        (b"a\n\nb\n", 3),
        (b"\n", 1),
        (b"a\r\nb\r\n", 2),
    ],
)
def test_count_lines_agrees_with_iteration(tmp_path: Path, data: bytes, lines: int) -> None:
    p = write(tmp_path / "d.jsonl", data)
    assert count_lines(p) == lines
    got = list(iter_lines(p))
    assert [i for i, _ in got] == list(range(lines))
    assert all(not raw.endswith((b"\n", b"\r")) for _, raw in got)


def test_count_lines_across_chunks(tmp_path: Path) -> None:
    # 3 MB of lines of varying length: crosses the 1 MiB chunk boundary several times.
    rows = [b"x" * (i % 997) for i in range(6000)]
    p = write(tmp_path / "big.jsonl", b"\n".join(rows))  # no final newline
    assert count_lines(p) == len(rows)
    assert [raw for _, raw in iter_lines(p)] == rows


def test_all_formats_parse() -> None:
    role = {
        "conversations": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"},
        ],
        "id": "ignored",
    }
    sharegpt = {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "U"},
            {"from": "gpt", "value": "A"},
        ]
    }
    openai = {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "U"}]},
            {"role": "assistant", "content": "A"},
        ]
    }
    want = (Turn("system", "S"), Turn("user", "U"), Turn("assistant", "A"))
    for n, obj in enumerate([role, sharegpt, openai]):
        raw = json.dumps(obj).encode()
        assert parse_line(n, raw) == Conversation(n, want)
        assert parse_line(n, raw.decode()) == Conversation(n, want)  # str accepted too
    pre = parse_line(7, b'{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}')
    assert pre == PreTokenized(7, [5, 6, 7], [0, 1, 1])
    assert Conversation(0, want).messages()[1] == {"role": "user", "content": "U"}


MALFORMED = [
    (b"", "blank", "blank line"),
    (b"   ", "blank", "blank line"),
    (b'{"conversations": [', "bad_json", "bad JSON"),
    (b"\xff\xfe{}", "bad_json", "bad JSON"),
    (b"[1, 2]", "bad_format", "expected a JSON object"),
    (b'{"text": "hi"}', "bad_format", "'text'"),
    (b'{"conversations": []}', "no_turns", "no turns"),
    (b'{"messages": []}', "no_turns", "no turns"),
    (b'{"conversations": {"role": "user"}}', "bad_type", "must be an array"),
    (b'{"conversations": ["hi"]}', "bad_type", "turn 0 must be an object"),
    (b'{"conversations": [{"content": "x"}]}', "bad_format", "neither 'role' nor 'from'"),
    (b'{"conversations": [{"role": "wizard", "content": "x"}]}', "unknown_role", "'wizard'"),
    (b'{"conversations": [{"from": "bot", "value": "x"}]}', "unknown_role", "'bot'"),
    (b'{"conversations": [{"role": 3, "content": "x"}]}', "bad_type", "role must be a string"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "bad_type", "'content' must be a string"),
    (b'{"messages": [{"role": "user"}]}', "bad_type", "missing 'content'"),
    (b'{"conversations": [{"from": "human"}]}', "bad_type", "missing 'value'"),
    (
        b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
        "bad_type",
        "text content parts",
    ),
    (b'{"input_ids": [1, 2], "loss_mask": [1]}', "length_mismatch", "2 tokens"),
    (b'{"input_ids": [1, 2]}', "bad_format", "without 'loss_mask'"),
    (b'{"input_ids": [], "loss_mask": []}', "no_turns", "empty"),
    (b'{"input_ids": ["1"], "loss_mask": [1]}', "bad_type", "'input_ids'[0] must be an integer"),
    (b'{"input_ids": [1], "loss_mask": [true]}', "bad_type", "'loss_mask'[0] must be an integer"),
    (b'{"input_ids": [1], "loss_mask": [2]}', "bad_type", "0 or 1"),
    (b'{"input_ids": [4, 2, 3.5, 1], "loss_mask": [1, 1, 1, 1]}', "bad_type", "'input_ids'[2]"),
    (b'{"input_ids": [4, 2], "loss_mask": [1, false]}', "bad_type", "'loss_mask'[1] must be"),
    (b'{"input_ids": [4, 2], "loss_mask": [0, -1]}', "bad_type", "0 or 1"),
    (b'{"input_ids": [-1], "loss_mask": [1]}', "bad_type", "negative"),
    (b'{"input_ids": 5, "loss_mask": [1]}', "bad_type", "array of integers"),
]


def test_each_malformed_kind_is_reported_with_its_line(tmp_path: Path) -> None:
    good = (
        b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}'
    )
    lines = []
    expected = {}
    for raw, error, text in MALFORMED:
        lines.append(good)
        expected[len(lines)] = (error, text)
        lines.append(raw)
    p = write(tmp_path / "bad.jsonl", b"\n".join(lines) + b"\n")
    seen = {}
    for idx, s in iter_samples(p):
        if isinstance(s, BadSample):
            assert s.idx == idx
            seen[idx] = s
        else:
            assert isinstance(s, Conversation)
            assert idx % 2 == 0
    assert sorted(seen) == sorted(expected)
    for idx, (error, text) in expected.items():
        bad = seen[idx]
        assert bad.error == error, (idx, bad)
        assert text in bad.reason, (idx, bad)
        assert str(bad).startswith(f"line {idx + 1} (sample {idx}): ")


def test_bad_sample_pickles() -> None:
    bad = BadSample(41, "bad_json", "bad JSON: truncated")
    back = pickle.loads(pickle.dumps(bad))
    assert (back.idx, back.error, back.reason, str(back)) == (
        41,
        "bad_json",
        "bad JSON: truncated",
        "line 42 (sample 41): bad JSON: truncated",
    )


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_sharding_picks_exactly_its_lines(tmp_path: Path, count: int) -> None:
    n = 103
    lines = [json.dumps({"input_ids": [i + 1], "loss_mask": [1]}).encode() for i in range(n)]
    lines[50] = b"{not json"  # only the shard that owns line 50 may see (and parse) it
    p = write(tmp_path / "d.jsonl", b"\n".join(lines) + b"\n")
    union: list[int] = []
    for index in range(count):
        got = list(iter_samples(p, index, count))
        ids = [i for i, _ in got]
        assert ids == [i for i in range(n) if i % count == index]
        for i, s in got:
            if i == 50:
                assert isinstance(s, BadSample) and s.error == "bad_json"
            else:
                assert isinstance(s, PreTokenized) and s.input_ids == [i + 1]
        union += ids
    assert sorted(union) == list(range(n))


def test_bad_shard_arguments(tmp_path: Path) -> None:
    p = write(tmp_path / "d.jsonl", b"{}\n")
    for index, count in [(1, 1), (-1, 2), (0, 0)]:
        with pytest.raises(ValueError):
            list(iter_lines(p, index, count))


def test_streaming_memory_is_bounded(tmp_path: Path) -> None:
    n = 200_000
    p = tmp_path / "big.jsonl"
    with open(p, "w") as f:
        for i in range(n):
            f.write(
                f'{{"messages": [{{"role": "user", "content": "question {i}"}}, '
                f'{{"role": "assistant", "content": "answer {i}"}}]}}\n'
            )
    size = p.stat().st_size
    assert size > 15_000_000
    assert count_lines(p) == n
    tracemalloc.start()
    try:
        last = -1
        kinds = 0
        for idx, s in iter_samples(p):
            assert idx == last + 1
            last = idx
            kinds += isinstance(s, Conversation)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (last + 1, kinds) == (n, n)
    # Everything parsed, yet the peak stays far below the file's size.
    assert peak < 2_000_000, f"peak {peak} bytes for a {size}-byte file"


def test_bundled_demo_dataset() -> None:
    assert DEMO.stat().st_size < 1_000_000
    kinds: dict[str, int] = {}
    bad = {}
    turns = []
    for idx, s in iter_samples(DEMO):
        kinds[type(s).__name__] = kinds.get(type(s).__name__, 0) + 1
        if isinstance(s, BadSample):
            bad[idx] = s.error
        elif isinstance(s, Conversation):
            turns.append(len(s.turns))
    assert count_lines(DEMO) == 300
    assert bad == {41: "bad_json", 142: "unknown_role", 263: "no_turns"}
    assert kinds["PreTokenized"] >= 10 and kinds["Conversation"] >= 250
    assert min(turns) == 2 and max(turns) >= 8  # single-round and multi-turn
    raw = DEMO.read_text()
    assert '"from": "human"' in raw and '"messages"' in raw and '"role": "system"' in raw


def test_demo_generator_is_deterministic_and_current(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = DEMO.parent.parent.parent.parent / "scripts" / "make_demo_dataset.py"
    out = tmp_path / "demo.jsonl"
    subprocess.run([sys.executable, str(script), "--output", str(out)], check=True)
    assert out.read_bytes() == DEMO.read_bytes()


def test_utf8_byte_order_mark_is_not_part_of_line_one(tmp_path: Path) -> None:
    line = b'{"input_ids": [1], "loss_mask": [1]}'
    p = write(tmp_path / "bom.jsonl", b"\xef\xbb\xbf" + line + b"\n" + line + b"\n")
    assert count_lines(p) == 2
    assert [s for _, s in iter_samples(p)] == [PreTokenized(0, [1], [1]), PreTokenized(1, [1], [1])]
    assert [i for i, _ in iter_samples(p, 1, 2)] == [1]
