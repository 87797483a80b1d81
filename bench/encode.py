#!/usr/bin/env python3
"""Benchmark of the dataset + tokenization path (eagle3d.ingest.dataset, eagle3d.ingest.chat).

Every figure is a ratio against a baseline measured in the same run, on the same data:

* ``encode``: :meth:`ChatEncoder.encode` (ids + loss mask derived from the template, 3 renders
  per assistant turn + 1) against ``tokenizer.apply_chat_template(tokenize=True)`` (ids only, no
  mask: the least work any pipeline does) and against Hugging Face's own mask path
  (``return_assistant_tokens_mask=True`` on the same template *with* ``{% generation %}``
  markers, which our encoder does not need).
* ``parse``: :func:`iter_samples` (read + JSON decode + validate) against a bare
  ``for line in file`` over the same file.
* ``count``: :func:`count_lines` against ``wc -l``.

Usage::

    .venv/bin/python bench/encode.py [--repeat 20] [--lines 200000] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "daemon" / "eagle3d" / "data" / "demo.jsonl"


def best_of(fn: Any, n: int = 3) -> float:
    """Best wall time of ``n`` calls (the least disturbed by other load on a shared machine)."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_encode(model_dir: str, repeat: int) -> dict[str, Any]:
    from eagle3d.ingest.chat import ChatEncoder
    from eagle3d.ingest.dataset import Conversation, iter_samples
    from eagle3d.tools.tinymodel import CHAT_TEMPLATE
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = ChatEncoder(tok)
    convs = [s for _, s in iter_samples(DEMO) if isinstance(s, Conversation)] * repeat
    msgs = [c.messages() for c in convs]
    marked = CHAT_TEMPLATE.replace(
        "{{ message['content'] }}<|end|>",
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|end|>"
        "{% endgeneration %}{% else %}{{ message['content'] }}<|end|>{% endif %}",
    )
    tokens = sum(len(enc.encode(c).input_ids) for c in convs[: len(convs) // repeat]) * repeat

    ours = best_of(lambda: [enc.encode(c) for c in convs])
    ids_only = best_of(lambda: [tok.apply_chat_template(m, tokenize=True) for m in msgs])
    hf_mask = best_of(
        lambda: [
            tok.apply_chat_template(
                m,
                chat_template=marked,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
            )
            for m in msgs
        ]
    )
    n = len(convs)
    return {
        "samples": n,
        "tokens": tokens,
        "ours_samples_per_s": n / ours,
        "ours_tokens_per_s": tokens / ours,
        "hf_ids_only_samples_per_s": n / ids_only,
        "hf_generation_mask_samples_per_s": n / hf_mask,
        "ratio_vs_hf_ids_only": ids_only / ours,
        "ratio_vs_hf_generation_mask": hf_mask / ours,
    }


def bench_parse(lines: int) -> dict[str, Any]:
    from eagle3d.ingest.dataset import count_lines, iter_samples

    demo = DEMO.read_bytes().splitlines(keepends=True)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "big.jsonl"
        with open(path, "wb") as f:
            for i in range(lines):
                f.write(demo[i % len(demo)])
        size = path.stat().st_size

        def bare() -> None:
            with open(path, "rb") as f:
                for _ in f:
                    pass

        def ours() -> None:
            for _ in iter_samples(path):
                pass

        def wc() -> None:
            subprocess.run(["wc", "-l", str(path)], check=True, capture_output=True)

        t_bare, t_ours = best_of(bare), best_of(ours)
        t_wc, t_count = best_of(wc), best_of(lambda: count_lines(path))
    return {
        "lines": lines,
        "bytes": size,
        "parse_lines_per_s": lines / t_ours,
        "parse_mb_per_s": size / t_ours / 1e6,
        "bare_read_lines_per_s": lines / t_bare,
        "parse_ratio_vs_bare_read": t_bare / t_ours,
        "count_mb_per_s": size / t_count / 1e6,
        "wc_mb_per_s": size / t_wc / 1e6,
        "count_ratio_vs_wc": t_wc / t_count,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20, help="passes over the demo dataset")
    parser.add_argument("--lines", type=int, default=200_000, help="lines of the parse file")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from eagle3d.tools.tinymodel import build_tiny_model

    with tempfile.TemporaryDirectory() as d:
        model = build_tiny_model(Path(d) / "tiny")
        result = {"encode": bench_encode(model, args.repeat), "parse": bench_parse(args.lines)}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    e, p = result["encode"], result["parse"]
    print(f"encode: {e['samples']} samples, {e['tokens']} tokens (tiny tokenizer, demo data)")
    print(
        f"  ours (ids + mask)      {e['ours_samples_per_s']:9.0f} samples/s "
        f"{e['ours_tokens_per_s']:10.0f} tokens/s"
    )
    print(
        f"  HF ids only            {e['hf_ids_only_samples_per_s']:9.0f} samples/s "
        f"-> ratio {e['ratio_vs_hf_ids_only']:.2f}"
    )
    print(
        f"  HF {{% generation %}}    {e['hf_generation_mask_samples_per_s']:9.0f} samples/s "
        f"-> ratio {e['ratio_vs_hf_generation_mask']:.2f}"
    )
    print(f"parse: {p['lines']} lines, {p['bytes'] / 1e6:.1f} MB")
    print(
        f"  iter_samples           {p['parse_lines_per_s']:9.0f} lines/s "
        f"({p['parse_mb_per_s']:.0f} MB/s) -> {p['parse_ratio_vs_bare_read']:.2f} x bare read"
    )
    print(
        f"  count_lines            {p['count_mb_per_s']:9.0f} MB/s -> "
        f"{p['count_ratio_vs_wc']:.2f} x wc -l"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
