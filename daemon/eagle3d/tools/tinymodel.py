"""A tiny random-init Llama with a locally trained tokenizer and chat template, built offline.

API::

    build_tiny_model(directory, *, layers=4, hidden=64, vocab=1000, heads=4, kv_heads=2,
                     intermediate=None, seed=0) -> str
    register(subparsers)      # adds ``eagle3d tiny-model DIR [--layers N --hidden H --vocab V]``
    CHAT_TEMPLATE, SPECIAL_TOKENS, END_OF_TURN

The directory gets ``config.json``, ``generation_config.json``, ``model.safetensors`` (fp32,
``LlamaForCausalLM``, untied embeddings, 4096 positions) with its
``model.safetensors.index.json`` (as a sharded checkpoint has; trainers that load single
tensors, such as SpecForge's ``TargetHead``, look weights up there), and a tokenizer
(``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) that
``AutoTokenizer.from_pretrained`` loads (as ``TokenizersBackend`` in transformers 5). Nothing
touches a model hub.

The tokenizer is a byte-level BPE trained with ``tokenizers`` on the text of the bundled demo
dataset (``eagle3d/data/demo.jsonl``), so it is reproducible: same arguments, same files.
``vocab`` is honoured: the model's ``vocab_size`` is exactly ``vocab``. The tokenizer holds as
many of those ids as BPE learns, at most ``vocab``; it stops merging when the corpus has no
pair left (1,141 tokens for the demo text), and the rows above are ids no text maps to, as in
real checkpoints whose vocabulary is padded (Qwen2.5: 151,936 rows for 151,665 tokens).

The chat template has no ``{% generation %}`` markers on purpose: :mod:`eagle3d.ingest.chat` derives
the loss mask from the template itself. Format::

    <|bos|><|system|>S<|end|><|user|>U<|end|><|assistant|>A<|end|>...

``<|end|>`` closes every turn; the assistant produces its content and its ``<|end|>``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "END_OF_TURN",
    "SPECIAL_TOKENS",
    "build_tiny_model",
    "corpus",
    "register",
]

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
END_OF_TURN = "<|end|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
#: In id order: ids 0..6.
SPECIAL_TOKENS = [BOS, EOS, PAD, *ROLE_TOKENS.values(), END_OF_TURN]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>"
    "{% elif message['role'] == 'user' %}<|user|>"
    "{% elif message['role'] == 'assistant' %}<|assistant|>"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus() -> Iterator[str]:
    """The tokenizer's training text: every string of the bundled demo dataset, in file order."""
    data = resources.files("eagle3d").joinpath("data/demo.jsonl").read_text(encoding="utf-8")
    for line in data.splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue  # the demo's deliberately malformed line
        yield from _strings(obj)


def _strings(obj: Any) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def _train_tokenizer(vocab: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    return tok


def build_tiny_model(
    directory: str | os.PathLike[str],
    *,
    layers: int = 4,
    hidden: int = 64,
    vocab: int = 1000,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    seed: int = 0,
) -> str:
    """Write the tiny model, tokenizer and chat template into ``directory``; return its path.

    ``intermediate`` defaults to ``4 * hidden``. Raises ``ValueError`` for inconsistent sizes.
    """
    min_vocab = len(SPECIAL_TOKENS) + 256
    if vocab < min_vocab:
        raise ValueError(f"--vocab must be at least {min_vocab} (special tokens + 256 bytes)")
    if layers < 1 or hidden < 1 or heads < 1 or kv_heads < 1:
        raise ValueError("layers, hidden, heads and kv_heads must be positive")
    if hidden % heads or (hidden // heads) % 2:
        raise ValueError(f"hidden {hidden} must be a multiple of 2 * heads ({heads})")
    if heads % kv_heads:
        raise ValueError(f"heads {heads} must be a multiple of kv_heads {kv_heads}")

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)

    tok = _train_tokenizer(vocab)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=[*ROLE_TOKENS.values(), END_OF_TURN],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    if len(fast) > vocab:  # pragma: no cover - BPE counts the special tokens in its limit
        raise ValueError(f"the tokenizer has {len(fast)} tokens, more than --vocab {vocab}")
    fast.save_pretrained(out)

    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}  # the trainer puts them first, in order
    assert all(tok.token_to_id(t) == i for t, i in ids.items())
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=ids[BOS],
        eos_token_id=[ids[EOS], ids[END_OF_TURN]],
        pad_token_id=ids[PAD],
    )
    cfg.dtype = torch.float32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).float()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-shard tiny model needs no progress bar
    try:
        model.save_pretrained(out)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    _write_index(out, "model.safetensors")
    return str(out)


def _write_index(directory: Path, shard: str) -> None:
    """Write ``<shard>.index.json`` for a one-file checkpoint: every tensor in ``shard``."""
    from safetensors import safe_open

    weights: dict[str, str] = {}
    total = 0
    with safe_open(str(directory / shard), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
            weights[key] = shard
            s = f.get_slice(key)
            shape = s.get_shape()
            n = 1
            for d in shape:
                n *= d
            total += n * _ITEMSIZE[s.get_dtype()]
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weights.items()))}
    (directory / (shard + ".index.json")).write_text(json.dumps(index, indent=2) + "\n")


_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4}


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``tiny-model DIR [--layers N --hidden H --vocab V ...]`` to an argparse subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "tiny-model",
        help="write a tiny random-init Llama + local tokenizer + chat template (offline)",
        description="Write a tiny random-init Llama, a byte-level BPE tokenizer trained on the "
        "bundled demo dataset and a chat template into DIR, without any model hub.",
    )
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--layers", type=int, default=4, metavar="N", help="decoder layers (4)")
    p.add_argument("--hidden", type=int, default=64, metavar="H", help="hidden size (64)")
    p.add_argument(
        "--vocab",
        type=int,
        default=1000,
        metavar="V",
        help="vocab size of the model, exactly (1000); its tokenizer uses as many of the ids"
        " as BPE learns from the demo text (at most V, about 1,141)",
    )
    p.add_argument("--heads", type=int, default=4, help="attention heads (4)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (2)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP size (4*H)")
    p.add_argument("--seed", type=int, default=0, help="weight init seed (0)")
    p.set_defaults(func=_cmd_tiny_model)
    return p


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    import sys

    try:
        path = build_tiny_model(
            args.directory,
            layers=args.layers,
            hidden=args.hidden,
            vocab=args.vocab,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate=args.intermediate,
            seed=args.seed,
        )
    except ValueError as e:
        print(f"eagle3d tiny-model: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"eagle3d tiny-model: cannot write {args.directory}: {e}", file=sys.stderr)
        return 4
    with open(Path(path) / "config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    tokens = _tokenizer_size(Path(path))
    used = "" if tokens == cfg["vocab_size"] else f" (its tokenizer uses {tokens} of them)"
    print(
        f"tiny model in {path}: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
        f"vocab {cfg['vocab_size']}{used}"
    )
    return 0


def _tokenizer_size(directory: Path) -> int:
    from tokenizers import Tokenizer

    return int(Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size())
