"""A dump checked against what was sent: ids, shapes, layers, and no NaN or Inf. Pure but for
the tensors it reads; the errors say what is wrong (:class:`~eagle3d.dumps.format.BadDump`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from eagle3d.dumps.format import BadDump, ContractBroken, Dump

if TYPE_CHECKING:
    import numpy as np
    import torch


def validate(dump: Dump, sent_ids: list[int], hidden_size: int, layers: list[int]) -> None:
    """Check a dump against what was sent. Raises BadDump naming the problem."""
    import torch

    t = len(sent_ids)
    ids = dump.input_ids
    if ids.dim() != 1 or ids.shape[0] != t:
        raise BadDump(f"input_ids has shape {tuple(ids.shape)}, sent {t} tokens")
    if not torch.equal(ids.to(torch.int64), torch.tensor(sent_ids, dtype=torch.int64)):
        bad = int((ids.to(torch.int64) != torch.tensor(sent_ids)).nonzero()[0, 0])
        raise BadDump(f"input_ids differ from what was sent (first at position {bad})")
    contract(dump, hidden_size, layers)
    want_aux = (t, len(layers) * hidden_size)
    if tuple(dump.aux_hidden_state.shape) != want_aux:
        raise BadDump(
            f"aux_hidden_state has shape {tuple(dump.aux_hidden_state.shape)}, want {want_aux}"
        )
    if tuple(dump.hidden_state.shape) != (t, hidden_size):
        raise BadDump(
            f"hidden_state has shape {tuple(dump.hidden_state.shape)}, want {(t, hidden_size)}"
        )
    for name in ("aux_hidden_state", "hidden_state"):
        x = getattr(dump, name)
        if not x.is_floating_point():
            raise BadDump(f"{name} has dtype {x.dtype}, want a float type")
        if not all_finite(x):
            raise BadDump(f"{name} contains NaN or Inf")
        scale = dump.scales.get(name + "_scale")
        if x.dtype == torch.float8_e4m3fn and scale is None:
            raise BadDump(f"{name} is float8_e4m3fn without its {name}_scale")
        if scale is not None:
            if x.dtype != torch.float8_e4m3fn:
                raise BadDump(f"{name}_scale beside {name} of dtype {x.dtype}, want fp8")
            if scale.dtype != torch.float32 or tuple(scale.shape) != (t, 1):
                got = f"{str(scale.dtype).removeprefix('torch.')} {tuple(scale.shape)}"
                raise BadDump(f"{name}_scale is {got}, want float32 {(t, 1)}")
            if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
                raise BadDump(f"{name}_scale holds a scale that is not positive and finite")


def contract(dump: Dump, hidden_size: int, layers: list[int]) -> None:
    """Check the dump's capture against the job's contract: the layers it names, the width
    of its states (the number of layers times the hidden size). Raises ContractBroken (the
    producer's, not the sample's) naming what was expected and what was found; a dump cut
    along its tokens is left to :func:`validate` (the sample's)."""
    if dump.layers and dump.layers != layers:
        raise ContractBroken(
            f"the dump captured layers {dump.layers} ({len(dump.layers)}), the job captures"
            f" layers {layers} ({len(layers)})"
        )
    hid, aux = dump.hidden_state, dump.aux_hidden_state
    if hid.dim() == 2 and hid.shape[1] != hidden_size:
        raise ContractBroken(
            f"the dump's hidden size is {hid.shape[1]}, the job's model has {hidden_size}"
            f" (the job captures layers {layers})"
        )
    width = len(layers) * hidden_size
    if aux.dim() == 2 and aux.shape[1] != width:
        found = aux.shape[1] / hidden_size
        says = f"{found:g} layers" if found == int(found) else "no whole number of layers"
        raise ContractBroken(
            f"the dump's aux_hidden_state is {aux.shape[1]} wide ({says} of hidden size"
            f" {hidden_size}), the job captures layers {layers} ({len(layers)} x"
            f" {hidden_size} = {width})"
        )


# (integer view, exponent mask): a float is NaN/Inf exactly when all its exponent bits are set.
_EXPONENT = {
    "bfloat16": ("int16", 0x7F80),
    "float16": ("int16", 0x7C00),
    "float32": ("int32", 0x7F800000),
    "float8_e4m3fn": ("int8", 0x7F),  # no Inf; NaN is 0x7F or 0xFF
}


def all_finite(x: torch.Tensor, chunk: int = 1 << 20) -> bool:
    """True when no element is NaN or Inf.

    ``torch.isfinite`` on bf16 runs at ~150 MB/s on CPUs without native bf16; testing the
    exponent bits of an integer view with numpy runs near memory speed and is exact.
    """
    import torch

    # One vectorised pass first: a NaN or an Inf makes the sum NaN or infinite whatever the
    # order of the additions, so a finite sum proves every element finite. A sum that is not
    # finite (a NaN or Inf, or finite values large enough to overflow) is decided below.
    fast = x.dtype in (torch.float32, torch.float64) and x.device.type == "cpu"
    if fast and math.isfinite(float(x.sum())):
        return True
    spec = _EXPONENT.get(str(x.dtype).removeprefix("torch."))
    if spec is None or x.device.type != "cpu":
        return bool(torch.isfinite(x).all())
    bits = x.contiguous().reshape(-1).view(getattr(torch, spec[0])).numpy()
    return finite_bits(bits, spec[1], chunk)


def finite_bits(bits: np.ndarray, mask: int, chunk: int = 1 << 17) -> bool:
    """True when no element of ``bits`` (floats viewed as signed integers) has every bit
    of the exponent ``mask`` set, i.e. none is NaN or Inf.

    Two read-only reductions per chunk, no temporary: a positive NaN or Inf is a signed
    value of at least ``mask`` (finite positives are below it, negatives below zero), a
    negative one an unsigned value of at least ``sign | mask`` (finite negatives are
    below it, positives below ``sign``)."""
    unsigned = bits.view(bits.dtype.str.replace("i", "u"))
    top = (1 << (8 * bits.itemsize - 1)) | mask
    for i in range(0, bits.size, chunk):  # cache-sized chunks: both reductions hit cache
        if bits[i : i + chunk].max() >= mask or unsigned[i : i + chunk].max() >= top:
            return False
    return True
