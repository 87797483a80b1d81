"""SpecForge 0.2.0's real reader and trainer on what eagle3d writes.

Runs only inside ``.venv-specforge`` (``scripts/specforge_env``: the registry's
``specforge==0.2.0`` with torch 2.13.0 and transformers 5.8.1)::

    .venv-specforge/bin/python -m pytest -q tests/test_specforge.py

eagle3d itself runs from the project's own ``.venv`` (``scripts/bootstrap``), as a user runs
the two tools: the extraction with eagle3d's CLI, the training with SpecForge's. Everything
on SpecForge's side is its own code: its file listing, loader, normalizer and collator (the
factories its EAGLE-3 provider hands the trainer), its capture-layer resolution, and
``specforge train`` itself, configured by the blocks of ``docs/training.md`` that are marked
``<!-- checked: ... -->``.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

specforge = pytest.importorskip(
    "specforge",
    reason="needs SpecForge 0.2.0: run scripts/specforge_env, then "
    ".venv-specforge/bin/python -m pytest -q tests/test_specforge.py",
)

import torch  # noqa: E402

# Training runs take minutes on a shared 2-core machine; the suite's 300 s is for unit tests.
pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "training.md"
DEMO_DATA = ROOT / "daemon" / "eagle3d" / "data" / "demo.jsonl"
SPECFORGE = Path(sys.executable).with_name("specforge")
FP32_ERROR = "expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16"
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # A stray accelerator variable must not send SpecForge anywhere but this CPU.
    "CUDA_VISIBLE_DEVICES": "",
}


def eagle3d() -> str:
    """eagle3d's CLI in the project's own environment."""
    venv = Path(os.environ.get("EAGLE3D_VENV", ROOT / ".venv"))
    exe = venv / "bin" / "eagle3d"
    if not os.access(exe, os.X_OK):
        pytest.fail(f"{exe} is missing: run scripts/bootstrap first")
    return str(exe)


def doc_block(name: str) -> str:
    """The first fenced block after ``<!-- checked: NAME -->`` in docs/training.md."""
    text = DOC.read_text(encoding="utf-8")
    at = text.find(f"<!-- checked: {name} -->")
    assert at >= 0, f"docs/training.md has no block marked {name!r}"
    m = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M).search(text, at)
    assert m is not None, f"no fenced block after the {name!r} marker"
    return m.group(1)


def doc_command(name: str) -> tuple[dict[str, str], list[str]]:
    """(environment, arguments after ``specforge`` or ``python``) of the doc's training
    line: ``specforge train ...`` or ``python -m eagle3d.specforge_train train ...``."""
    lines = doc_block(name).splitlines()
    line = next(x for x in lines if "specforge train" in x or "specforge_train train" in x)
    words = shlex.split(line)
    k = next(i for i, w in enumerate(words) if w.endswith(("/specforge", "/python")))
    env = dict(w.split("=", 1) for w in words[:k])
    return env, words[k + 1 :]


def run_eagle3d(*args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    r = subprocess.run(
        [eagle3d(), *args], cwd=cwd, env={**ENV, **(env or {})}, capture_output=True, text=True
    )
    if r.returncode != 0 and not (env and "EAGLE3D_FAULT" in env):
        raise AssertionError(f"eagle3d {args[0]} exited {r.returncode}:\n{r.stderr[-3000:]}")
    return r.stdout


def train(cwd: Path, name: str = "train", *overrides: str) -> tuple[int, str, list[dict[str, Any]]]:
    """Run the doc's ``specforge train`` line (plus ``overrides``) in ``cwd``; (exit code,
    log, the metrics of every ``step N: {...}`` line)."""
    env, args = doc_command(name)
    r = subprocess.run(
        [str(SPECFORGE), *args, *overrides],
        cwd=cwd,
        env={**ENV, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = r.stdout + r.stderr
    steps = [ast.literal_eval(m) for m in re.findall(r"^step \d+: (\{.*\})$", r.stdout, re.M)]
    return r.returncode, log, steps


def assert_trained(rc: int, log: str, steps: list[dict[str, Any]], n: int) -> None:
    assert rc == 0, log[-4000:]
    assert len(steps) == n, log[-4000:]
    losses = [[s["loss"], *(s[f"ploss_{i}"] for i in range(7))] for s in steps]
    # A step is 0 when its sample has no loss token within data.max_length; not every one.
    assert all(math.isfinite(x) and x >= 0 for step in losses for x in step), losses
    assert any(step[0] > 0 for step in losses), losses


def verify_json(output: Path) -> dict[str, Any]:
    r = subprocess.run(
        [eagle3d(), "verify", "--output", str(output), "--json"],
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return dict(json.loads(r.stdout))


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory laid out as the repository root after ``scripts/demo``: ``.demo/model``
    and ``.demo/out`` made by ``eagle3d demo`` (what ``scripts/demo`` runs), and the doc's
    draft config and training config saved where the doc says."""
    root = tmp_path_factory.mktemp("work")
    run_eagle3d("demo", "--dir", str(root / ".demo"), "--quiet", cwd=root)
    (root / ".demo" / "draft.json").write_text(doc_block("draft.json"))
    (root / ".demo" / "drafter.yaml").write_text(doc_block("drafter.yaml"))
    return root


def cfg_and_draft(work: Path) -> tuple[Any, dict[str, Any], Any]:
    from specforge.config import load_config
    from transformers import AutoConfig

    cfg = load_config(str(work / ".demo" / "drafter.yaml"))
    draft = json.loads((work / ".demo" / "draft.json").read_text())
    target = AutoConfig.from_pretrained(str(work / cfg.model.target_model_path))
    return cfg, draft, target


def test_the_demo_output_is_what_the_doc_says(work: Path) -> None:
    report = verify_json(work / ".demo" / "out")
    assert report["ok"] and report["saved"] == 297
    assert report["shards"][0]["store_dtype"] == "bfloat16"
    _, draft, target = cfg_and_draft(work)
    assert (target.hidden_size, target.vocab_size) == (draft["hidden_size"], draft["vocab_size"])
    assert (work / ".demo" / "model" / "model.safetensors.index.json").is_file()


def test_specforge_lists_loads_and_collates_every_file(work: Path) -> None:
    """SpecForge's own EAGLE-3 reader, feature store, normalizer and collator over all 297
    files: every one found, loaded, normalized as the trainer will see it, and batched."""
    from specforge.algorithms.eagle3.data import (
        build_offline_collator,
        build_offline_normalizer,
        build_offline_reader,
    )
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    cfg, _, target = cfg_and_draft(work)
    out = work / cfg.data.hidden_states_path
    max_len = cfg.data.max_length
    refs = build_offline_reader(str(out), run_id="t", ttt_length=7, max_len=max_len).read()
    files = sorted(str(p) for p in out.glob("rows_*/data_*.ckpt"))
    assert [r.feature_store_uri for r in refs] == [f"file://{f}" for f in files]
    assert len(refs) == 297
    store = LocalFeatureStore()
    normalize = build_offline_normalizer(max_len)
    collate = build_offline_collator()
    h = target.hidden_size
    samples = []
    for ref in refs:
        raw, handle = store.get(ref)
        s = normalize(raw)
        t = min(raw["input_ids"].shape[0], max_len)
        assert s["input_ids"].shape == s["loss_mask"].shape == s["attention_mask"].shape == (1, t)
        assert s["hidden_state"].shape == (1, t, 3 * h)
        assert s["target"].shape == (1, t, h)
        assert s["hidden_state"].dtype == s["target"].dtype == torch.bfloat16
        assert s["loss_mask"][0, -1] == 0 and bool(s["attention_mask"].all())
        samples.append({k: v.clone() for k, v in s.items()})
        store.release(handle)
    assert sum(int(s["loss_mask"].sum()) for s in samples) > 0
    for k in range(0, len(samples), 8):
        part = samples[k : k + 8]
        batch = collate(part)
        n = max(s["input_ids"].shape[1] for s in part)
        assert batch["hidden_state"].shape == (len(part), n, 3 * h)
        assert batch["target"].shape == (len(part), n, h)
        assert batch["attention_mask"].sum() == sum(s["input_ids"].shape[1] for s in part)


def test_values_at_specforges_capture_layers_equal_an_hf_forward(work: Path) -> None:
    """The states in every file are what a Hugging Face forward of the target gives at the
    layers SpecForge itself resolves for EAGLE-3 (+1: its ids name the layer before the
    state), and one layer off they are not."""
    from specforge.algorithms.model_providers import resolve_eagle_capture_layers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # small forwards: a second thread only waits at barriers
    cfg, draft, target = cfg_and_draft(work)
    from eagle3d.remote.dumpfile import default_aux_layers

    layers = resolve_eagle_capture_layers(cfg, draft, target)
    n = target.num_hidden_layers
    # The demo's 6 layers: eagle3d's distinct default [1, 3, 5], which the doc's drafter.yaml
    # gives SpecForge in its ids (SpecForge's own default would repeat one: [1, 2, 2]).
    assert layers == [i - 1 for i in default_aux_layers(n)] == [0, 2, 4]
    model = AutoModelForCausalLM.from_pretrained(
        str(work / cfg.model.target_model_path), dtype=torch.float32
    ).eval()
    bf16 = {"rtol": 2**-8, "atol": 1e-5}
    files = sorted((work / cfg.data.hidden_states_path).glob("rows_*/data_*.ckpt"))
    assert len(files) == 297
    for f in files:
        d = torch.load(f, weights_only=True, mmap=True)
        with torch.no_grad():
            hs = model.model(input_ids=d["input_ids"][None], output_hidden_states=True)
        states = hs.hidden_states
        aux = torch.cat([states[i + 1] for i in layers], dim=-1)
        torch.testing.assert_close(d["aux_hidden_state"].float(), aux, **bf16)
        torch.testing.assert_close(d["hidden_state"].float(), states[-1], **bf16)
    shifted = torch.cat([states[i] for i in layers], dim=-1)
    err = (d["aux_hidden_state"].float() - shifted).norm() / shifted.norm()
    assert err > 0.05, err


@pytest.fixture(scope="module")
def demo_training(work: Path) -> tuple[int, str, list[dict[str, Any]]]:
    """The doc's ``specforge train`` on the demo output (bfloat16), as written."""
    return train(work)


def test_specforge_trains_on_the_demo_output(
    work: Path, demo_training: tuple[int, str, list[dict[str, Any]]]
) -> None:
    """The doc's command, as written: three steps of ``specforge train``, finite losses, a
    checkpoint."""
    assert_trained(*demo_training, 3)
    assert (work / ".demo" / "drafter" / "specforge-run-step3" / "training_state.pt").is_file()


FP8_ERROR = (
    "expected m1 and m2 to have the same dtype, but got: c10::Float8_e4m3fn != c10::BFloat16"
)


@pytest.fixture(scope="module")
def fp8_output(work: Path) -> Path:
    """The demo dataset extracted again with ``--store-dtype fp8``, where the doc says."""
    cmd = doc_block("extract-fp8").strip().split("\n")[-1]
    words = shlex.split(cmd)
    assert words[:2] == [".venv/bin/eagle3d", "run"], words
    # Run from the repository root in the doc; the bundled dataset is found there.
    run_eagle3d(*(str(ROOT / w) if w.startswith("daemon/") else w for w in words[1:]), cwd=work)
    out = work / ".demo" / "out-fp8"
    report = verify_json(out)
    assert report["ok"] and report["saved"] == 297
    assert report["shards"][0]["store_dtype"] == "fp8"
    return out


def test_specforge_trains_on_fp8_files_through_the_adapter_as_on_bf16_files(
    work: Path, fp8_output: Path, demo_training: tuple[int, str, list[dict[str, Any]]]
) -> None:
    """The doc's fp8 command: SpecForge's own trainer, through ``eagle3d.specforge_train``,
    three steps on the fp8 files with finite losses, step by step within a few percent of
    the same steps on the bfloat16 files (same files in the same order, same seed); plain
    ``specforge train`` on the same files fails at its first step (the adapter is needed)."""
    env, args = doc_command("train-fp8")
    assert args[:3] == ["-m", "eagle3d.specforge_train", "train"], args
    r = subprocess.run(
        [sys.executable, *args],
        cwd=work,
        env={**ENV, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    steps = [ast.literal_eval(m) for m in re.findall(r"^step \d+: (\{.*\})$", r.stdout, re.M)]
    log = r.stdout + r.stderr
    assert_trained(r.returncode, log, steps, 3)
    _, _, bf16 = demo_training
    pairs = [(a["loss"], b["loss"]) for a, b in zip(steps, bf16, strict=True)]
    print("loss per step, fp8 files vs bf16 files:", pairs)
    assert abs(pairs[0][0] - pairs[0][1]) <= 1e-3 * pairs[0][1], pairs  # the same first step
    assert all(abs(a - b) <= 0.05 * b for a, b in pairs), pairs
    assert (work / ".demo" / "drafter-fp8" / "specforge-run-step3" / "training_state.pt").is_file()
    # Without the adapter SpecForge's own trainer refuses the fp8 files at the first step.
    rc, log, steps = train(
        work, "train", f"data.hidden_states_path={fp8_output}", "output_dir=plain-fp8"
    )
    assert rc != 0 and not steps and FP8_ERROR in log, log[-3000:]
    # A multi-process plan runs the adapter in every worker (torchrun --no-python).
    r = subprocess.run(
        [sys.executable, *args, "deployment.trainer.nproc_per_node=2", "--plan"],
        cwd=work,
        env={**ENV, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (command,) = json.loads(r.stdout)["commands"]
    argv = command["argv"]
    assert "--no-python" in argv and "--nproc_per_node" in argv, argv
    at = argv.index("eagle3d.specforge_train")
    assert argv[at - 1] == "-m" and argv[at + 1] == "train", argv


@pytest.fixture(scope="module")
def grown(work: Path) -> tuple[Path, int]:
    """A first output stopped partway (the daemon killed after 20 commits), then extended to
    the whole job by a resumed extraction; (its directory, files before the resume)."""
    data = work / "part.jsonl"
    data.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[:60]))
    out = work / "grown"
    args = ("run", "--model", ".demo/model", "--dataset", str(data), "--output", str(out))
    run_eagle3d(*args, cwd=work, env={"EAGLE3D_FAULT": "kill:after_rename:20"})
    before = len(list(out.glob("rows_*/data_*.ckpt")))
    assert before == 20
    return out, before


def test_a_second_run_on_an_output_extended_by_a_resumed_extraction(
    work: Path, grown: tuple[Path, int]
) -> None:
    """Train on the stopped output, resume the extraction, and train again from the first
    drafter's weights (the doc's warm start); SpecForge's full resume refuses the grown
    dataset, as the doc says."""
    out, before = grown
    first = ("output_dir=.demo/drafter", f"data.hidden_states_path={out}")
    assert_trained(*train(work, "train", *first), 3)
    run_eagle3d(
        "run",
        "--model",
        ".demo/model",
        "--dataset",
        str(work / "part.jsonl"),
        "--output",
        str(out),
        cwd=work,
    )
    report = verify_json(out)
    after = len(list(out.glob("rows_*/data_*.ckpt")))
    assert report["ok"] and report["saved"] == after == 59 > before
    assert report["shards"][0]["finished"]
    rc, log, steps = train(work, "warm-start", f"data.hidden_states_path={out}")
    assert_trained(rc, log, steps, 3)
    assert (work / ".demo" / "drafter-2" / "specforge-run-step3" / "training_state.pt").is_file()
    refused = ("training.resume_from=.demo/drafter", "output_dir=.demo/drafter-3")
    rc, log, _ = train(work, "train", f"data.hidden_states_path={out}", *refused)
    said = re.search(r"dataset_size=(\d+) but this run has dataset_size=(\d+)", log)
    assert rc != 0 and said is not None, log[-3000:]
    assert (int(said[1]), int(said[2])) == (before, after)
    doc = re.search(r"dataset_size=(\d+) but this run has\s+dataset_size=(\d+)", DOC.read_text())
    assert doc is not None and (int(doc[1]), int(doc[2])) == (before, after)


def test_float32_storage_is_refused_by_specforges_own_trainer(work: Path) -> None:
    """The same extraction stored in float32 (asked for): SpecForge's bfloat16 target head
    refuses it at the first step, with its own error (the check can fail)."""
    data = work / "few.jsonl"
    data.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[:12]))
    out = work / "fp32"
    run_eagle3d(
        "run",
        "--model",
        ".demo/model",
        "--dataset",
        str(data),
        "--output",
        str(out),
        "--store-dtype",
        "float32",
        cwd=work,
    )
    assert verify_json(out)["shards"][0]["store_dtype"] == "float32"
    rc, log, steps = train(work, "train", f"data.hidden_states_path={out}", "output_dir=fp32-run")
    assert rc != 0 and not steps
    assert FP32_ERROR in log, log[-3000:]
    assert FP32_ERROR in DOC.read_text()
