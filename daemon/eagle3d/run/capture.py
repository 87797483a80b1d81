"""The capture contract: ``OUTPUT/.eagle3d/capture.json``, what every sample of an output is.

Written once per output, at the first start that is not refused; every later start (any
shard) compares its own contract with it and refuses (exit 6) one that would change what
the files mean: the recipe, the layer ids or their index convention, the last state's
norm, the dtypes, or the model's config, weights index, tokenizer or chat template (a
changed hash is only let through by ``--force-resume``, as the job's fingerprint is).
``eagle3d verify --reference N`` (:mod:`eagle3d.tools.reference`) checks files against it.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
from typing import Any

from eagle3proto import paths

from eagle3d import config
from eagle3d.exitcodes import EXIT_FINGERPRINT, Fatal
from eagle3d.remote import recipes

FORMAT = "eagle3d-capture-v1"
NAME = "capture.json"
LAST_STATE = (
    "post-norm: the last decoder layer's output after the model's final norm (Hugging Face "
    "output_hidden_states[L], the model's last_hidden_state)"
)
#: Fields a resume may never change, even with --force-resume: they change what a file means.
FIXED = ("format", "recipe", "layers", "layer_convention", "last_state", "store_dtype", "record")
#: The model's files, hashed: a change is refused unless --force-resume.
HASHED = ("model_config", "weights_index", "tokenizer", "chat_template")


def path_of(output: str) -> str:
    return os.path.join(paths.state_dir(output), NAME)


def _hash_files(files: list[str]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        h.update(os.path.basename(f).encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
    return h.hexdigest() if files else ""


def _weights_index(model: str) -> str:
    """The weights' index file when there is one, else each weight file's name and size
    (hashing every weight would read the whole model at each start)."""
    index = sorted(glob.glob(os.path.join(model, "*.index.json")))
    if index:
        return _hash_files(index)
    files = sorted(
        glob.glob(os.path.join(model, "*.safetensors")) + glob.glob(os.path.join(model, "*.bin"))
    )
    listing = [(os.path.basename(f), os.path.getsize(f)) for f in files]
    return config.fingerprint({"weights": listing})


def _chat_template(model: str) -> str:
    parts: list[str] = []
    for name in ("chat_template.jinja", "chat_template.json"):
        p = os.path.join(model, name)
        if os.path.exists(p):
            parts.append(p)
    h = _hash_files(parts)
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(model, "tokenizer_config.json"), encoding="utf-8") as f:
            tmpl = json.load(f).get("chat_template")
        if tmpl:
            h = config.fingerprint({"files": h, "tokenizer_config": tmpl})
    return h


def model_hashes(model: str) -> dict[str, str]:
    tok = [
        os.path.join(model, n)
        for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        if os.path.exists(os.path.join(model, n))
    ]
    return {
        "model_config": _hash_files([os.path.join(model, "config.json")]),
        "weights_index": _weights_index(model),
        "tokenizer": _hash_files(tok),
        "chat_template": _chat_template(model),
    }


def contract(
    cfg: config.JobConfig, recipe: str, layers: list[int], source: str, store_dtype: str
) -> dict[str, Any]:
    """This job's contract (a JSON object)."""
    r = recipes.get(recipe)
    shape = {"input_ids": "[T] int64", "loss_mask": "[T] int64"}
    shape[r.layers_key] = f"[1, T, {len(layers)}*H]: the layers in the order listed"
    if r.last_key:
        shape[r.last_key] = "[1, T, H]: the last state"
    return {
        "format": FORMAT,
        "recipe": recipe,
        "layers": list(layers),
        "layers_from": source,
        "layer_convention": recipes.CONVENTION,
        "last_state": LAST_STATE,
        "compute_dtype": compute_dtype(cfg),
        "store_dtype": store_dtype,
        "stored": "eagle3d sample files: input_ids, loss_mask, hidden_state (the last state), "
        "aux_hidden_state (the layers, concatenated); eagle3d.reader.load_record and eagle3d "
        "export --format specforge give the recipe's record",
        "record": shape,
        **model_hashes(cfg.model),
    }


def compute_dtype(cfg: config.JobConfig) -> str:
    """The dtype the forward runs in, as the HF worker chooses it (the server's own for
    SGLang)."""
    if cfg.backend == "sglang":
        return "the server's (--dtype of sglang.launch_server)"
    if cfg.dtype != "auto":
        return cfg.dtype
    from eagle3d.produce.hf_layout import visible_gpus

    gpu = cfg.device != "cpu" and visible_gpus(cfg.device) > 0
    return "bfloat16" if gpu else "float32"


def read(output: str) -> dict[str, Any] | None:
    """The output's contract, or None before its first start. Raises Fatal when unreadable."""
    p = path_of(output)
    try:
        with open(p, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise Fatal(EXIT_FINGERPRINT, f"{p}: unreadable capture contract ({e})") from e
    if not isinstance(data, dict):
        raise Fatal(EXIT_FINGERPRINT, f"{p}: a capture contract is a JSON object")
    return data


def check(output: str, mine: dict[str, Any], force: bool) -> str:
    """'' when this start keeps the output's contract (or there is none yet); with
    ``force``, the hashes that changed; raises Fatal (exit 6) naming the field otherwise."""
    theirs = read(output)
    if theirs is None:
        return ""
    p = path_of(output)
    for k in FIXED:
        if theirs.get(k) != mine.get(k):
            raise Fatal(
                EXIT_FINGERPRINT,
                f"{p}: this output holds {k} {theirs.get(k)!r}, this job would capture "
                f"{mine.get(k)!r}; refusing to resume (write to another output)",
            )
    changed = [k for k in HASHED if theirs.get(k) != mine.get(k)]
    if changed and not force:
        raise Fatal(
            EXIT_FINGERPRINT,
            f"{p}: the model's {', '.join(changed)} changed since this output was started; "
            "refusing to resume (use --force-resume to override)",
        )
    return ", ".join(changed)


def write(output: str, mine: dict[str, Any]) -> None:
    """Write the contract if the output has none (temp file, fsync, rename)."""
    p = path_of(output)
    if os.path.exists(p):
        return
    # A temp name of this process's own: the shards of one job start together and each
    # writes the same contract.
    tmp = f"{p}.{os.getpid()}.tmp"
    # 0640 like the journal and the samples: nothing for other users (issue 26).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
    with open(fd, "w", encoding="utf-8") as f:
        json.dump(mine, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
