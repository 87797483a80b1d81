"""Can eagle3d keep up with a GPU node? One command, about 5-8 minutes on one H200.

    python3 scripts/gpu_check_node.py --work DIR --results DIR [--samples 512 --tokens 1024]
    python3 scripts/gpu_check_node.py --dry-run ...   # tiny shape on the CPU: the same steps

In one run, on the same inputs:

1. a random-init model with the shape of an 8B target (hidden 4096, 32 layers, 14336 wide
   MLP, 32 heads, 8 KV heads; bf16), built on the device and saved once (with the tiny
   model's tokenizer: the inputs are pretokenized);
2. **the bare loop**: that model in this process, the worker's batch rule and capture
   hooks, no dumps, states left on the device: the GPU's own tokens/s;
3. **the disk**: ``dd if=/dev/zero bs=16M oflag=direct`` of the bytes the job writes, to the
   output's disk; with the bytes per token of each storage format (exact, from the file
   layout), the tokens/s the disk can take;
4. **the pipeline**: ``eagle3d run`` (HF backend, one worker on the device, dumps in
   /dev/shm, commit threads as the daemon sizes them), store dtype ``bfloat16`` then
   ``fp8``: tokens/s over the working span (first sample sent to the run's end, from the
   journal) and the daemon's CPU.

It prints, per storage format, e2e / min(bare loop, disk limit) (the goal is >= 0.9) and
writes ``results.json`` into ``--results``; the exit status is 1 if a step fails (not if a
ratio is below the goal: that is a figure to report). Outputs are removed as it goes (the
disk holds at most one job's files at a time).

Packages: torch, transformers, safetensors, tokenizers, numpy, psutil, pyarrow and httpx are
in the H200 image; msgspec and isal are not: carry them as wheels for Python 3.12
(``scripts/gpu_node_wheels.sh`` downloads them into ``.whl/``, ignored by git; the device
notes say how to install them there), then run with ``PYTHONPATH=/tmp/site:shared:daemon:tui``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

#: The shape of an 8B target (Llama-3-8B's), and a tiny one for --dry-run on a CPU.
SHAPES = {
    "8b": {"hidden": 4096, "layers": 32, "inter": 14336, "heads": 32, "kv": 8},
    "tiny": {"hidden": 256, "layers": 8, "inter": 512, "heads": 4, "kv": 2},
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_model(work: Path, shape: dict[str, int], device: str, dtype: str) -> Path:
    """A random-init Llama of ``shape`` in ``dtype``, made on ``device`` (fast there) and
    saved with the tiny model's tokenizer."""
    import torch
    from eagle3d.tools.tinymodel import build_tiny_model
    from transformers import AutoConfig, AutoModelForCausalLM

    tiny = work / "tiny"
    if not (tiny / "config.json").exists():
        build_tiny_model(str(tiny), layers=2, hidden=64, heads=4, kv_heads=2)
    m = work / f"model-h{shape['hidden']}-L{shape['layers']}"
    if (m / "config.json").exists():
        return m
    cfg = AutoConfig.from_pretrained(str(tiny))
    cfg.hidden_size = shape["hidden"]
    cfg.num_hidden_layers = shape["layers"]
    cfg.intermediate_size = shape["inter"]
    cfg.num_attention_heads = shape["heads"]
    cfg.num_key_value_heads = shape["kv"]
    cfg.head_dim = shape["hidden"] // shape["heads"]
    cfg.max_position_embeddings = 8192
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.save_pretrained(str(m))
    del model
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, m / f.name)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return m


def bare_rate(model: Path, samples: list[list[int]], device: str, dtype: str) -> float:
    """Tokens/s of the bare loop (bench_pipeline's: the worker's batch rule and capture)."""
    import bench_pipeline as bp
    import torch

    m, cap = bp.load_for_bare(model, device, dtype)
    bp.bare_loop(m, cap, samples[: max(4, len(samples) // 16)], device)  # warm-up
    t = time.perf_counter()
    tokens = bp.bare_loop(m, cap, samples, device)
    rate = tokens / (time.perf_counter() - t)
    del m, cap
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rate


def file_bytes_per_token(samples: list[list[int]], hidden: int, fmt: str) -> float:
    from eagle3d.remote import storedtype
    from eagle3d.store.sizing import file_bytes

    f = storedtype.get(fmt)
    total = sum(file_bytes(len(s), hidden, 3, f) for s in samples)
    return total / sum(map(len, samples))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--work", default="", help="models, datasets, outputs (default: a temp dir)")
    p.add_argument("--results", default=".")
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--tokens", type=int, default=1024, help="per sample (+-25 %%)")
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--formats", default="bfloat16,fp8")
    p.add_argument("--dry-run", action="store_true", help="tiny shape on the CPU, few samples")
    a = p.parse_args()

    import bench_pipeline as bp

    shape = SHAPES["tiny" if a.dry_run else "8b"]
    device = "cpu" if a.dry_run else "cuda"
    dtype = "float32" if a.dry_run else "bfloat16"
    if a.dry_run:
        a.samples, a.tokens, a.batch_tokens = min(a.samples, 24), min(a.tokens, 64), 512
    bp.BATCH_TOKENS = a.batch_tokens
    work = Path(a.work or tempfile.mkdtemp(prefix="gpu-check-node-"))
    work.mkdir(parents=True, exist_ok=True)
    results = Path(a.results)
    results.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"shape": shape, "device": device, "dtype": dtype, "formats": {}}
    try:
        t0 = time.perf_counter()
        model = build_model(work, shape, device, dtype)
        log(f"model {model.name} ready ({time.perf_counter() - t0:.0f} s)")
        import random

        rnd = random.Random(5)
        lengths = [
            rnd.randrange(a.tokens * 3 // 4, a.tokens * 5 // 4 + 1) for _ in range(a.samples)
        ]
        vocab = 500  # within the tiny tokenizer's ids
        samples = [[rnd.randrange(7, vocab) for _ in range(n)] for n in lengths]
        data = work / "data.jsonl"
        data.write_text(
            "".join(json.dumps({"input_ids": s, "loss_mask": [1] * len(s)}) + "\n" for s in samples)
        )
        bare = bare_rate(model, samples, device, dtype)
        out["bare_tokens_s"] = bare
        log(f"bare loop: {bare:,.0f} tokens/s ({sum(lengths):,} tokens)")
        shm = tempfile.mkdtemp(prefix="gpu-check-node-", dir="/dev/shm")
        for fmt in a.formats.split(","):
            per_token = file_bytes_per_token(samples, shape["hidden"], fmt)
            nbytes = int(per_token * sum(lengths))
            disk = bp.dd_rate(work, nbytes, "oflag=direct") * 1e6
            disk_tokens = disk / per_token
            args = ["--backend", "hf", "--store-dtype", fmt, "--batch-tokens", str(a.batch_tokens)]
            args += ["--device", device, "--dtype", dtype, "--workers", "1"]
            run = bp.run_daemon(model, str(data), work / f"out-{fmt}", *args, dumps=shm)
            shutil.rmtree(work / f"out-{fmt}", ignore_errors=True)
            limit = min(bare, disk_tokens)
            ratio = run["tokens_s"] / limit
            out["formats"][fmt] = {
                "bytes_per_token": per_token,
                "disk_mb_s": disk / 1e6,
                "disk_tokens_s": disk_tokens,
                "e2e_tokens_s": run["tokens_s"],
                "e2e_mb_s": run["mb_s"],
                "samples": run["samples"],
                "daemon_cpu_s": run["cpu_s"],
                "stage_s": run["stage_s"],
                "ratio": ratio,
                "bound_by": "disk" if disk_tokens < bare else "forward",
            }
            log(
                f"{fmt}: e2e {run['tokens_s']:,.0f} tokens/s ({run['mb_s']:,.0f} MB/s, "
                f"{run['samples']} samples, daemon {run['cpu_s']:.1f} CPU-s); disk "
                f"{disk / 1e6:,.0f} MB/s = {disk_tokens:,.0f} tokens/s at {per_token:,.0f} B/token; "
                f"e2e / min(bare, disk) = {ratio:.2f} (goal >= 0.9; bound by "
                f"{out['formats'][fmt]['bound_by']})"
            )
        shutil.rmtree(shm, ignore_errors=True)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        log(out["error"])
        (results / "results.json").write_text(json.dumps(out, indent=1))
        return 1
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)
    (results / "results.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
