"""Recipes: which target states a drafter family trains on, and what its records hold.

One capture serves every drafter: the producers capture *the states entering* a set of
decoder layers plus the final (post-norm) state, and a recipe says which layers and how a
trainer's record names them.

**eagle3d's layer index convention**: layer id ``i`` is the state entering decoder layer
``i``, which is Hugging Face's ``output_hidden_states[i]`` (``0`` would be the embeddings;
ids run ``1 .. L-1`` for a model of ``L`` layers). Other projects count differently, and
:func:`from_draft_config` converts their ids:

* SpecForge and SGLang (EAGLE-3's ``eagle_config.eagle_aux_hidden_state_layer_ids``, and
  DFlash/DSpark/Domino's ``dflash_config.target_layer_ids``, z-lab's convention): id ``j``
  is the *output* of layer ``j``, SGLang captures the state entering layer ``j + 1``
  (``set_eagle3_layers_to_capture``/``set_dflash_layers_to_capture`` add one; z-lab reads
  ``hidden_states[j + 1]``). eagle3d id = ``j + 1``.
* speculators (``speculators_model_type`` configs: ``eagle_aux_hidden_state_layer_ids``,
  ``aux_hidden_state_layer_ids``): ids index ``hidden_states`` directly. eagle3d id = ``j``
  (its DFlash converter maps z-lab's ``j`` to ``j + 1`` for the same reason).

Records, as SpecForge v0.3.0's ``OfflineCaptureLayout`` persists them (read in
sgl-project/SpecForge@a6b6b023, ``specforge/algorithms/*/providers.py``):

* eagle3, eagle3.1, p-eagle: ``input_ids [T]``, ``loss_mask [T]``,
  ``aux_hidden_state [1, T, kH]``, ``hidden_state [1, T, H]`` (the final state);
* dflash, domino: ``input_ids``, ``loss_mask``, ``hidden_states [1, T, kH]``;
* dspark: ``input_ids``, ``loss_mask``, ``hidden_states [1, T, kH]``,
  ``target_last_hidden_states [1, T, H]``.

Pure: standard library only (the HF worker and the SGLang hook import it too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CONVENTION = (
    "layer id i is the state entering decoder layer i (Hugging Face output_hidden_states[i]; "
    "0 would be the embeddings)"
)


@dataclass(frozen=True, slots=True)
class Recipe:
    """A drafter family's data: how many layers (0: any number), the record's key for the
    concatenated layer states, and for the final state (``""``: not in its record)."""

    name: str
    family: str  # "eagle" (three aux layers) or "dflash" (any number of target layers)
    layer_count: int
    layers_key: str
    last_key: str
    capture_method: str  # SpecForge's / SGLang's capture method name

    def record(self, input_ids: Any, loss_mask: Any, layers: Any, last: Any) -> dict[str, Any]:
        """The record SpecForge v0.3.0 persists for this recipe, from eagle3d's tensors
        (``layers [1, T, kH]``, ``last [1, T, H]``), in its key order."""
        out: dict[str, Any] = {"input_ids": input_ids, "loss_mask": loss_mask}
        out[self.layers_key] = layers
        if self.last_key:
            out[self.last_key] = last
        return out


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("eagle3", "eagle", 3, "aux_hidden_state", "hidden_state", "eagle3"),
        Recipe("eagle3.1", "eagle", 3, "aux_hidden_state", "hidden_state", "eagle3"),
        Recipe("p-eagle", "eagle", 3, "aux_hidden_state", "hidden_state", "eagle3"),
        Recipe("dflash", "dflash", 0, "hidden_states", "", "dflash"),
        Recipe("domino", "dflash", 0, "hidden_states", "", "dflash"),
        Recipe("dspark", "dflash", 0, "hidden_states", "target_last_hidden_states", "dspark"),
    )
}
NAMES = tuple(RECIPES)
DEFAULT = "eagle3"
#: Target layers of a DFlash-family default (z-lab's build_target_layer_ids, 5 draft layers).
DFLASH_DEFAULT_COUNT = 5


class LayerError(ValueError):
    """Layers that cannot be captured; the message names the model's layer count."""


def get(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise LayerError(f"recipe: {name!r} is not one of {', '.join(NAMES)}") from None


def default_layers(recipe: str, num_layers: int) -> list[int]:
    """The layers a recipe captures when none are given: distinct, in eagle3d's convention.

    EAGLE family: SGLang's ``[2, L//2, L-3]`` where those are distinct (``L >= 7``), else
    ``[1, L//2, L-1]`` (``L`` 4 to 6); fewer than 4 layers is refused. DFlash family: z-lab's
    ``build_target_layer_ids(L, 5)`` plus one (Qwen3-8B, 36 layers: ``[2, 10, 18, 26, 34]``,
    its ``[1, 9, 17, 25, 33]``), refused where those are not distinct (``L < 8``)."""
    r = get(recipe)
    if r.family == "eagle":
        if num_layers < 4:
            raise LayerError(
                f"the model has {num_layers} layers: {recipe} needs 3 distinct aux layers in "
                f"1..{max(num_layers - 1, 0)}, so at least 4 layers"
            )
        std = [2, num_layers // 2, num_layers - 3]
        return std if len(set(std)) == 3 else [1, num_layers // 2, num_layers - 1]
    n = DFLASH_DEFAULT_COUNT
    start, end = 1, num_layers - 3
    zlab = [round(start + i * (end - start) / (n - 1)) for i in range(n)]
    layers = [j + 1 for j in zlab]
    if len(set(layers)) != n or min(layers) < 1:
        raise LayerError(
            f"the model has {num_layers} layers: too few for {recipe}'s default of {n} "
            "distinct target layers; name them with --layers or --draft-config"
        )
    return layers


def check_layers(recipe: str, layers: list[int], num_layers: int) -> None:
    """Raise LayerError unless ``layers`` suit ``recipe`` on a model of ``num_layers``."""
    r = get(recipe)
    if r.layer_count and len(layers) != r.layer_count:
        raise LayerError(f"layers: {recipe} takes {r.layer_count} layer ids, got {layers}")
    if not layers:
        raise LayerError(f"layers: {recipe} needs at least one layer id")
    dup = sorted({i for i in layers if layers.count(i) > 1})
    if dup:
        raise LayerError(f"layers: {layers} repeat {dup}; every layer id must be distinct")
    bad = [i for i in layers if not 1 <= i < num_layers]
    if bad:
        raise LayerError(
            f"layers {bad} outside 1..{num_layers - 1} of a {num_layers}-layer model ({CONVENTION})"
        )


def resolve(recipe: str, layers: list[int], num_layers: int) -> list[int]:
    """The job's layers: the given ones checked, else the recipe's default."""
    out = list(layers) if layers else default_layers(recipe, num_layers)
    check_layers(recipe, out, num_layers)
    return out


@dataclass(frozen=True, slots=True)
class DraftLayers:
    """What a draft model's config says: the recipe, the layers in eagle3d's convention (an
    empty list: the project's default, resolved against the target), and how they were read."""

    recipe: str
    layers: list[int]
    source: str  # e.g. "SpecForge dflash_config.target_layer_ids (+1)"


def from_draft_config(path: str, num_layers: int) -> DraftLayers:
    """Read a draft model's ``config.json``. Raises LayerError naming the file and field."""
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LayerError(f"{path}: no such draft config") from None
    except (OSError, json.JSONDecodeError) as e:
        raise LayerError(f"{path}: unreadable draft config ({e})") from None
    if not isinstance(cfg, dict):
        raise LayerError(f"{path}: a draft config is a JSON object")
    return parse_draft_config(cfg, num_layers, path)


_SPECULATORS_TYPES = {
    "eagle3": "eagle3",
    "peagle": "p-eagle",
    "dflash": "dflash",
    "dflash2": "dflash",
    "dspark": "dspark",
}
_SPECFORGE_DFLASH = {
    "DFlashDraftModel": "dflash",
    "DSparkDraftModel": "dspark",
    "DominoDraftModel": "domino",
}


def parse_draft_config(cfg: dict[str, Any], num_layers: int, where: str = "") -> DraftLayers:
    """:func:`from_draft_config` on a parsed config."""
    at = f"{where}: " if where else ""
    stype = cfg.get("speculators_model_type")
    if stype is not None:  # speculators: ids index hidden_states directly
        if stype not in _SPECULATORS_TYPES:
            raise LayerError(f"{at}speculators_model_type {stype!r} is not a recipe eagle3d knows")
        recipe = _SPECULATORS_TYPES[stype]
        key = "eagle_aux_hidden_state_layer_ids" if get(recipe).family == "eagle" else None
        key = key or "aux_hidden_state_layer_ids"
        ids = _ids(cfg.get(key), f"{at}{key}")
        if ids is None:  # speculators' resolve_target_layer_ids default
            ids = [2, num_layers // 2, num_layers - 3]
        # speculators also accepts id L (the final state): eagle3d stores that one always.
        ids = [i for i in ids if i != num_layers]
        return DraftLayers(recipe, ids, f"speculators {key} (as is)")
    dflash = cfg.get("dflash_config")
    if isinstance(dflash, dict):  # SpecForge / z-lab: the output of layer j
        arch = [a for a in cfg.get("architectures") or [] if a in _SPECFORGE_DFLASH]
        ptype = dflash.get("projector_type")
        recipe = (
            _SPECFORGE_DFLASH[arch[0]]
            if arch
            else {"dspark": "dspark"}.get(str(ptype), "domino" if ptype == "domino" else "dflash")
        )
        ids = _ids(dflash.get("target_layer_ids"), f"{at}dflash_config.target_layer_ids")
        if not ids:
            raise LayerError(f"{at}dflash_config.target_layer_ids is missing or empty")
        return DraftLayers(
            recipe, [j + 1 for j in ids], "SpecForge dflash_config.target_layer_ids (+1)"
        )
    eagle = cfg.get("eagle_config")
    archs = cfg.get("architectures") or []
    recipe = "p-eagle" if "PEagleDraftModel" in archs else "eagle3"
    if cfg.get("fc_norm") or cfg.get("norm_output"):
        recipe = "eagle3.1"
    if isinstance(eagle, dict) or any("Eagle" in str(a) for a in archs):
        key = "eagle_config.eagle_aux_hidden_state_layer_ids"
        ids = _ids((eagle or {}).get("eagle_aux_hidden_state_layer_ids"), f"{at}{key}")
        if ids is None:  # SpecForge's default [1, L//2 - 1, L - 4], i.e. SGLang's
            ids = [1, num_layers // 2 - 1, num_layers - 4]
        return DraftLayers(recipe, [j + 1 for j in ids], f"SpecForge {key} (+1)")
    raise LayerError(
        f"{at}no layer ids: expected speculators_model_type, dflash_config.target_layer_ids "
        "or eagle_config.eagle_aux_hidden_state_layer_ids"
    )


def _ids(value: Any, field: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        raise LayerError(f"{field}: expected a list of ints, got {value!r}")
    return list(value)


def resolve_job(
    recipe: str, layers: list[int], draft_config: str, num_layers: int
) -> tuple[str, list[int], str]:
    """A job's (recipe, layers, where the layers came from) from its flags. A draft config
    gives both unless the flags do; flags that contradict it are refused (LayerError)."""
    source = "--layers" if layers else "default"
    if draft_config:
        d = from_draft_config(draft_config, num_layers)
        if recipe and get(recipe).family != get(d.recipe).family:
            raise LayerError(
                f"{draft_config}: a {d.recipe} draft config, but --recipe {recipe} asks for "
                f"the {get(recipe).family} family's data"
            )
        recipe = recipe or d.recipe
        if layers and d.layers and layers != d.layers:
            raise LayerError(
                f"{draft_config}: layers {d.layers} ({d.source}), but --layers says {layers}"
            )
        if not layers and d.layers:
            layers, source = d.layers, f"{draft_config}: {d.source}"
    recipe = recipe or DEFAULT
    return recipe, resolve(recipe, layers, num_layers), source
