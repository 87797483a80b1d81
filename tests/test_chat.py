"""Tests of eagle3d.ingest.chat: the loss mask comes from the template and marks exactly the assistant.

Two independent oracles: (1) decoding the marked token runs must give back each assistant
turn's content plus its end-of-turn token, taken from the dataset, not from the encoder; (2) the
same template written *with* ``{% generation %}`` markers, fed to Hugging Face's own
``return_assistant_tokens_mask``, must give the same mask as ours on the unmarked template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from eagle3d.ingest.chat import ChatEncoder
from eagle3d.ingest.dataset import BadSample, Conversation, PreTokenized, Turn, iter_samples

DEMO = Path(__file__).resolve().parent.parent / "daemon" / "eagle3d" / "data" / "demo.jsonl"

GS, GE = "{% generation %}", "{% endgeneration %}"

TINY = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>{{ message['content'] }}<|end|>"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}<|end|>"
    "{% else %}<|assistant|>{GS}{{ message['content'] }}<|end|>{GE}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Qwen2.5-like ChatML: default system prompt, a newline after every <|im_end|>.
CHATML = (
    "{% if messages[0]['role'] != 'system' %}"
    "<|im_start|>system{{ '\\n' }}You are a helpful assistant.<|im_end|>{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}{{ '\\n' }}"
    "{% if m['role'] == 'assistant' %}{GS}{{ m['content'] }}<|im_end|>{GE}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)
# Llama-3-like: headers, trimmed content, <|eot_id|>.
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>{{ '\\n\\n' }}"
    "{% if m['role'] == 'assistant' %}{GS}{{ m['content'] | trim }}<|eot_id|>{GE}"
    "{% else %}{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>{{ '\\n\\n' }}{% endif %}"
)
# Mistral-like: no assistant header at all, eos ends the turn, strict alternation.
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %}{GS}{{ m['content'] }}{{ eos_token }}{GE}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported') }}{% endif %}"
    "{% endfor %}"
)
# Plain text: no special token ends a turn; the blank line is the only end marker.
PLAIN = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}Assistant: {GS}{{ m['content'] }}"
    "{{ '\\n\\n' }}{GE}{% else %}{{ m['role'] | capitalize }}: {{ m['content'] }}{{ '\\n\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}Assistant: {% endif %}"
)
# Qwen3-like: an (empty) think block only on assistant turns after the last user turn, so a
# turn renders differently once a later user turn exists (not prefix-consistent).
QWEN3 = (
    "{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}{%- for m in messages %}{%- if m['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{GS}{%- if loop.index0 > ns.last_user %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{{- m['content'] }}<|im_end|>{GE}"
    "{{- '\\n' }}{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TEMPLATES = {
    "tiny": (TINY, [], "<|end|>"),
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "llama3": (LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
    "mistral": (MISTRAL, [], "<|eos|>"),
    "plain": (PLAIN, [], "\n\n"),
    "qwen3": (QWEN3, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
}


def unmarked(template: str) -> str:
    return template.replace("{GS}", "").replace("{GE}", "")


def marked(template: str) -> str:
    return template.replace("{GS}", GS).replace("{GE}", GE)


def load_tokenizer(model_dir: Path, specials: list[str]) -> Any:
    """A fresh copy of the tiny tokenizer, with a model family's special tokens added."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if specials:
        tok.add_tokens(specials, special_tokens=True)
    return tok


def encoder(model_dir: Path, name: str, **kw: Any) -> ChatEncoder:
    template, specials, _ = TEMPLATES[name]
    return ChatEncoder(load_tokenizer(model_dir, specials), chat_template=unmarked(template), **kw)


def demo_conversations() -> list[Conversation]:
    return [s for _, s in iter_samples(DEMO) if isinstance(s, Conversation)]


def marked_runs(tok: Any, ids: list[int], mask: list[int]) -> list[str]:
    """Decode each maximal run of consecutive mask-1 tokens."""
    runs: list[list[int]] = []
    prev = 0
    for i, m in zip(ids, mask, strict=True):
        if m:
            if not prev:
                runs.append([])
            runs[-1].append(i)
        prev = m
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def conv(*turns: tuple[str, str], idx: int = 0) -> Conversation:
    return Conversation(idx, tuple(Turn(r, c) for r, c in turns))


def test_tiny_template_marks_exactly_the_assistant_tokens(tiny_model_dir: Path) -> None:
    enc = ChatEncoder.from_pretrained(tiny_model_dir)
    tok = enc.tokenizer
    convs = [c for c in demo_conversations() if any(t.role == "assistant" for t in c.turns)]
    assert len(convs) > 250
    for c in convs:
        out = enc.encode(c)
        assert len(out.input_ids) == len(out.loss_mask) == out.full_length
        assert not out.truncated
        want = [t.content + "<|end|>" for t in c.turns if t.role == "assistant"]
        assert marked_runs(tok, out.input_ids, out.loss_mask) == want, c.idx
        # Everything else (bos, system, user turns, headers) is unmarked and the ids are the
        # template's text, tokenized once.
        assert tok.decode(out.input_ids, skip_special_tokens=False) == tok.apply_chat_template(
            c.messages(), tokenize=False
        )


@pytest.mark.parametrize("name", ["chatml", "llama3", "mistral"])
def test_other_templates_mark_content_and_end_token(tiny_model_dir: Path, name: str) -> None:
    enc = encoder(tiny_model_dir, name)
    end = TEMPLATES[name][2]
    n = 0
    for c in demo_conversations():
        if name == "mistral" and c.turns[0].role == "system":
            continue
        if name == "mistral" and c.turns[-1].role == "user":
            continue  # would still be fine, but keeps the alternation check below simple
        out = enc.encode(c)
        strip = str.strip if name == "llama3" else str
        want = [strip(t.content) + end for t in c.turns if t.role == "assistant"]
        assert marked_runs(enc.tokenizer, out.input_ids, out.loss_mask) == want, (name, c.idx)
        n += 1
    assert n > 150


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_same_mask_as_hf_generation_markers(tiny_model_dir: Path, name: str) -> None:
    template, specials, _ = TEMPLATES[name]
    tok = load_tokenizer(tiny_model_dir, specials)
    enc = ChatEncoder(tok, chat_template=unmarked(template))
    n = 0
    for c in demo_conversations():
        if name == "mistral" and c.turns[0].role == "system":
            continue
        hf = tok.apply_chat_template(
            c.messages(),
            chat_template=marked(template),
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        out = enc.encode(c)
        assert out.input_ids == list(hf["input_ids"]), (name, c.idx)
        assert out.loss_mask == list(hf["assistant_masks"]), (name, c.idx)
        n += 1
    assert n > 150


def test_chatml_newline_after_end_token_is_filler(tiny_model_dir: Path) -> None:
    enc = encoder(tiny_model_dir, "chatml")
    tok = enc.tokenizer
    c = conv(("user", "Hi"), ("assistant", "Hello!"), ("user", "More?"), ("assistant", "Yes."))
    out = enc.encode(c)
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    nl = tok.encode("\n", add_special_tokens=False)
    assert len(nl) == 1
    ends = [i for i, t in enumerate(out.input_ids) if t == end_id]
    assert len(ends) == 5  # default system, 2 user, 2 assistant
    assistant_ends = [i for i in ends if out.loss_mask[i]]
    assert len(assistant_ends) == 2
    for i in ends:
        assert out.input_ids[i + 1] == nl[0] and out.loss_mask[i + 1] == 0
    assert marked_runs(tok, out.input_ids, out.loss_mask) == ["Hello!<|im_end|>", "Yes.<|im_end|>"]
    # The header "assistant\n" is prompt, not output.
    first = out.loss_mask.index(1)
    assert tok.decode(out.input_ids[first - 3 : first]) == "<|im_start|>assistant\n"


def test_template_transformations_are_followed(tiny_model_dir: Path) -> None:
    enc = encoder(tiny_model_dir, "llama3")
    c = conv(("user", "  q  "), ("assistant", "  padded answer \n"))
    out = enc.encode(c)
    assert marked_runs(enc.tokenizer, out.input_ids, out.loss_mask) == ["padded answer<|eot_id|>"]


def test_suffix_without_special_token_is_taken_whole(tiny_model_dir: Path) -> None:
    enc = encoder(tiny_model_dir, "plain")
    text, spans = enc.assistant_spans(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a b"}]
    )
    assert text == "User: q\n\nAssistant: a b\n\n"
    assert [text[s:e] for s, e in spans] == ["a b\n\n"]


def test_multibyte_and_empty_assistant_content(tiny_model_dir: Path) -> None:
    enc = ChatEncoder.from_pretrained(tiny_model_dir)
    content = "Héllo wörld 🚀 数据集 — naïve"
    c = conv(("user", "ü?"), ("assistant", content), ("user", "again"), ("assistant", ""))
    out = enc.encode(c)
    runs = marked_runs(enc.tokenizer, out.input_ids, out.loss_mask)
    assert runs == [content + "<|end|>", "<|end|>"]


def test_trailing_user_turn_is_unmarked(tiny_model_dir: Path) -> None:
    enc = ChatEncoder.from_pretrained(tiny_model_dir)
    out = enc.encode(conv(("user", "a"), ("assistant", "b"), ("user", "c")))
    assert marked_runs(enc.tokenizer, out.input_ids, out.loss_mask) == ["b<|end|>"]
    assert out.loss_mask[-3:] == [0, 0, 0]  # <|user|> c <|end|>


def test_renders_are_linear_in_assistant_turns(tiny_model_dir: Path) -> None:
    enc = ChatEncoder.from_pretrained(tiny_model_dir)
    calls = 0
    render = enc._render

    def counting(**kw: Any) -> str:
        nonlocal calls
        calls += 1
        return render(**kw)

    enc._render = counting
    turns = [("user", "q"), ("assistant", "a")] * 6
    enc.encode(conv(*turns))
    assert calls == 3 * 6 + 1


def test_no_assistant_turn_is_an_error(tiny_model_dir: Path) -> None:
    enc = ChatEncoder.from_pretrained(tiny_model_dir)
    with pytest.raises(BadSample) as e:
        enc.encode(conv(("system", "s"), ("user", "u"), idx=9))
    assert e.value.error == "no_assistant"
    assert str(e.value).startswith("line 10 (sample 9): ")


def test_template_errors_are_bad_samples(tiny_model_dir: Path) -> None:
    enc = encoder(tiny_model_dir, "mistral")
    with pytest.raises(BadSample) as e:
        enc.encode(conv(("user", "a"), ("user", "b"), ("assistant", "c"), idx=4))
    assert e.value.error == "template_error"
    assert "alternate" in e.value.reason and "line 5" in str(e.value)


def test_template_that_rewrites_earlier_turns_is_refused(tiny_model_dir: Path) -> None:
    # Like templates that drop past reasoning: earlier assistant turns render differently
    # once a later turn exists, so a prefix's spans would not hold in the full text.
    template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
        "<|assistant|>[old]<|end|>{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    enc = ChatEncoder(load_tokenizer(tiny_model_dir, []), chat_template=template)
    assert enc.encode(conv(("user", "a"), ("assistant", "b"))).loss_mask.count(1) == 2
    with pytest.raises(BadSample) as e:
        enc.encode(conv(("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")))
    assert e.value.error == "template_error" and "prefix" in e.value.reason


def test_empty_after_templating(tiny_model_dir: Path) -> None:
    template = "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
    enc = ChatEncoder(load_tokenizer(tiny_model_dir, []), chat_template=template)
    with pytest.raises(BadSample) as e:
        enc.encode(conv(("user", "u"), ("assistant", "a"), idx=2))
    assert e.value.error == "empty" and "line 3" in str(e.value)


def long_conversation() -> Conversation:
    return conv(
        ("system", "You are terse."),
        ("user", "Tell me about rivers and their banks in detail please."),
        ("assistant", "The quiet water follows the bank. " * 8),
        ("user", "And bridges?"),
        ("assistant", "The old bridge limits the current. " * 8),
        idx=17,
    )


def test_truncate_keeps_the_head(tiny_model_dir: Path) -> None:
    full = ChatEncoder.from_pretrained(tiny_model_dir).encode(long_conversation())
    n = len(full.input_ids)
    first_marked = full.loss_mask.index(1)
    for limit in (n, n + 1, 0):
        out = ChatEncoder.from_pretrained(tiny_model_dir, max_length=limit).encode(
            long_conversation()
        )
        assert (out.input_ids, out.loss_mask, out.truncated) == (
            full.input_ids,
            full.loss_mask,
            False,
        )
    limit = (first_marked + n) // 2
    out = ChatEncoder.from_pretrained(tiny_model_dir, max_length=limit).encode(long_conversation())
    assert out.truncated and out.full_length == n
    assert out.input_ids == full.input_ids[:limit]
    assert out.loss_mask == full.loss_mask[:limit]


def test_skip_refuses_over_length(tiny_model_dir: Path) -> None:
    n = len(ChatEncoder.from_pretrained(tiny_model_dir).encode(long_conversation()).input_ids)
    ok = ChatEncoder.from_pretrained(tiny_model_dir, max_length=n, on_overflow="skip")
    assert not ok.encode(long_conversation()).truncated
    enc = ChatEncoder.from_pretrained(tiny_model_dir, max_length=n - 1, on_overflow="skip")
    with pytest.raises(BadSample) as e:
        enc.encode(long_conversation())
    assert e.value.error == "too_long"
    assert f"{n} tokens > max_length {n - 1}" in e.value.reason and "line 18" in str(e.value)


def test_truncation_that_leaves_no_assistant_token(tiny_model_dir: Path) -> None:
    enc = ChatEncoder.from_pretrained(tiny_model_dir, max_length=5)
    with pytest.raises(BadSample) as e:
        enc.encode(long_conversation())
    assert e.value.error == "no_loss" and "max_length 5" in e.value.reason


def test_pretokenized_samples(tiny_model_dir: Path) -> None:
    enc = ChatEncoder.from_pretrained(tiny_model_dir, max_length=3)
    vocab = len(enc.tokenizer)
    out = enc.encode(PreTokenized(1, [10, 11, 12, 13], [0, 1, 1, 1]))
    assert (out.input_ids, out.loss_mask, out.truncated, out.full_length) == (
        [10, 11, 12],
        [0, 1, 1],
        True,
        4,
    )
    with pytest.raises(BadSample) as e:
        enc.encode(PreTokenized(2, [1, vocab], [1, 1]))
    assert e.value.error == "bad_token_id"
    with pytest.raises(BadSample) as e:
        enc.encode(PreTokenized(3, [1, 2], [0, 0]))
    assert e.value.error == "no_loss"


def test_constructor_checks(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir, [])
    with pytest.raises(ValueError, match="on_overflow"):
        ChatEncoder(tok, on_overflow="drop")
    with pytest.raises(ValueError, match="max_length"):
        ChatEncoder(tok, max_length=-1)
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        ChatEncoder(tok)


def test_leading_assistant_turn_with_a_template_that_needs_a_first_message(
    tiny_model_dir: Path,
) -> None:
    # ChatML with a default system prompt reads messages[0], so the empty conversation
    # (the prompt of a leading assistant turn) cannot be rendered.
    enc = encoder(tiny_model_dir, "chatml")
    with pytest.raises(Exception, match="no element 0"):
        enc.render([], add_generation_prompt=True)
    c = conv(("assistant", "Hi, how can I help?"), ("user", "x"), ("assistant", " y"))
    out = enc.encode(c)
    assert marked_runs(enc.tokenizer, out.input_ids, out.loss_mask) == [
        "Hi, how can I help?<|im_end|>",
        " y<|im_end|>",
    ]


def test_qwen3_like_template_that_is_not_prefix_consistent(tiny_model_dir: Path) -> None:
    enc = encoder(tiny_model_dir, "qwen3")
    c = conv(("user", "a"), ("assistant", "b1"), ("user", "c"), ("assistant", "d1"))
    assert not enc.render(c.messages()).startswith(enc.render(c.messages()[:2]))
    out = enc.encode(c)
    # The earlier turn has no think block in the full text; the last one has it, and the
    # model produces it (the server's prompt ends at "assistant\n").
    assert marked_runs(enc.tokenizer, out.input_ids, out.loss_mask) == [
        "b1<|im_end|>",
        "<think>\n\n</think>\n\nd1<|im_end|>",
    ]
    # A trailing user turn: no assistant turn keeps its think block.
    out = enc.encode(conv(("user", "a"), ("assistant", "b1"), ("user", "c")))
    assert marked_runs(enc.tokenizer, out.input_ids, out.loss_mask) == ["b1<|im_end|>"]


def test_named_templates_use_the_default_one(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir, [])
    tok.chat_template = {"default": unmarked(TINY), "tool_use": "{{ raise_exception('no') }}"}
    out = ChatEncoder(tok).encode(conv(("user", "q"), ("assistant", "a")))
    assert marked_runs(tok, out.input_ids, out.loss_mask) == ["a<|end|>"]


PIECES = [
    "",
    " ",
    "\n",
    "\n\n",
    "  padded  ",
    "<",
    ">",
    "|",
    "<|",
    "end",
    "assistant",
    "[/INST]",
    "User:",
    "\x00",
    "é",
    "🚀",
    "数据",
    "The quick tempo.",
    "x = [i for i in y]",
]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_tricky_contents_match_hf_generation_markers(tiny_model_dir: Path, name: str) -> None:
    """Seeded random conversations whose contents sit on the template's own boundaries."""
    import random

    rng = random.Random(f"tricky-{name}")
    template, specials, _ = TEMPLATES[name]
    tok = load_tokenizer(tiny_model_dir, specials)
    enc = ChatEncoder(tok, chat_template=unmarked(template))
    for _ in range(150):
        turns: list[tuple[str, str]] = []
        if name != "mistral" and rng.random() < 0.3:
            turns.append(("system", "sys"))
        for _ in range(rng.randint(1, 3)):
            for role in ("user", "assistant"):
                text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 4)))
                turns.append((role, text))
        c = conv(*turns)
        hf = tok.apply_chat_template(
            c.messages(),
            chat_template=marked(template),
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        out = enc.encode(c)
        assert out.input_ids == list(hf["input_ids"]), (name, turns)
        assert out.loss_mask == list(hf["assistant_masks"]), (name, turns)
