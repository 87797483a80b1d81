"""fp8 hidden states: e4m3 values with one float32 scale per token per tensor.

Each token's row of a state tensor (``hidden_state``'s ``H`` values, ``aux_hidden_state``'s
``3H``) is stored as ``float8_e4m3fn`` values ``q`` with a scale ``s`` such that ``q * s``
is the state: ``s = amax / 448`` over the row (448 is e4m3's largest finite value), ``q =
x / s`` rounded to nearest. An all-zero row gets ``s = 1`` (its values are 0 either way), so
every scale is positive and finite, which :func:`check` (and ``verify``) can hold a file to.
The scales are stored beside the values as ``<name>_scale`` ``[1, T, 1]`` float32: 8 bytes
per token against ``4H`` of values.

Why not a finer granularity (a scale per captured layer of the aux row, or per block):
e4m3 keeps its full relative precision (3 mantissa bits, at most 2**-4 of a value) for every
value down to 2**-6 of the scale, i.e. down to ``amax / 28672`` of its row; only values
smaller than that lose digits. Real models' rows span less than that (their "massive
activations" are a few thousand times the typical value), and measured on the tiny model's
states a scale per layer lowered the error by 2 % of itself (2.56 % to 2.50 % relative;
on rows with 1,000x outlier channels 2.65 % to 2.63 % on the ordinary channels:
``bench/storage.py error``, docs/benchmarks.md) for two more scales per token: not worth a
format of its own. The functions here take a ``groups`` count anyway (the benchmark measures
both).

The error of each value is at most 2**-4 of it (rounding to nearest) at or above the
smallest normal of its row (``s * 2**-6``); smaller ones keep an absolute error of at most
``s * 2**-10``. :func:`bound` states this per element, the bound the tests hold the round
trip to.

Pure torch, no I/O: :func:`quantize` / :func:`dequantize` for whole tensors (the reader, the
exports, the commit's general path), :func:`quantize_rows_into` for the commit's fused path,
which quantizes a dump's rows chunk by chunk straight into their slots in the archive buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eagle3d.remote import storedtype

if TYPE_CHECKING:
    import torch

#: e4m3's largest finite value: a part's largest magnitude maps onto it.
FP8_MAX = storedtype.FP8_MAX
#: The stored value dtype and the scale dtype.
VALUE_DTYPE = "float8_e4m3fn"
SCALE_DTYPE = "float32"
#: Suffix of the scale tensor stored beside each state tensor (``hidden_state_scale``).
SCALE_SUFFIX = "_scale"


def quantize(x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (``[..., D]``, any float dtype) as (e4m3 values ``[..., D]``, float32 scales
    ``[..., groups]``). ``D`` must be a multiple of ``groups``. The producers' own
    (:func:`eagle3d.remote.storedtype.quantize`, which runs on the device too): one
    algorithm, the same bytes wherever it runs."""
    return storedtype.quantize(x, groups)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The states of e4m3 values ``q`` (``[..., D]``) and their scales (``[..., G]``), in
    ``dtype`` (default bfloat16); the products are formed in float32 and rounded once."""
    import torch

    *lead, d = q.shape
    g = scale.shape[-1]
    if tuple(scale.shape[:-1]) != tuple(lead) or g < 1 or d % g:
        raise ValueError(f"scales {tuple(scale.shape)} do not fit values {tuple(q.shape)}")
    x = q.reshape(*lead, g, d // g).to(torch.float32)
    x.mul_(scale.to(torch.float32).unsqueeze(-1))
    return x.reshape(*lead, d).to(dtype or torch.bfloat16)


def _scales(xf: torch.Tensor) -> torch.Tensor:
    """Per-part scales of ``xf`` (``[..., G, D/G]`` float32): amax / 448, 1 for zero parts.

    Two reductions (max, min) instead of ``abs().amax()``: no temporary of the input's size.
    A NaN or Inf in a part makes its scale NaN or Inf (the caller's finite check sees it)."""
    import torch

    amax = torch.maximum(xf.amax(-1), xf.amin(-1).neg_())
    scale = amax.div_(FP8_MAX)
    return scale.masked_fill_(scale == 0, 1.0)


def quantize_rows_into(
    src: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, groups: int
) -> None:
    """Quantize the rows of ``src`` (``[n, D]``, any float dtype) into ``values`` (``[n, D]``
    e4m3, or uint8 over the same bytes) and ``scales`` (``[n, groups]`` float32): the
    commit's fused path, one chunk of rows at a time from a cache-sized buffer."""
    import torch

    n, d = src.shape
    xf = src.reshape(n, groups, d // groups).to(torch.float32, copy=True)
    scale = _scales(xf)
    xf.div_(scale.unsqueeze(-1))
    if values.dtype == torch.uint8:
        values = values.view(torch.float8_e4m3fn)
    values.copy_(xf.reshape(n, d))
    scales.copy_(scale)


def bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The largest error :func:`quantize` then :func:`dequantize` may make on each element
    of ``x`` (``[..., D]``) with these scales (``[..., G]``): half a step of e4m3 at the
    element's magnitude (2**-4 of it at or above ``s * 2**-6``, ``s * 2**-10`` below), plus
    bfloat16's own rounding of the result (2**-8 of it)."""
    import torch

    *lead, d = x.shape
    g = scale.shape[-1]
    s = scale.to(torch.float32).unsqueeze(-1)
    mag = x.to(torch.float32).reshape(*lead, g, d // g).abs()
    step = torch.maximum(mag * 2.0**-4, s * 2.0**-10)
    return (step + (mag + step) * 2.0**-8).reshape(*lead, d)


def check(scale: torch.Tensor) -> str:
    """'' when every scale is positive and finite, else what is wrong (for ``verify``)."""
    import torch

    if scale.dtype != torch.float32:
        return f"dtype {str(scale.dtype).removeprefix('torch.')}, want float32"
    if scale.numel() and not bool(torch.isfinite(scale).all()):
        return "not finite"
    if scale.numel() and not bool((scale > 0).all()):
        return "not positive"
    return ""


STATES = ("hidden_state", "aux_hidden_state")


def dequantize_states(
    sample: dict[str, torch.Tensor], dtype: torch.dtype | None = None, max_len: int | None = None
) -> dict[str, torch.Tensor]:
    """A sample file's tensors (as ``torch.load`` returns them) with both states in ``dtype``
    (default bfloat16): dequantized when the file stores fp8 with scales, cast otherwise.
    The scale tensors are not returned. With ``max_len``, the states are cut to their first
    ``max_len`` tokens first (only those are dequantized); the ids and mask are left whole.
    """
    import torch

    out = {k: v for k, v in sample.items() if not k.endswith(SCALE_SUFFIX)}
    for name in STATES:
        x = sample.get(name)
        if x is None:
            continue
        scale = sample.get(name + SCALE_SUFFIX)
        if max_len is not None:
            x = x[..., :max_len, :]
            scale = scale[..., :max_len, :] if scale is not None else None
        if scale is not None:
            out[name] = dequantize(x, scale, dtype)
        elif x.dtype == torch.float8_e4m3fn:
            raise ValueError(f"{name} is float8_e4m3fn without its {name}{SCALE_SUFFIX}")
        else:
            out[name] = x.to(dtype or torch.bfloat16)
    return out


def quantized_states(payload: dict[str, Any]) -> dict[str, Any]:
    """A sample's states as the fp8 format stores them: values and scales (one per token
    per tensor) for its ``hidden_state`` and ``aux_hidden_state``."""
    hid, aux = payload["hidden_state"], payload["aux_hidden_state"]
    (q_hid, s_hid), (q_aux, s_aux) = quantize(hid), quantize(aux)
    return {
        "hidden_state": q_hid,
        "aux_hidden_state": q_aux,
        "hidden_state" + SCALE_SUFFIX: s_hid,
        "aux_hidden_state" + SCALE_SUFFIX: s_aux,
    }
