#!/usr/bin/env python3
"""Generate the bundled demo dataset ``daemon/eagle3d/data/demo.jsonl`` deterministically.

    python scripts/make_demo_dataset.py            # rewrite the bundled file
    python scripts/make_demo_dataset.py --check    # exit 1 if the bundled file differs

The file holds 300 lines: multi-turn conversations in the three accepted formats
(``conversations`` with role/content or ShareGPT from/value, OpenAI ``messages``, and
pre-tokenized ``input_ids``/``loss_mask``), of varied lengths, some with a system prompt,
plus three deliberately malformed lines (bad JSON, unknown role, empty conversation) at
fixed line numbers so that the demo shows failure reporting.

The output depends only on this script (a seeded ``random.Random``; no clock, no hashing of
dicts), so the tiny model's tokenizer, which trains on this file's text, is reproducible.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

SEED = 20261129
N_LINES = 300
#: 0-based sample ids (= line numbers - 1) of the deliberately malformed lines.
MALFORMED = {41: "bad_json", 142: "unknown_role", 263: "empty"}
#: Pre-tokenized ids stay below 263 = 7 special tokens + 256 byte-level base symbols, so they
#: are valid for any tiny tokenizer built from this file, whatever its requested vocab size.
PRETOKENIZED_MAX_ID = 263

OUT = Path(__file__).resolve().parent.parent / "daemon" / "eagle3d" / "data" / "demo.jsonl"

TOPICS = [
    ("rivers", ["water", "delta", "flood", "current", "bank", "silt", "bridge"]),
    ("baking", ["flour", "oven", "yeast", "crust", "dough", "sugar", "butter"]),
    ("astronomy", ["star", "orbit", "comet", "planet", "telescope", "galaxy", "moon"]),
    ("gardening", ["soil", "seed", "compost", "root", "leaf", "sunlight", "pruning"]),
    ("databases", ["index", "query", "table", "journal", "transaction", "replica", "lock"]),
    ("music", ["chord", "rhythm", "melody", "tempo", "scale", "harmony", "octave"]),
    ("cycling", ["gear", "chain", "saddle", "brake", "tyre", "climb", "cadence"]),
    ("chess", ["pawn", "bishop", "opening", "endgame", "castle", "tempo", "file"]),
    ("weather", ["cloud", "pressure", "front", "rain", "humidity", "wind", "storm"]),
    ("python", ["function", "generator", "list", "module", "exception", "decorator", "loop"]),
    ("geology", ["rock", "magma", "fault", "quartz", "erosion", "layer", "crystal"]),
    ("cooking", ["onion", "garlic", "simmer", "pan", "salt", "stock", "herb"]),
]
ADJ = ["small", "large", "quiet", "bright", "careful", "slow", "quick", "old", "new", "simple"]
VERB = ["changes", "shapes", "follows", "supports", "limits", "explains", "drives", "hides"]
OPENERS = [
    "Can you explain how",
    "Why does",
    "What happens when",
    "Give me a short note on how",
    "I am curious whether",
    "Please describe how",
    "Is it true that",
]
SYSTEMS = [
    "You are a helpful assistant.",
    "You are a concise tutor. Answer in short paragraphs.",
    "You are an expert who explains things step by step.",
    "Réponds brièvement et clairement.",
    "You answer with lists when possible.",
]
EXTRAS = [
    "Héllo wörld!",
    "naïve café",
    "🚀 launch",
    "数据集",
    "x = [i * i for i in range(10)]",
    "2 + 2 = 4",
    "e.g. 3.14159",
    "tab\there",
]


def sentence(rng: random.Random, words: list[str]) -> str:
    a, b = rng.sample(words, 2)
    s = f"The {rng.choice(ADJ)} {a} {rng.choice(VERB)} the {b}"
    if rng.random() < 0.3:
        s += f" when the {rng.choice(words)} is {rng.choice(ADJ)}"
    if rng.random() < 0.08:
        s += f" ({rng.choice(EXTRAS)})"
    return s + rng.choice([".", ".", ".", "!", ";"])


def question(rng: random.Random, topic: str, words: list[str]) -> str:
    a, b = rng.sample(words, 2)
    q = f"{rng.choice(OPENERS)} the {a} {rng.choice(VERB)} the {b} in {topic}?"
    if rng.random() < 0.25:
        q = sentence(rng, words) + " " + q
    return q


def answer(rng: random.Random, words: list[str], size: int) -> str:
    """An answer of ``size`` sentences, sometimes as a list or with a code block."""
    style = rng.random()
    if size == 0:
        return rng.choice(["Yes.", "No.", "Sure!", "OK", "It depends."])
    if style < 0.2:
        return "\n".join(f"{i + 1}. {sentence(rng, words)}" for i in range(size))
    if style < 0.3:
        body = "\n".join(f"    {w} = {rng.randint(0, 99)}" for w in rng.sample(words, 3))
        return f"{sentence(rng, words)}\n```python\ndef example():\n{body}\n```\n{sentence(rng, words)}"
    paras = []
    left = size
    while left > 0:
        n = min(left, rng.randint(1, 4))
        paras.append(" ".join(sentence(rng, words) for _ in range(n)))
        left -= n
    return "\n\n".join(paras)


def conversation(rng: random.Random) -> list[tuple[str, str]]:
    """A list of (role, text) with role in system/user/assistant."""
    topic, words = rng.choice(TOPICS)
    turns: list[tuple[str, str]] = []
    if rng.random() < 0.3:
        turns.append(("system", rng.choice(SYSTEMS)))
    # Length mix: mostly short, some long (a few hundred tokens), a few one-liners.
    r = rng.random()
    n_rounds = 1 if r < 0.35 else rng.randint(2, 3) if r < 0.85 else rng.randint(4, 6)
    for _ in range(n_rounds):
        turns.append(("user", question(rng, topic, words)))
        size = rng.choice([0, 1, 1, 2, 3, 5]) if rng.random() < 0.8 else rng.randint(8, 25)
        turns.append(("assistant", answer(rng, words, size)))
    if rng.random() < 0.05:  # a trailing user turn (no answer): masked out, still valid
        turns.append(("user", question(rng, topic, words)))
    return turns


SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


def encode_line(rng: random.Random, idx: int) -> str:
    if idx in MALFORMED:
        kind = MALFORMED[idx]
        if kind == "bad_json":
            return '{"conversations": [{"role": "user", "content": "unterminated'
        if kind == "unknown_role":
            return json.dumps(
                {"conversations": [{"role": "wizard", "content": "Cast a spell."}]},
                ensure_ascii=False,
            )
        return json.dumps({"conversations": []})
    fmt = rng.random()
    if fmt < 0.1:
        n = rng.choice([3, 8, 20, 60, 150, 300])
        ids = [rng.randrange(7, PRETOKENIZED_MAX_ID) for _ in range(n)]
        cut = rng.randrange(1, n)
        mask = [0] * cut + [1] * (n - cut)
        return json.dumps({"input_ids": ids, "loss_mask": mask}, separators=(",", ":"))
    turns = conversation(rng)
    if fmt < 0.45:
        msgs = [{"role": r, "content": t} for r, t in turns]
        return json.dumps({"id": f"rc-{idx}", "conversations": msgs}, ensure_ascii=False)
    if fmt < 0.75:
        msgs = [{"from": SHAREGPT_ROLE[r], "value": t} for r, t in turns]
        return json.dumps({"id": f"sg-{idx}", "conversations": msgs}, ensure_ascii=False)
    msgs = [{"role": r, "content": t} for r, t in turns]
    return json.dumps({"messages": msgs}, ensure_ascii=False)


def generate() -> str:
    rng = random.Random(SEED)
    return "".join(encode_line(rng, i) + "\n" for i in range(N_LINES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare with the bundled file")
    parser.add_argument("--output", type=Path, default=OUT)
    args = parser.parse_args(argv)
    text = generate()
    if args.check:
        same = args.output.exists() and args.output.read_text(encoding="utf-8") == text
        print(f"{args.output}: {'up to date' if same else 'DIFFERS'}")
        return 0 if same else 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output} ({len(text.encode())} bytes, {N_LINES} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
