"""One capture, every drafter: a DFlash job on a 10-layer tiny model (issue #30's must-show).

``eagle3d run --recipe dflash --layers 1,3,5,7,9`` (HF backend, float32 stored) must store,
for every sample, exactly what an independent plain Hugging Face forward gives at the
documented index (layer id i = ``output_hidden_states[i]``, the last state
``output_hidden_states[L]``), within 1e-5; the capture contract says so in words; a resume
that would change the layers or the chat template is refused (exit 6); ``verify --reference``
passes, and fails on a sample whose layer was planted from the wrong depth, naming it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import runkit
import torch
from eagle3d.exitcodes import EXIT_CONFIG, EXIT_FINGERPRINT
from eagle3d.reader import HiddenStates, load_record
from eagle3d.remote import recipes
from eagle3d.tools import reference
from eagle3d.tools.tinymodel import build_tiny_model

LAYERS = [1, 3, 5, 7, 9]


@pytest.fixture(scope="module")
def dflash_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("dflash")
    model = Path(build_tiny_model(root / "model", layers=10))
    data = root / "data.jsonl"
    runkit.dataset(data, 5, malformed=False)
    out = root / "out"
    layers = ",".join(map(str, LAYERS))
    r = runkit.run(
        model, data, out, "--recipe", "dflash", "--layers", layers, "--store-dtype", "float32"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return {"model": model, "data": data, "out": out}


def hf_states(model: Path, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.inference_mode():
        return tuple(net(input_ids=ids[None], output_hidden_states=True).hidden_states)


def test_every_tensor_equals_an_independent_hf_forward(dflash_job: dict[str, Any]) -> None:
    ds = HiddenStates(dflash_job["out"], torch.float32)
    assert len(ds) == 5 and ds.recipe == "dflash"
    for i in range(len(ds)):
        s = ds[i]
        hs = hf_states(dflash_job["model"], s["input_ids"])
        assert len(hs) == 11  # embeddings + 10 layers
        h = hs[0].shape[-1]
        aux, last = s["aux_hidden_state"][0], s["hidden_state"][0]
        assert aux.shape == (len(s["input_ids"]), len(LAYERS) * h)
        for j, layer in enumerate(LAYERS):
            torch.testing.assert_close(aux[:, j * h : (j + 1) * h], hs[layer][0], atol=1e-5, rtol=0)
            # ... and not the neighbouring depth: the index convention is the one stated.
            assert (aux[:, j * h : (j + 1) * h] - hs[layer + 1][0]).abs().max() > 1e-3
        torch.testing.assert_close(last, hs[10][0], atol=1e-5, rtol=0)
        # SpecForge v0.3.0's DFlash record: input_ids, loss_mask, hidden_states [1, T, 5H].
        rec = load_record(ds.catalog.path(ds.entries[i]), "dflash", torch.float32)
        assert list(rec) == ["input_ids", "loss_mask", "hidden_states"]
        assert rec["hidden_states"].shape == (1, len(s["input_ids"]), len(LAYERS) * h)


def test_the_capture_contract_states_the_convention(dflash_job: dict[str, Any]) -> None:
    c = json.loads((dflash_job["out"] / ".eagle3d" / "capture.json").read_text())
    assert (c["recipe"], c["layers"], c["store_dtype"]) == ("dflash", LAYERS, "float32")
    assert c["layer_convention"] == recipes.CONVENTION
    assert "output_hidden_states[i]" in c["layer_convention"]
    assert c["last_state"].startswith("post-norm")
    assert c["compute_dtype"] == "float32"
    assert sorted(c["record"]) == ["hidden_states", "input_ids", "loss_mask"]
    for k in ("model_config", "weights_index", "tokenizer", "chat_template"):
        assert len(c[k]) == 32, k


def test_a_resume_that_would_change_the_capture_is_refused(
    dflash_job: dict[str, Any], tmp_path: Path
) -> None:
    model, data, out = dflash_job["model"], dflash_job["data"], dflash_job["out"]
    before = (out / ".eagle3d" / "capture.json").read_bytes()
    r = runkit.run(model, data, out, "--recipe", "dflash", "--layers", "1,3,5,7,8")
    assert r.returncode == EXIT_FINGERPRINT, r.stderr[-2000:]
    # The model's chat template changes, nothing else: only the contract sees it.
    copy = tmp_path / "model"
    subprocess.run(["cp", "-r", str(model), str(copy)], check=True)
    tc = copy / "tokenizer_config.json"
    cfg = json.loads(tc.read_text())
    cfg["chat_template"] = (cfg.get("chat_template") or "") + "{# changed #}"
    tc.write_text(json.dumps(cfg))
    args = ("--recipe", "dflash", "--layers", "1,3,5,7,9", "--store-dtype", "float32")
    r = runkit.run(copy, data, out, *args)
    # The job's model path is part of what it records, not of its fingerprint; the contract
    # holds the template's hash.
    assert r.returncode == EXIT_FINGERPRINT, r.stderr[-2000:]
    assert "chat_template" in r.stderr
    assert (out / ".eagle3d" / "capture.json").read_bytes() == before


def test_too_few_layers_for_the_default_is_refused_naming_the_count(tmp_path: Path) -> None:
    model = Path(build_tiny_model(tmp_path / "m3", layers=3))
    data = tmp_path / "d.jsonl"
    runkit.dataset(data, 2, malformed=False)
    r = runkit.run(model, data, tmp_path / "o")
    assert r.returncode == EXIT_CONFIG
    assert "3 layers" in r.stderr
    assert not (tmp_path / "o" / ".eagle3d" / "capture.json").exists()


def test_verify_reference_passes_then_names_a_planted_wrong_layer(
    dflash_job: dict[str, Any], tmp_path: Path
) -> None:
    out = dflash_job["out"]
    r = subprocess.run(
        [sys.executable, "-m", "eagle3d", "verify", "-o", str(out), "--reference", "3"],
        capture_output=True,
        text=True,
        env=runkit.env_without_faults(),
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 sample(s), 18 tensor(s)" in r.stdout and "all within tolerance" in r.stdout
    # Plant layer 6's state where layer 5's belongs in one sample (a copy of the output).
    planted = tmp_path / "planted"
    subprocess.run(["cp", "-r", str(out), str(planted)], check=True)
    ds = HiddenStates(planted, torch.float32)
    path = ds.catalog.path(ds.entries[-1])
    raw = torch.load(path, weights_only=True)
    hs = hf_states(dflash_job["model"], raw["input_ids"])
    h = hs[0].shape[-1]
    j = LAYERS.index(5)
    raw["aux_hidden_state"][0, :, j * h : (j + 1) * h] = hs[6][0]
    torch.save(raw, path)
    rep = reference.check_reference(str(planted), 5)
    assert not rep.ok and len(rep.mismatches) == 1, rep.mismatches
    msg = rep.mismatches[0]
    assert f"sample {ds.entries[-1].idx}: hidden_states (aux_hidden_state) layer 5:" in msg
    assert "atol 1e-05 + rtol 1e-05" in msg


def test_tolerances_follow_the_stored_dtype() -> None:
    assert reference.tolerance("float32").atol == 1e-5
    assert reference.tolerance("bfloat16").rtol == 2.0**-7
    assert reference.tolerance("fp8").per_token
    assert reference.spread(10, 3) == [0, 4, 9] or reference.spread(10, 3) == [0, 5, 9]
    assert reference.spread(2, 5) == [0, 1]


@pytest.fixture(scope="module")
def dspark_job(dflash_job: dict[str, Any]) -> Path:
    out = dflash_job["out"].parent / "dspark"
    args = ("--recipe", "dspark", "--layers", "1,3,5,7,9")  # bfloat16 stored (the default)
    r = runkit.run(dflash_job["model"], dflash_job["data"], out, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def export(out: Path, to: Path, fmt: str) -> None:
    cmd = [sys.executable, "-m", "eagle3d", "export", "-o", str(out), "--to", str(to)]
    r = subprocess.run(
        [*cmd, "--format", fmt], env=runkit.ENV, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr


def speculators_rows(folder: Path) -> dict[tuple[int, ...], int]:
    """The row of a speculators export's index (its ``hs_<row>`` file) by the row's ids."""
    import pyarrow as pa

    with pa.OSFile(str(folder / "data-00000-of-00001.arrow")) as f:
        ids = pa.ipc.open_stream(f).read_all().column("input_ids").to_pylist()
    return {tuple(row): k for k, row in enumerate(ids)}


@pytest.mark.parametrize("recipe", ["dflash", "dspark"])
def test_exports_give_each_trainer_its_recipes_record(
    recipe: str, dflash_job: dict[str, Any], dspark_job: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    src = dflash_job["out"] if recipe == "dflash" else dspark_job
    export(src, tmp_path / "sf", "specforge")
    export(src, tmp_path / "sp", "speculators")
    ds = HiddenStates(src)
    assert ds.recipe == recipe
    files = {int(f.stem.removeprefix("data_")): f for f in (tmp_path / "sf").rglob("*.ckpt")}
    assert sorted(files) == [e.idx for e in ds.entries]
    row_of = speculators_rows(tmp_path / "sp")
    assert len(row_of) == len(ds)
    for k in range(len(ds)):
        item = ds[k]
        d = torch.load(files[item["idx"]], weights_only=True)
        want = recipes.get(recipe).record(
            item["input_ids"], item["loss_mask"], item["aux_hidden_state"], item["hidden_state"]
        )
        assert list(d) == list(want)  # SpecForge v0.3.0's keys, in its writer's order
        for key in want:
            assert torch.equal(d[key], want[key]), key
        if recipe == "dspark":
            assert d["target_last_hidden_states"].shape == item["hidden_state"].shape
        # speculators: [T, layers + 1, H], the five layers then the last state, in the file
        # of the index's row that holds this sample's ids (rows go in the journal's order).
        row = row_of[tuple(item["input_ids"].flatten().tolist())]
        hs = load_file(str(tmp_path / "sp" / "hidden_states" / f"hs_{row}.safetensors"))
        t, h = item["hidden_state"].shape[1:]
        assert hs["hidden_states"].shape == (t, len(LAYERS) + 1, h)
        assert torch.equal(hs["hidden_states"][:, :-1].flatten(1), item["aux_hidden_state"][0])


def test_plan_sizes_a_recipe_exactly(
    dflash_job: dict[str, Any], dspark_job: Path, tmp_path: Path
) -> None:
    """``eagle3d plan`` with the job's flags foresees the sample files' bytes exactly, for five
    layers as for three; fp8 is planned the same way (its files are sized by the same code)."""
    from eagle3proto import events as ev

    model, data = dflash_job["model"], dflash_job["data"]
    cmd = [sys.executable, "-m", "eagle3d", "plan", "--model", str(model), "--dataset", str(data)]
    layers = ("--recipe", "dspark", "--layers", ",".join(map(str, LAYERS)))
    plans = {}
    for dt in ("bfloat16", "fp8"):
        r = subprocess.run(
            [*cmd, "--output", str(tmp_path / "fresh"), "--json", *layers, "--store-dtype", dt],
            env=runkit.ENV,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.stdout.startswith("{"), r.stderr[-3000:]
        plans[dt] = json.loads(r.stdout)["shards"][0]["files_bytes"]
    saved = [e for e in runkit.events(dspark_job) if isinstance(e, ev.SampleSaved)]
    assert plans["bfloat16"] == sum(e.bytes for e in saved)
    assert plans["fp8"] < plans["bfloat16"]
