"""``eagle3d verify --reference N``: recompute N samples with a plain Hugging Face forward and
compare every stored tensor with it.

The samples are spread evenly over the output's committed ones (the first and the last
included). Each is run alone (no batch, no padding: independent of how the producer batched
it) through ``AutoModelForCausalLM`` with ``output_hidden_states=True``; layer id ``i`` of
the capture contract is ``hidden_states[i]`` (:data:`eagle3d.remote.recipes.CONVENTION`),
the last state ``hidden_states[L]`` (post-norm). Every layer's slice and the last state must
agree within the stored dtype's tolerance (:func:`tolerance`); a mismatch names the sample,
the tensor (the recipe's record name and eagle3d's stored one), the layer, the largest
difference and the tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eagle3d.remote import recipes
from eagle3d.run import capture
from eagle3d.store import catalog


@dataclass(frozen=True, slots=True)
class Tolerance:
    """``|stored - reference| <= atol + rtol * |reference|``, elementwise; for fp8 ``atol``
    is a fraction of each token's largest magnitude (its scale)."""

    atol: float
    rtol: float
    per_token: bool = False

    def __str__(self) -> str:
        unit = " x token max" if self.per_token else ""
        return f"atol {self.atol:g}{unit} + rtol {self.rtol:g}"


def tolerance(store_dtype: str, compute_dtype: str = "float32") -> Tolerance:
    """The stored dtype's rounding (half an ulp, doubled for safety: bfloat16 2^-8 relative,
    float16 2^-11, e4m3 2^-4 of the value plus its subnormal step of the token's scale), plus
    what a float32 forward run in another batch shape may differ by (1e-5). A 16-bit compute
    dtype adds its own error, which grows with depth: 2^-5 relative, loose on purpose."""
    base = {
        "float32": Tolerance(1e-5, 1e-5),
        "bfloat16": Tolerance(1e-4, 2.0**-7),
        "float16": Tolerance(1e-4, 2.0**-10),
        "fp8": Tolerance(2.0**-9, 2.0**-3, per_token=True),
    }.get(store_dtype, Tolerance(1e-5, 1e-5))
    if compute_dtype in ("bfloat16", "float16"):
        return Tolerance(max(base.atol, 2.0**-5), base.rtol + 2.0**-5, base.per_token)
    return base


@dataclass(slots=True)
class ReferenceReport:
    checked: list[int] = field(default_factory=list)  # sample ids
    tensors: int = 0
    mismatches: list[str] = field(default_factory=list)
    worst: float = 0.0  # the largest |difference| seen
    tolerance: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.checked) and not self.mismatches

    def to_dict(self) -> dict[str, Any]:
        return {
            "checked": self.checked,
            "tensors": self.tensors,
            "mismatches": self.mismatches,
            "worst": self.worst,
            "tolerance": self.tolerance,
            "ok": self.ok,
        }

    def __str__(self) -> str:
        if not self.checked:
            return "reference: no committed sample to recompute"
        head = (
            f"reference: {len(self.checked)} sample(s), {self.tensors} tensor(s) recomputed "
            f"with a plain Hugging Face forward; largest difference {self.worst:.3g} "
            f"(tolerance {self.tolerance})"
        )
        if self.ok:
            return head + ": all within tolerance"
        return "\n".join([head, *(f"  MISMATCH {m}" for m in self.mismatches)])


def spread(n_items: int, n: int) -> list[int]:
    """``n`` positions spread evenly over ``n_items`` (both ends included)."""
    if n_items <= 0 or n <= 0:
        return []
    if n >= n_items:
        return list(range(n_items))
    if n == 1:
        return [0]
    return sorted({round(k * (n_items - 1) / (n - 1)) for k in range(n)})


def check_reference(output: str, n: int, model: str = "") -> ReferenceReport:
    """Recompute ``n`` samples of ``output``. Raises catalog.NoJournal without a journal,
    ValueError when the output says nothing of its model or layers."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from eagle3d.store.reader import load_sample

    cat = catalog.read(output)
    job = cat.job
    if job is None:
        raise ValueError(f"{output}: the journal names no job")
    contract = capture.read(output) or {}
    layers = list(contract.get("layers") or job.aux_layers)
    recipe = recipes.get(str(contract.get("recipe") or job.recipe or recipes.DEFAULT))
    store = str(contract.get("store_dtype") or job.store_dtype or "bfloat16")
    compute = str(contract.get("compute_dtype") or "float32")
    ref_dtype = compute if compute in ("float32", "bfloat16", "float16") else "float32"
    tol = tolerance(store, ref_dtype)
    report = ReferenceReport(tolerance=str(tol))
    entries = cat.entries
    picked = [entries[i] for i in spread(len(entries), n)]
    if not picked:
        return report
    path = model or job.model
    hf_logging.disable_progress_bar()
    net = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, ref_dtype))
    net.eval()
    for entry in picked:
        sample = load_sample(cat.path(entry), torch.float32)
        with torch.inference_mode():
            out = net(input_ids=sample["input_ids"][None], output_hidden_states=True)
        hs = out.hidden_states
        aux, last = sample["aux_hidden_state"][0], sample["hidden_state"][0]
        h = last.shape[-1]
        pairs = [
            (
                f"{recipe.layers_key} (aux_hidden_state)",
                f"layer {i}",
                aux[:, j * h : (j + 1) * h],
                hs[i][0],
            )
            for j, i in enumerate(layers)
        ]
        name = recipe.last_key or "last state"
        pairs.append(
            (f"{name} (hidden_state)", f"layer {len(hs) - 1} (post-norm)", last, hs[-1][0])
        )
        for tensor, layer, got, want in pairs:
            report.tensors += 1
            problem = _compare(got, want.float(), tol, report)
            if problem:
                report.mismatches.append(f"sample {entry.idx}: {tensor} {layer}: {problem}")
        report.checked.append(entry.idx)
    return report


def _compare(got: Any, want: Any, tol: Tolerance, report: ReferenceReport) -> str:
    """'' when ``got`` is within ``tol`` of ``want``, else what differs and by how much."""
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)}, the reference's {tuple(want.shape)}"
    diff = (got - want).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    report.worst = max(report.worst, worst)
    atol: Any = tol.atol
    if tol.per_token:
        atol = tol.atol * want.abs().amax(dim=-1, keepdim=True)
    bound = atol + tol.rtol * want.abs()
    over = diff > bound
    if not bool(over.any()):
        return ""
    t = int(over.any(dim=-1).nonzero()[0][0])
    excess = float((diff - bound).max())
    return (
        f"max |difference| {worst:.3g} (first over tolerance at token {t}), "
        f"over tolerance ({tol}) by {excess:.3g}"
    )
