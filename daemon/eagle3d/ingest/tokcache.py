"""A model's tokenizer as Hugging Face loaded it, kept beside the journal, so that a resume
does not load it again.

``AutoTokenizer.from_pretrained`` costs 2-3 CPU-seconds at every start (transformers' import,
the model's config class and, in transformers 5, torch's distributed modules with it), for an
object the encoder uses four things of (:class:`~eagle3d.ingest.chat.TokenizerFacts`): the
Rust tokenizer, the chat template, the vocabulary's size and the special tokens. Once a start
is accepted, :func:`save` writes those to ``tokenizer.e3t`` in the shard's journal directory:
the Rust tokenizer as the ``tokenizers`` library serializes the very object transformers built
(its normalizer, pre-tokenizer, model, added tokens: whatever transformers did to it at load),
not the model folder's ``tokenizer.json``. :func:`load` takes them back only when the key
matches: a hash of every file transformers reads to build a tokenizer (its bytes, or its
absence) and the versions of transformers and tokenizers. Anything else (a file changed,
another version installed, a damaged or foreign file) is ignored with a message and
transformers loads the tokenizer as before; deleting the file loses nothing.

The file: ``magic | u32 crc | u64 length`` then a msgpack :class:`Kept`; written to a temp
file, synced and renamed into place.
"""

from __future__ import annotations

import hashlib
import logging
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import msgspec
from eagle3proto import sealed

log = logging.getLogger("eagle3d")

NAME = "tokenizer.e3t"
MAGIC = b"E3DTOK\x00\x01"
VERSION = 1
#: What transformers reads from a model folder to build its tokenizer.
FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)
#: A folder of named templates (transformers 4.54+).
TEMPLATES_DIR = "additional_chat_templates"
_SEED = zlib.crc32(b"eagle3d-tokenizer-cache-v1")


@dataclass(frozen=True, slots=True)
class TokenizerFacts:
    """What the encoder takes from a tokenizer as Hugging Face loaded it."""

    backend: Any  # the tokenizers.Tokenizer (None: a slow tokenizer, refused)
    chat_template: str | dict[str, str] | None
    vocab_size: int  # len(tokenizer): the base vocabulary and the added tokens
    template_vars: dict[str, str]  # the named special tokens (bos_token, ...) templates read
    specials: frozenset[str]  # every special token's text


class Kept(msgspec.Struct, kw_only=True):
    """A tokenizer's facts, as stored."""

    version: int
    key: str
    backend: str  # tokenizers' JSON of the loaded Rust tokenizer
    chat_template: str | dict[str, str] | None
    vocab_size: int
    template_vars: dict[str, str]
    specials: list[str]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Kept)


def path_in(jdir: str) -> str:
    return os.path.join(jdir, NAME)


def key(model: str) -> str:
    """A hash of the model folder's tokenizer files and of the libraries that read them."""
    h = hashlib.blake2b(digest_size=16)
    for lib in ("transformers", "tokenizers", "jinja2"):
        try:
            h.update(f"{lib}={metadata.version(lib)}\n".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{lib}=none\n".encode())
    names = list(FILES)
    extra = os.path.join(model, TEMPLATES_DIR)
    if os.path.isdir(extra):
        names += sorted(os.path.join(TEMPLATES_DIR, n) for n in os.listdir(extra))
    for name in names:
        h.update(name.encode() + b"\0")
        try:
            with open(os.path.join(model, name), "rb") as f:
                h.update(hashlib.blake2b(f.read(), digest_size=16).digest())
        except FileNotFoundError:
            h.update(b"absent")
    return h.hexdigest()


def encode(facts: TokenizerFacts, key_: str) -> bytes:
    k = Kept(
        version=VERSION,
        key=key_,
        backend=facts.backend.to_str(),
        chat_template=facts.chat_template,
        vocab_size=facts.vocab_size,
        template_vars=dict(facts.template_vars),
        specials=sorted(facts.specials),
    )
    payload = _encoder.encode(k)
    return sealed.seal(MAGIC, _SEED, payload)


def decode(data: bytes) -> Kept:
    """The kept tokenizer in ``data``; ValueError naming what is wrong with it."""
    return sealed.open_struct(data, MAGIC, _SEED, _decoder, VERSION)


def load(jdirs: Sequence[str], model: str) -> TokenizerFacts | None:
    """The tokenizer kept in the first of ``jdirs`` that holds one for ``model``'s files as
    they are now; None (said in the log, unless none was kept) when there is none."""
    want = ""
    for jdir in jdirs:
        where = path_in(jdir)
        try:
            with open(where, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            continue
        except OSError as e:
            log.info("%s was not used: %s", where, e.strerror)
            continue
        want = want or key(model)
        try:
            k = decode(data)
        except ValueError as e:
            log.info("%s was not used: %s", where, e)
            continue
        if k.key != want:
            log.info("%s was not used: the model's tokenizer files or libraries changed", where)
            continue
        log.info("tokenizer: as kept in %s (the model's tokenizer files unchanged)", where)
        return _facts(k)
    return None


def _facts(k: Kept) -> TokenizerFacts:
    from tokenizers import Tokenizer

    return TokenizerFacts(
        backend=Tokenizer.from_str(k.backend),
        chat_template=k.chat_template,
        vocab_size=k.vocab_size,
        template_vars=dict(k.template_vars),
        specials=frozenset(k.specials),
    )


def save(jdir: str, model: str, facts: TokenizerFacts) -> bool:
    """Keep ``facts`` in ``jdir`` atomically (temp file, fsync, rename, fsync dir); whether it
    was (a failure to write only costs the next start the load)."""
    try:
        sealed.write_atomic(path_in(jdir), encode(facts, key(model)))  # 0640: as the journal
    except OSError as e:
        log.warning("the tokenizer was not kept in %s (%s)", jdir, e.strerror)
        return False
    return True


__all__ = ["NAME", "Kept", "TokenizerFacts", "key", "load", "path_in", "save"]
