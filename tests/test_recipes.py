"""Recipes: default layers, layer checks, and draft configs read with each project's index
convention (SpecForge/z-lab: the output of layer j = eagle3d's j + 1; speculators: as is).

The draft configs below are the shapes of SpecForge's own ``configs/*.json`` (read in
sgl-project/SpecForge@a6b6b023) and speculators 0.9.0's config classes. Their own resolvers
are checked against in tests/test_downstream_readers.py (speculators, in its environment)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from eagle3d.remote import recipes
from eagle3d.remote.recipes import LayerError, default_layers, from_draft_config, resolve_job

QWEN3_8B_DFLASH = {
    "architectures": ["DFlashDraftModel"],
    "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "num_target_layers": 36,
}


def write(tmp_path: Path, cfg: dict[str, object], name: str = "config.json") -> str:
    p = tmp_path / name
    p.write_text(json.dumps(cfg))
    return str(p)


def test_records_follow_specforge_v030_layouts() -> None:
    keys = {n: list(recipes.get(n).record(1, 2, 3, 4)) for n in recipes.NAMES}
    assert keys["eagle3"] == ["input_ids", "loss_mask", "aux_hidden_state", "hidden_state"]
    assert keys["p-eagle"] == keys["eagle3.1"] == keys["eagle3"]
    assert keys["dflash"] == ["input_ids", "loss_mask", "hidden_states"]
    assert keys["domino"] == keys["dflash"]
    assert keys["dspark"] == [
        "input_ids",
        "loss_mask",
        "hidden_states",
        "target_last_hidden_states",
    ]


def test_default_layers_are_distinct_and_refuse_small_models() -> None:
    assert default_layers("eagle3", 36) == [2, 18, 33]
    assert default_layers("eagle3", 4) == [1, 2, 3]
    with pytest.raises(LayerError, match="3 layers"):
        default_layers("eagle3", 3)
    # z-lab's build_target_layer_ids(36, 5) = [1, 9, 17, 25, 33], plus one.
    assert default_layers("dflash", 36) == [2, 10, 18, 26, 34]
    for n in range(8, 90):
        ids = default_layers("dspark", n)
        assert len(set(ids)) == 5 and all(1 <= i < n for i in ids), n
    with pytest.raises(LayerError, match="6 layers"):
        default_layers("dflash", 6)


def test_layer_checks_name_the_problem() -> None:
    assert recipes.resolve("dflash", [1, 3, 5, 7, 9], 10) == [1, 3, 5, 7, 9]
    with pytest.raises(LayerError, match=r"outside 1\.\.9 of a 10-layer"):
        recipes.resolve("dflash", [1, 3, 5, 7, 10], 10)
    with pytest.raises(LayerError, match="repeat"):
        recipes.resolve("dflash", [1, 3, 3], 10)
    with pytest.raises(LayerError, match="takes 3"):
        recipes.resolve("eagle3", [1, 3, 5, 7], 10)
    with pytest.raises(LayerError, match="outside"):
        recipes.resolve("eagle3", [0, 3, 5], 10)  # 0 is the embeddings


def test_specforge_dflash_family_configs_add_one(tmp_path: Path) -> None:
    d = from_draft_config(write(tmp_path, QWEN3_8B_DFLASH), 36)
    assert (d.recipe, d.layers) == ("dflash", [2, 10, 18, 26, 34])
    for arch, recipe in (("DSparkDraftModel", "dspark"), ("DominoDraftModel", "domino")):
        cfg = {**QWEN3_8B_DFLASH, "architectures": [arch]}
        assert from_draft_config(write(tmp_path, cfg), 36).recipe == recipe
    missing = {**QWEN3_8B_DFLASH, "dflash_config": {"mask_token_id": 1}}
    with pytest.raises(LayerError, match="target_layer_ids"):
        from_draft_config(write(tmp_path, missing), 36)


def test_specforge_eagle_configs_add_one(tmp_path: Path) -> None:
    eagle = {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1}
    # No ids: SpecForge's default [1, L//2 - 1, L - 4] = SGLang's [2, L//2, L - 3].
    d = from_draft_config(write(tmp_path, eagle), 36)
    assert (d.recipe, d.layers) == ("eagle3", [2, 18, 33])
    given = {**eagle, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 20, 30]}}
    assert from_draft_config(write(tmp_path, given), 36).layers == [2, 21, 31]
    v31 = {**eagle, "fc_norm": True, "norm_output": True}
    assert from_draft_config(write(tmp_path, v31), 36).recipe == "eagle3.1"
    peagle = {"architectures": ["PEagleDraftModel"], "eagle_config": {}}
    assert from_draft_config(write(tmp_path, peagle), 36).recipe == "p-eagle"


def test_speculators_configs_are_taken_as_is(tmp_path: Path) -> None:
    e3 = {"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": [2, 18, 33]}
    d = from_draft_config(write(tmp_path, e3), 36)
    assert (d.recipe, d.layers) == ("eagle3", [2, 18, 33])
    # speculators' DFlash converter: z-lab's [1, 9, 17, 25, 33] -> [2, 10, 18, 26, 34].
    df = {"speculators_model_type": "dflash", "aux_hidden_state_layer_ids": [2, 10, 18, 26, 34]}
    assert from_draft_config(write(tmp_path, df), 36).layers == [2, 10, 18, 26, 34]
    ds = {**df, "speculators_model_type": "dspark"}
    assert from_draft_config(write(tmp_path, ds), 36).recipe == "dspark"
    # Its default when unset: resolve_target_layer_ids' [2, L//2, L-3].
    bare = {"speculators_model_type": "peagle"}
    assert from_draft_config(write(tmp_path, bare), 36).layers == [2, 18, 33]
    bad = {"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": "2,3"}
    with pytest.raises(LayerError, match="eagle_aux_hidden_state_layer_ids"):
        from_draft_config(write(tmp_path, bad), 36)


def test_the_same_drafter_resolves_the_same_layers_from_either_project(tmp_path: Path) -> None:
    sf = from_draft_config(write(tmp_path, QWEN3_8B_DFLASH, "sf.json"), 36)
    sp = {"speculators_model_type": "dflash", "aux_hidden_state_layer_ids": [2, 10, 18, 26, 34]}
    assert from_draft_config(write(tmp_path, sp, "sp.json"), 36).layers == sf.layers


def test_resolve_job_combines_flags_and_draft_config(tmp_path: Path) -> None:
    path = write(tmp_path, QWEN3_8B_DFLASH)
    assert resolve_job("", [], path, 36)[:2] == ("dflash", [2, 10, 18, 26, 34])
    assert resolve_job("dspark", [], path, 36)[0] == "dspark"  # same family: the flag wins
    with pytest.raises(LayerError, match="eagle family"):
        resolve_job("eagle3", [], path, 36)
    with pytest.raises(LayerError, match="--layers says"):
        resolve_job("", [1, 2, 3, 4, 5], path, 36)
    assert resolve_job("", [], "", 36)[:2] == ("eagle3", [2, 18, 33])
    with pytest.raises(LayerError, match="no such draft config"):
        resolve_job("", [], str(tmp_path / "none.json"), 36)
