"""GPU check of the Hugging Face producer path, with NVML telemetry and the monitor.

Needs one CUDA GPU, torch and transformers; no SGLang (see gpu_check_sglang.sh for that).

    python scripts/gpu_check_hf.py --work DIR --results DIR [--skip-bench]

1. ``eagle3d run --device cuda --dtype float32`` on the demo dataset five times over
   (h256/L8, the reference model), ``eagle3d verify``, and every distinct sample compared with
   an independent fp32 forward on the CPU; ids and loss masks equal to the CPU encoding.
2. While it runs: ``eagle3-top --once --json`` every half second (its ``gpus`` must carry the
   device's NVML readings) and, where Textual is installed, an SVG screenshot of the monitor.
3. ``bench/bench_pipeline.py forward`` on CUDA: the reference model in fp32, and a larger
   model (h2048/L12) in bf16, each against a bare forward loop on the GPU, with ``dd``.

Writes ``results.json`` (and the screenshot) into --results; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
DEMO = str(resources.files("eagle3d").joinpath("data/demo.jsonl"))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def once(output: Path) -> tuple[float, int, dict[str, Any] | None]:
    t = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-m", "eagle3top", "--once", "--json", "--output", str(output)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=30,
    )
    wall = time.perf_counter() - t
    try:
        return wall, p.returncode, json.loads(p.stdout)
    except ValueError:
        return wall, p.returncode, None


def screenshot(output: Path, results: Path) -> str:
    sys.path.insert(0, str(ROOT / "scripts"))
    from monitor_screenshot import shoot  # imports Textual: only here

    svg = asyncio.run(shoot(str(output), str(results)))
    os.replace(svg, results / "monitor-gpu.svg")
    return str(results / "monitor-gpu.svg")


def compare_with_cpu(model: Path, dataset: str, output: Path, n: int) -> dict[str, Any]:
    """Every one of the first ``n`` samples against an fp32 forward on the CPU."""
    import torch
    from eagle3d.ingest.chat import ChatEncoder
    from eagle3d.ingest.dataset import BadSample, iter_lines, parse_line
    from eagle3proto import paths
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    enc = ChatEncoder.from_pretrained(str(model), max_length=2048)
    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    layers = [2, m.config.num_hidden_layers // 2, m.config.num_hidden_layers - 3]
    worst_aux = worst_hid = 0.0
    checked = mask_bad = 0
    for idx, raw in iter_lines(dataset):
        if idx >= n:
            break
        try:
            want = enc.encode(parse_line(idx, raw))
        except BadSample:
            continue
        d = torch.load(output / paths.sample_relpath(idx), weights_only=True)
        if d["input_ids"].tolist() != want.input_ids:
            raise SystemExit(f"sample {idx}: input_ids differ from the CPU encoding")
        mask_bad += int(d["loss_mask"].tolist() != want.loss_mask)
        with torch.inference_mode():
            hs = m.model(input_ids=d["input_ids"][None], output_hidden_states=True).hidden_states
        ref_aux = torch.cat([hs[i] for i in layers], -1)
        worst_aux = max(worst_aux, (d["aux_hidden_state"].float() - ref_aux).abs().max().item())
        worst_hid = max(worst_hid, (d["hidden_state"].float() - hs[-1]).abs().max().item())
        checked += 1
    return {
        "checked": checked,
        "loss_mask_mismatches": mask_bad,
        "max_abs_diff_aux": worst_aux,
        "max_abs_diff_final": worst_hid,
    }


def bench(args: list[str], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(ROOT / "bench" / "bench_pipeline.py"), "forward", "--markdown"]
    t = time.perf_counter()
    p = subprocess.run(cmd + args, env=ENV, capture_output=True, text=True, timeout=timeout)
    return {
        "args": args,
        "rc": p.returncode,
        "secs": round(time.perf_counter() - t, 1),
        "table": p.stdout,
        "stderr_tail": p.stderr[-3000:],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--results", required=True)
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script's logic")
    a = ap.parse_args()
    work, results = Path(a.work), Path(a.results)
    work.mkdir(parents=True, exist_ok=True)
    results.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"failures": []}

    def save() -> None:
        (results / "results.json").write_text(json.dumps(res, indent=1, default=str))

    import torch
    import transformers

    res["env"] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpus": os.cpu_count(),
    }
    log(f"env {res['env']}")
    save()

    from eagle3d.tools.tinymodel import build_tiny_model

    model = work / "model-L8-h256"
    if not (model / "config.json").exists():
        build_tiny_model(str(model), layers=8, hidden=256, heads=4, kv_heads=2)
    data = work / "demo5.jsonl"
    with open(DEMO, encoding="utf-8") as f:
        lines = [x for x in f if x.strip()]
    data.write_text("".join(lines * 5), encoding="utf-8")
    out = work / "out"
    cmd = [sys.executable, "-m", "eagle3d", "run", "--model", str(model), "--dataset", str(data)]
    cmd += ["--output", str(out), "--device", a.device, "--dtype", "float32"]
    cmd += ["--socket", str(work / "e3.sock"), "--dump-dir", str(work / "dumps")]
    log("step 1: eagle3d run on cuda (fp32), demo x5")
    t0 = time.perf_counter()
    daemon = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    snaps: list[dict[str, Any]] = []
    walls: list[float] = []
    shot = None
    while daemon.poll() is None:
        time.sleep(0.5)
        if not (out / ".eagle3d").exists():
            continue
        wall, rc, doc = once(out)
        walls.append(wall)
        if doc is not None:
            snaps.append({"rc": rc, **{k: doc.get(k) for k in ("state", "saved", "total", "gpus")}})
            if shot is None and doc.get("total") and doc["saved"] >= doc["total"] // 3:
                try:
                    shot = screenshot(out, results)
                except Exception as e:  # Textual missing there: the check goes on without it
                    shot = f"no screenshot: {type(e).__name__}: {e}"
                log(f"screenshot: {shot}")
    stdout = daemon.stdout.read().decode(errors="replace") if daemon.stdout else ""
    res["run"] = {
        "rc": daemon.returncode,
        "secs": round(time.perf_counter() - t0, 1),
        "tail": stdout[-2000:],
    }
    res["once"] = {
        "calls": len(walls),
        "wall_ms_max": round(1000 * max(walls, default=0), 1),
        "wall_ms_median": round(1000 * sorted(walls)[len(walls) // 2], 1) if walls else None,
        "last": snaps[-1] if snaps else None,
        "with_gpus": sum(1 for s in snaps if s.get("gpus")),
        "screenshot": shot,
    }
    log(f"run rc={daemon.returncode}; once: {res['once']['calls']} calls")
    if daemon.returncode != 0:
        res["failures"].append("eagle3d run failed")
    gpus = [g for s in snaps for g in (s.get("gpus") or [])]
    if not gpus:
        res["failures"].append("no NVML readings in any --once snapshot")
    else:
        g = gpus[-1]
        res["once"]["gpu_last"] = g
        if not g.get("name") or not g.get("mem_total_bytes") or not g.get("mem_used_bytes"):
            res["failures"].append(f"NVML reading incomplete: {g}")
    save()

    v = subprocess.run(
        [sys.executable, "-m", "eagle3d", "verify", "--output", str(out), "--json"],
        env=ENV,
        capture_output=True,
        text=True,
    )
    res["verify"] = {"rc": v.returncode, "doc": v.stdout[-3000:]}
    if v.returncode != 0:
        res["failures"].append("verify failed")
    log(f"verify rc={v.returncode}")
    save()
    try:
        res["compare"] = compare_with_cpu(model, str(data), out, len(lines))
        c = res["compare"]
        if c["loss_mask_mismatches"] or max(c["max_abs_diff_aux"], c["max_abs_diff_final"]) > 2e-3:
            res["failures"].append(f"CUDA states differ from the CPU forward: {c}")
    except SystemExit as e:
        res["failures"].append(str(e))
    log(f"compare {res.get('compare')}")
    save()

    if not a.skip_bench:
        log("step 3: bench forward on cuda, h256/L8 fp32")
        res["bench_ref"] = bench(
            ["--device", "cuda", "--dtype", "float32", "--repeat", "5", "--batch-tokens", "16384"],
            150,
        )
        log(res["bench_ref"]["table"] or res["bench_ref"]["stderr_tail"])
        save()
        log("step 3: bench forward on cuda, h2048/L12 bf16")
        res["bench_big"] = bench(
            [
                *("--device", "cuda", "--dtype", "bfloat16", "--layers", "12"),
                *("--hidden", "2048", "--repeat", "2", "--batch-tokens", "16384"),
            ],
            150,
        )
        log(res["bench_big"]["table"] or res["bench_big"]["stderr_tail"])
        save()
    log(f"failures: {res['failures'] or 'none'}")
    save()
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
