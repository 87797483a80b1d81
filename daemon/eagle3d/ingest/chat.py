"""Turn samples into token ids and a loss mask, using the tokenizer's own chat template.

API::

    enc = ChatEncoder(tokenizer, max_length=0, on_overflow="truncate")   # or "skip"
    enc = ChatEncoder.from_pretrained(model_dir, max_length=..., on_overflow=...)
    tok = enc.encode(sample)      # sample: dataset.Conversation | dataset.PreTokenized
    tok.input_ids, tok.loss_mask, tok.truncated, tok.full_length
    enc.render(messages, add_generation_prompt=False) -> str
    enc.assistant_spans(messages) -> (text, [(start, end), ...])   # character spans

``encode`` raises :class:`eagle3d.ingest.dataset.BadSample` (``error`` code in brackets) for a
conversation without an assistant turn (``no_assistant``), a template that raises or is not
prefix-consistent (``template_error``), an empty rendering (``empty``), a sample longer than
``max_length`` with ``on_overflow="skip"`` (``too_long``), a sample with no loss token left
(``no_loss``) and a pre-tokenized id outside the vocabulary (``bad_token_id``).

How the loss mask is derived (no ``{% generation %}`` markers needed, no string guessing).
For every assistant turn ``k`` the template is rendered three times:

* ``B`` = turns up to and including ``k``,
* ``Q`` = the same with turn ``k``'s content swapped for a one-character probe (``\\x00``),
* ``P`` = turns before ``k`` with ``add_generation_prompt=True`` (what a server would send).

``B`` and ``Q`` differ exactly where the template put the content, whatever it did to it (trim,
escape), so their common prefix and suffix give the content's place in ``B``. The assistant's
output starts where ``B`` departs from ``P``: after the header the server sends, so anything the
model itself writes before the content (e.g. a think block) is included. (A template that
cannot render ``P`` - one that reads ``messages[0]`` for a leading assistant turn - starts at
the content.) After the content comes the turn *suffix* (e.g. ``<|im_end|>\\n``): the
assistant produces it up to and including its first special token (the end-of-turn token, e.g.
``<|im_end|>``, ``<|eot_id|>``, ``</s>``); what follows (ChatML's newline, the next turn's
header) is template filler and gets 0. A suffix with no special token at all is taken entirely
(it is then the only thing that ends the turn).

``B`` is normally a prefix of the full rendering, so its spans hold there. Some templates
(Qwen3's) render a turn differently once later turns exist; then the content is located in the
full rendering by two more probe renderings, and the produced text around it is kept where the
full rendering has it. A template that drops or rewrites a turn's content in the full
conversation is reported as ``template_error`` rather than silently mis-masked.

The full conversation is tokenized once with offsets; a token gets 1 when its characters
overlap an assistant span. Cost per sample: ``3 * assistant_turns + 1`` template renders (each
a jinja call over a prefix; 2 more per turn for non-prefix-consistent templates) and one
fast-tokenizer call.

Decisions:

* A conversation without an assistant turn is an error (``no_assistant``): it has no
  training signal. Likewise any sample whose mask is all zero after truncation (``no_loss``),
  including pre-tokenized ones.
* Trailing user turns after the last assistant turn are kept (mask 0).
* ``max_length`` 0 means no limit; truncation keeps the head of the sample.
* Pre-tokenized samples bypass the template; their ids must be ``< len(tokenizer)``.
* Limitation: text in a message that spells a special token (e.g. ``<|end|>``) is tokenized as
  that special token, as in any pipeline that tokenizes the rendered text (and as Hugging
  Face's ``apply_chat_template`` does by default, ``sanitize_control_tokens=False``).
"""

from __future__ import annotations

import os
import threading
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from eagle3d.ingest import tokcache
from eagle3d.ingest.dataset import BadSample, Conversation, PreTokenized, Sample
from eagle3d.ingest.template import compile_template
from eagle3d.ingest.tokcache import TokenizerFacts

__all__ = ["ON_OVERFLOW", "ChatEncoder", "Tokenized", "TokenizerFacts", "encoder", "facts_of"]

ON_OVERFLOW = ("truncate", "skip")

#: With ``max_length`` set, a rendered text is tokenized only up to ``max_length`` times this
#: many characters (no real token is that long), so a 30 MB message is never tokenized whole.
CHARS_PER_TOKEN = 64
#: Tokens that end this close to the cut are not trusted (a word cut in half tokenizes
#: differently): only those before it are kept.
CUT_MARGIN = 4096


def facts_of(tokenizer: Any) -> TokenizerFacts:
    """The :class:`TokenizerFacts` of a Hugging Face tokenizer."""
    template_vars = {
        k: str(v) for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)
    }
    specials = set(tokenizer.all_special_tokens)
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(tok, "special", False):
            specials.add(str(tok.content))
    return TokenizerFacts(
        backend=getattr(tokenizer, "backend_tokenizer", None),
        chat_template=getattr(tokenizer, "chat_template", None),
        vocab_size=len(tokenizer),
        template_vars=template_vars,
        specials=frozenset(s for s in specials if s),
    )


@dataclass(slots=True)
class Tokenized:
    """A sample ready for the producer. ``full_length`` is the length before truncation."""

    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False
    full_length: int = 0
    #: ``full_length`` is an estimate: the text was cut before tokenizing (see
    #: :data:`CHARS_PER_TOKEN`) and its length scaled from the tokens of the part kept.
    estimated: bool = False


Messages = Sequence[dict[str, str]]


class ChatEncoder:
    """Tokenizes samples with a Hugging Face fast tokenizer and its chat template.

    ``chat_template`` overrides the tokenizer's own. The encoder keeps no per-sample state, so
    one instance can be shared.
    """

    def __init__(
        self,
        tokenizer: Any,
        max_length: int = 0,
        on_overflow: str = "truncate",
        *,
        chat_template: str | None = None,
    ) -> None:
        """``tokenizer``: a Hugging Face fast tokenizer, or the :class:`TokenizerFacts` of one
        (:mod:`eagle3d.ingest.tokcache` keeps them)."""
        if on_overflow not in ON_OVERFLOW:
            raise ValueError(f"on_overflow must be one of {ON_OVERFLOW}, got {on_overflow!r}")
        if max_length < 0:
            raise ValueError(f"max_length must be >= 0, got {max_length}")
        facts = tokenizer if isinstance(tokenizer, TokenizerFacts) else facts_of(tokenizer)
        template = chat_template or facts.chat_template
        if isinstance(template, dict):  # named templates: the default one formats chats
            template = template.get("default")
        if not template or not isinstance(template, str):
            raise ValueError("the tokenizer has no chat template")
        if facts.backend is None:
            raise ValueError("a fast (Rust-backed) tokenizer is needed: the mask uses its offsets")
        self.tokenizer = tokenizer
        self.facts = facts
        self.max_length = max_length
        self.on_overflow = on_overflow
        self.chat_template = template
        self.vocab_size = facts.vocab_size
        self._backend = facts.backend
        self._render = compile_template(template)
        self._template_vars = dict(facts.template_vars)
        # Longest first, so a token wins over a special token it contains.
        self._specials = sorted(facts.specials, key=len, reverse=True)

    @classmethod
    def from_pretrained(
        cls, model_dir: str | os.PathLike[str], max_length: int = 0, on_overflow: str = "truncate"
    ) -> ChatEncoder:
        """Load the tokenizer of a local model directory (never a hub) and wrap it."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(os.fspath(model_dir), local_files_only=True)
        return cls(tok, max_length, on_overflow)

    # -- rendering ---------------------------------------------------------------------------

    def render(self, messages: Messages, add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages`` (raises jinja's ``TemplateError``)."""
        return self._render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            **self._template_vars,
        )

    def assistant_spans(self, messages: Messages) -> tuple[str, list[tuple[int, int]]]:
        """The full rendering and the character spans the assistant produced in it."""
        msgs = list(messages)
        full = self.render(msgs)
        spans = []
        for k, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            before = msgs[:k]
            upto = self.render([*before, m])
            probe = self.render([*before, {**m, "content": _probe(m["content"])}])
            # The content's place in ``upto``: where the two renderings differ.
            content_start = _common_prefix(probe, upto)
            content_end = len(upto) - min(_common_suffix(probe, upto), len(upto) - content_start)
            try:
                prompt = self.render(before, add_generation_prompt=True)
                start = min(_common_prefix(prompt, upto), content_start)
            except Exception:
                # Some templates cannot render an empty conversation (``messages[0]``), the
                # prompt of a leading assistant turn: then the output starts with the content.
                start = content_start
            end = content_end + self._produced(upto[content_end:])
            if full.startswith(upto):
                spans.append((start, end))
            else:
                lead, trail = upto[start:content_start], upto[content_end:end]
                spans.append(self._relocate(msgs, k, lead, trail, full))
        return full, spans

    def _relocate(
        self, msgs: list[dict[str, str]], k: int, lead: str, trail: str, full: str
    ) -> tuple[int, int]:
        """Find turn ``k``'s span in ``full`` when the template renders it differently there.

        Templates like Qwen3's render a turn differently once later turns exist (an empty
        think block only after the last user turn). The turn's content is located in the full
        rendering by swapping it for two different one-character probes; what the assistant
        produces around the content (``lead``, e.g. a think block, and ``trail``, the
        end-of-turn token) is kept only where the full rendering has the same text there.
        """
        m = msgs[k]
        a = self.render([*msgs[:k], {**m, "content": "\x00"}, *msgs[k + 1 :]])
        b = self.render([*msgs[:k], {**m, "content": "\x01"}, *msgs[k + 1 :]])
        head, tail = _common_prefix(a, b), _common_suffix(a, b)
        if head == len(a) or not (full.startswith(a[:head]) and full.endswith(a[len(a) - tail :])):
            raise ValueError(
                f"chat template is not prefix-consistent and renders turn {k}'s content "
                "differently (or not at all) in the whole conversation"
            )
        cs, ce = head, len(full) - tail  # the content's place in the full rendering
        if full[ce : ce + len(trail)] != trail:
            raise ValueError(
                f"chat template is not prefix-consistent: turn {k} ends differently "
                "in the whole conversation"
            )
        if len(lead) <= cs and full[cs - len(lead) : cs] == lead:
            cs -= len(lead)
        return cs, ce + len(trail)

    def _produced(self, suffix: str) -> int:
        """How much of a turn suffix the assistant produces: up to its first special token."""
        best: tuple[int, int] | None = None
        for s in self._specials:
            i = suffix.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, i + len(s))
        return len(suffix) if best is None else best[1]

    # -- encoding ----------------------------------------------------------------------------

    def encode(self, sample: Sample) -> Tokenized:
        """Token ids and loss mask for one sample, or :class:`BadSample`."""
        if isinstance(sample, PreTokenized):
            if max(sample.input_ids, default=0) >= self.vocab_size:
                raise BadSample(
                    sample.idx, "bad_token_id", f"token id >= vocabulary size {self.vocab_size}"
                )
            return self._limit(sample.idx, list(sample.input_ids), list(sample.loss_mask))
        return self._encode_conversation(sample)

    def _encode_conversation(self, conv: Conversation) -> Tokenized:
        idx = conv.idx
        if not any(t.role == "assistant" for t in conv.turns):
            raise BadSample(idx, "no_assistant", "no assistant turn: nothing to train on")
        try:
            text, spans = self.assistant_spans(conv.messages())
        except Exception as e:  # jinja TemplateError, raise_exception(), prefix mismatch
            raise BadSample(idx, "template_error", f"chat template: {e}") from None
        if not text:
            raise BadSample(idx, "empty", "empty after applying the chat template")
        ids, offsets, full = self._tokenize_bounded(text)
        if not ids:
            raise BadSample(idx, "empty", "no tokens after applying the chat template")
        return self._limit(idx, ids, _mask(offsets, spans), full)

    def _tokenize_bounded(self, text: str) -> tuple[list[int], list[tuple[int, int]], int]:
        """``text`` tokenized, but with ``max_length`` set only as far as it must be: the
        first ``max_length * CHARS_PER_TOKEN`` characters (twice that, and so on, while they
        give no more than ``max_length`` trusted tokens). Returns the ids, their offsets and
        the text's length in tokens: exact when tokenized whole, else an estimate (> 0)."""
        cut = self.max_length * CHARS_PER_TOKEN + CUT_MARGIN
        while self.max_length and cut < len(text):
            ids, offsets = self._tokenize(text[:cut])
            keep = bisect_right([end for _, end in offsets], cut - CUT_MARGIN)
            if keep > self.max_length:
                covered = max(offsets[keep - 1][1], 1)
                estimate = max(keep + 1, round(keep * len(text) / covered))
                return ids[:keep], offsets[:keep], estimate
            cut *= 2
        ids, offsets = self._tokenize(text)
        return ids, offsets, 0

    def _tokenize(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self._backend.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets  # fresh lists from the Rust side

    def _limit(self, idx: int, ids: list[int], mask: list[int], estimate: int = 0) -> Tokenized:
        """Cut to ``max_length``; ``estimate``: the whole text's estimated length in tokens
        when only a part of it was tokenized (0: ``ids`` are all of it)."""
        n = estimate or len(ids)
        truncated = False
        if self.max_length and n > self.max_length:
            if self.on_overflow == "skip":
                about = "about " if estimate else ""
                raise BadSample(
                    idx,
                    "too_long",
                    f"{about}{n} tokens > max_length {self.max_length} (skipped)",
                )
            ids, mask, truncated = ids[: self.max_length], mask[: self.max_length], True
        if not any(mask):
            where = f" within max_length {self.max_length}" if truncated else ""
            raise BadSample(idx, "no_loss", f"no assistant token{where}: nothing to train on")
        return Tokenized(ids, mask, truncated, n, bool(estimate))


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on the first difference: O(log n) slice compares
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid :] == b[len(b) - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _probe(content: str) -> str:
    """A one-character content that differs from ``content``'s first and last characters."""
    edges = content[:1] + content[-1:]
    return next(c for c in "\x00\x01\x02" if c not in edges)


def _mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap a span (spans sorted, disjoint).

    Token offsets are non-decreasing in both start and end, so each span's tokens are one
    contiguous run found by bisection: O(spans * log tokens) Python steps, not O(tokens).
    """
    mask = [0] * len(offsets)
    if not offsets:
        return mask
    starts, ends = zip(*offsets, strict=True)
    for a, b in spans:
        i = bisect_right(ends, a)  # first token ending after the span's start
        j = bisect_left(starts, b)  # first token starting at or after the span's end
        if i < j:
            mask[i:j] = [1] * (j - i)
    return mask


#: Encoders made in this process, by (model, max_length, on_overflow); whether each was kept.
_made: dict[tuple[str, int, str], tuple[ChatEncoder, bool]] = {}
_made_lock = threading.Lock()


def encoder(
    model: str,
    max_length: int = 0,
    on_overflow: str = "truncate",
    *,
    kept: Sequence[str] = (),
    keep: str = "",
) -> ChatEncoder:
    """The encoder of the tokenizer in ``model``, made once a process (a run's space check
    and its feeder share it, one after the other): from a tokenizer kept in one of the
    journal directories ``kept`` where one matches the model's files
    (:mod:`eagle3d.ingest.tokcache`), else loaded by Hugging Face (seconds of CPU); kept in
    ``keep`` (a journal directory, once the start is accepted) when it was not found kept."""
    key = (model, max_length, on_overflow)
    with _made_lock:
        made, was_kept = _made.get(key, (None, False))
        if made is None:
            facts = tokcache.load(kept, model) if kept else None
            was_kept = facts is not None
            if facts is None:
                facts = _loaded(model)
            made = ChatEncoder(facts, max_length, on_overflow)
        if keep and not was_kept:
            was_kept = tokcache.save(keep, model, made.facts)
        _made[key] = (made, was_kept)
        return made


def _loaded(model: str) -> TokenizerFacts:
    from transformers import AutoTokenizer

    return facts_of(AutoTokenizer.from_pretrained(model))
