"""Tests of eagle3d.tools.tinymodel: a real tiny Llama, its local tokenizer and template, offline."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from eagle3d.tools.tinymodel import (
    CHAT_TEMPLATE,
    END_OF_TURN,
    SPECIAL_TOKENS,
    build_tiny_model,
    register,
)


def read_config(d: Path) -> dict[str, Any]:
    return json.loads((d / "config.json").read_text())


def test_files_and_config(tiny_model_dir: Path, tiny_tokenizer: Any) -> None:
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    cfg = read_config(tiny_model_dir)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"]) == (4, 64)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 2)
    assert cfg["tie_word_embeddings"] is False
    assert cfg["max_position_embeddings"] == 4096
    assert cfg["vocab_size"] == len(tiny_tokenizer) == 1000


def test_tokenizer_special_tokens_and_template(tiny_tokenizer: Any) -> None:
    tok = tiny_tokenizer
    assert tok.is_fast
    for t in SPECIAL_TOKENS:
        assert tok.encode(t, add_special_tokens=False) == [SPECIAL_TOKENS.index(t)]
    assert set(SPECIAL_TOKENS) <= set(tok.all_special_tokens)
    assert tok.chat_template == CHAT_TEMPLATE
    # No {% generation %} markers, on purpose: eagle3d.ingest.chat derives the mask without them.
    assert not re.search(r"\{%-?\s*generation\s*-?%\}", tok.chat_template)
    text = "Héllo wörld 🚀 数据集\n\tx = [i * i for i in range(10)]"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
    ]
    rendered = tok.apply_chat_template(msgs, tokenize=False)
    assert rendered == "<|bos|><|system|>S<|end|><|user|>U<|end|><|assistant|>A" + END_OF_TURN
    prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|bos|><|system|>S<|end|><|user|>U<|end|><|assistant|>"


def test_model_loads_and_runs_fp32(tiny_model_dir: Path, tiny_tokenizer: Any) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.get_input_embeddings().weight.data_ptr() != model.lm_head.weight.data_ptr()
    ids = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Why does the comet follow the orbit?"}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )["input_ids"]
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert out.logits.shape == (1, ids.shape[1], 1000)
    assert len(out.hidden_states) == 4 + 1
    assert all(torch.isfinite(h).all() for h in out.hidden_states)


def test_build_is_deterministic(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = Path(build_tiny_model(tmp_path / "again"))
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    other = Path(build_tiny_model(tmp_path / "seed1", seed=1))
    assert (other / "tokenizer.json").read_bytes() == (
        tiny_model_dir / "tokenizer.json"
    ).read_bytes()
    assert (other / "model.safetensors").read_bytes() != (
        tiny_model_dir / "model.safetensors"
    ).read_bytes()


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="eagle3d")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    rc: int = args.func(args)
    return rc


def test_cli_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "m"
    argv = ["tiny-model", str(d), "--layers", "2", "--hidden", "32", "--vocab", "400"]
    assert run_cli(argv) == 0
    cfg = read_config(d)
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (2, 32, 400)
    assert cfg["intermediate_size"] == 128
    assert "vocab 400" in capsys.readouterr().out


def test_vocab_is_honoured_beyond_what_the_tokenizer_learns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--vocab 4096`` wrote vocab_size 1141 without a word; now the model has exactly the
    rows asked for, the tokenizer the ids BPE learns, and the command says both."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tmp_path / "m"
    argv = ["tiny-model", str(d), "--layers", "1", "--hidden", "16", "--heads", "2"]
    assert run_cli([*argv, "--kv-heads", "1", "--vocab", "4096"]) == 0
    assert read_config(d)["vocab_size"] == 4096
    tok = AutoTokenizer.from_pretrained(d)
    assert 263 < len(tok) < 4096
    assert f"vocab 4096 (its tokenizer uses {len(tok)} of them)" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(d)
    assert model.get_input_embeddings().weight.shape == (4096, 16)
    ids = tok("hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        assert model(ids).logits.shape[-1] == 4096


def test_safetensors_index_names_every_tensor(tiny_model_dir: Path) -> None:
    """A trainer that loads one tensor by name (SpecForge's TargetHead) finds it through the
    index, as in a sharded checkpoint; transformers still loads the single file."""
    from safetensors import safe_open

    index = json.loads((tiny_model_dir / "model.safetensors.index.json").read_text())
    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        total = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in keys)
    assert set(index["weight_map"]) == keys
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    assert index["weight_map"]["lm_head.weight"] == "model.safetensors"
    assert index["metadata"]["total_size"] == total


@pytest.mark.parametrize(
    "extra",
    [["--hidden", "30"], ["--heads", "3", "--kv-heads", "2", "--hidden", "48"], ["--vocab", "100"]],
)
def test_cli_rejects_bad_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    assert run_cli(["tiny-model", str(tmp_path / "m"), *extra]) == 2
    assert "eagle3d tiny-model:" in capsys.readouterr().err
    assert not (tmp_path / "m" / "config.json").exists()


def test_builds_with_the_network_unreachable(tmp_path: Path) -> None:
    """Any socket connection fails in the child: the build must not need one."""
    code = textwrap.dedent(
        """
        import socket, sys
        def refuse(*a, **k):
            raise OSError("network disabled by test")
        socket.socket.connect = refuse
        socket.create_connection = refuse
        import argparse
        from eagle3d.tools.tinymodel import register
        p = argparse.ArgumentParser()
        register(p.add_subparsers())
        a = p.parse_args(["tiny-model", sys.argv[1], "--layers", "1", "--hidden", "16",
                          "--heads", "2", "--kv-heads", "1", "--vocab", "300"])
        rc = a.func(a)
        from transformers import AutoModelForCausalLM, AutoTokenizer
        AutoTokenizer.from_pretrained(sys.argv[1])
        AutoModelForCausalLM.from_pretrained(sys.argv[1])
        sys.exit(rc)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"))
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "m")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "m" / "model.safetensors").exists()
