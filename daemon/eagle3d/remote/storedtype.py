"""The storage dtype of a job: what the hidden states are written in, apart from what the
model computes in.

A drafter trainer reads the states in the target model's own 16-bit dtype (SpecForge 0.2.0
feeds ``hidden_state`` uncast to a bfloat16 target head), while the right compute dtype
depends on the hardware (float32 on a CPU, where bfloat16 matmuls are 4-5x slower). So
``store_dtype`` (``--store-dtype``) is its own setting:

* ``auto`` (the default): the model's own 16-bit dtype from its ``config.json``
  (``torch_dtype`` / ``dtype``, the text config's for multimodal wrappers), else bfloat16,
  whatever the compute dtype is;
* ``bfloat16``, ``float16``, ``float32``: that dtype (float32 only when asked);
* ``fp8``: e4m3 values with one float32 scale per token per tensor (:mod:`eagle3d.store.fp8`),
  about half the bytes of bfloat16. The files hold two more tensors, ``hidden_state_scale``
  and ``aux_hidden_state_scale`` (``[1, T, 1]`` each); readers dequantize
  (:mod:`eagle3d.reader`). Never chosen by ``auto``.

A value names a *storage format*, not only a dtype: :data:`FORMATS` maps each name to what
the files hold. The resolved name is what the job's fingerprint, the journal's
``run_started`` record (``job.store_dtype``) and ``verify`` carry.

The producers put the states in the stored format where they are made (:func:`to_stored`:
on the GPU before the device-to-host copy, or in the CPU worker's dump writer): cast to
the stored dtype, or for fp8 quantized with their scales, so that the daemon only moves
bytes (a dump in the stored format is committed as it is). A dump in the format's *dump
dtype* (bfloat16 for fp8: an SGLang server's) is quantized by the commit, fused into its
read of the dump (:mod:`eagle3d.store.splice`). The commit casts (or quantizes) whatever arrives in another
float dtype (an SGLang server started without the setting), so the files are in the job's
format whichever producer wrote the dumps. Pure Python: torch is imported only by
:func:`cast`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

AUTO = "auto"
#: What ``auto`` becomes for a model whose config names no 16-bit dtype.
FALLBACK = "bfloat16"


STATES = ("hidden_state", "aux_hidden_state")
#: The keys of every sample file, in the order they are written.
BASE_KEYS = ("input_ids", "loss_mask", *STATES)
SCALE_SUFFIX = "_scale"


@dataclass(frozen=True, slots=True)
class StoreFormat:
    """One storage format: its name (as configured and journaled), the torch dtype of the
    stored state tensors, the dtype the producers dump the states in for it (``dump``) and
    that dtype's code in a dump's safetensors header, and whether the states are stored
    with per-token scales (fp8)."""

    name: str
    torch_dtype: str
    safetensors: str
    dump: str = ""  # '' : torch_dtype
    scaled: bool = False

    @property
    def dump_dtype(self) -> str:
        """The torch dtype name of the states in this format's dumps."""
        return self.dump or self.torch_dtype

    @property
    def keys(self) -> tuple[str, ...]:
        """The keys of a sample file in this format, in their order."""
        if self.scaled:
            return (*BASE_KEYS, *(k + SCALE_SUFFIX for k in STATES))
        return BASE_KEYS


FORMATS: dict[str, StoreFormat] = {
    "bfloat16": StoreFormat("bfloat16", "bfloat16", "BF16"),
    "float16": StoreFormat("float16", "float16", "F16"),
    "float32": StoreFormat("float32", "float32", "F32"),
    "fp8": StoreFormat("fp8", "float8_e4m3fn", "BF16", dump="bfloat16", scaled=True),
}
#: The values ``--store-dtype`` and the ``store_dtype`` key accept.
CHOICES = (AUTO, *FORMATS)


def get(name: str) -> StoreFormat:
    """The format of a resolved name. Raises ValueError naming the known ones."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"store_dtype: {name!r} is not one of {', '.join(CHOICES)}") from None


def model_dtype(config: dict[str, Any]) -> str:
    """The dtype a model's ``config.json`` names (``dtype``, or ``torch_dtype`` as written
    before transformers 5), the text config's first for multimodal wrappers; '' if none."""
    for cfg in (config.get("text_config"), config):
        if isinstance(cfg, dict):
            for key in ("dtype", "torch_dtype"):
                value = cfg.get(key)
                if isinstance(value, str) and value:
                    return value.removeprefix("torch.")
    return ""


def resolve(value: str, config: dict[str, Any]) -> StoreFormat:
    """The format ``value`` (a :data:`CHOICES` entry) means for a model with this
    ``config.json``: ``auto`` is the model's own 16-bit dtype, else bfloat16."""
    if value != AUTO:
        return get(value)
    own = model_dtype(config)
    return FORMATS[own if own in ("bfloat16", "float16") else FALLBACK]


def cast(t: torch.Tensor, fmt: StoreFormat) -> torch.Tensor:
    """``t`` in the format's dump dtype (``t`` itself when it already is): one pass,
    rounding to nearest even, wherever ``t`` lives. For the unscaled formats that is the
    stored dtype; fp8's quantization is :func:`to_stored`'s (or the commit's)."""
    import torch

    return t.to(getattr(torch, fmt.dump_dtype))


#: e4m3's largest finite value: a row's largest magnitude maps onto it.
FP8_MAX = 448.0


def to_stored(t: torch.Tensor, fmt: StoreFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``t`` (``[..., D]``) exactly as a sample file of format ``fmt`` stores it, wherever
    ``t`` lives (on the GPU before the copy to the host, so that the daemon only moves
    bytes): (values, None) for the unscaled formats (:func:`cast`), (e4m3 values, float32
    scales ``[..., 1]``) for fp8, one scale per row: the bytes the commit's own
    quantization makes (:func:`eagle3d.store.fp8.quantize`, which is this function)."""
    if not fmt.scaled:
        return cast(t, fmt), None
    return quantize(t, 1)


def to_stored_checked(
    t: torch.Tensor, fmt: StoreFormat | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """:func:`to_stored` (``fmt`` None: ``t`` as it is) and, per row of ``t`` (its last
    dimension reduced), whether what is stored is finite, computed where ``t`` lives: the
    stored values for the unscaled formats (a float16 overflow is not finite), ``t`` itself
    for fp8, whose scaled values cannot overflow (a NaN or an Inf in a row makes its scale
    so)."""
    import torch

    if fmt is None:
        return t, None, torch.isfinite(t).all(-1)
    values, scales = to_stored(t, fmt)
    return values, scales, torch.isfinite(t if fmt.scaled else values).all(-1)


def quantize(x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (``[..., D]``, any float dtype, any device) as (e4m3 values ``[..., D]``,
    float32 scales ``[..., groups]``): ``s = amax / 448`` per part (1 for an all-zero one),
    ``q = x / s`` rounded to nearest. ``D`` must be a multiple of ``groups``. A NaN or an Inf
    in a part makes its scale NaN or infinite (the commit's finite check sees it)."""
    import torch

    *lead, d = x.shape
    if groups < 1 or d % groups:
        raise ValueError(f"last dimension {d} is not divisible into {groups} group(s)")
    xf = x.reshape(*lead, groups, d // groups).to(torch.float32, copy=True)
    # Two reductions (max, min) instead of abs().amax(): no temporary of the input's size.
    amax = torch.maximum(xf.amax(-1), xf.amin(-1).neg_())
    scale = amax.div_(FP8_MAX)
    scale = scale.masked_fill_(scale == 0, 1.0)
    xf.div_(scale.unsqueeze(-1))
    return xf.to(torch.float8_e4m3fn).reshape(*lead, d), scale
