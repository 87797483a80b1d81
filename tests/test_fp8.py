"""fp8 states (eagle3d.store.fp8): the round trip's error bounds, the scales, the commit's fused
quantization against the whole-tensor one, and what a reader gets back."""

from __future__ import annotations

import pytest
import torch
from eagle3d.store import fp8


def _states(t: int, d: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Three layers of growing magnitude, a few large outliers (the "massive activations"
    # of real models), and some tiny values: every regime of the format.
    x = torch.randn(t, d, generator=g)
    x[:, d // 3 : 2 * d // 3] *= 8
    x[:, 2 * d // 3 :] *= 64
    x[::7, 5] = 3000.0
    x[1::5, 9] = 1e-6
    return x.to(dtype)


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_stays_within_the_bound_for_every_element(
    groups: int, dtype: torch.dtype
) -> None:
    x = _states(97, 3 * 48, dtype=dtype)
    q, s = fp8.quantize(x, groups)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (97, groups)
    back = fp8.dequantize(q, s, torch.float32)
    err = (back - x.float()).abs()
    assert bool((err <= fp8.bound(x, s)).all()), float((err - fp8.bound(x, s)).max())
    # The largest magnitude of every part maps onto 448: the scale is amax / 448.
    parts = x.float().reshape(97, groups, -1).abs().amax(-1)
    torch.testing.assert_close(s, parts / 448, rtol=1e-6, atol=0)


def _layer_errors(x: torch.Tensor, groups: int) -> list[float]:
    back = fp8.dequantize(*fp8.quantize(x, groups), torch.float32)
    d = x.shape[1] // 3
    return [
        float((back[:, k * d : (k + 1) * d] - x[:, k * d : (k + 1) * d].float()).norm())
        / float(x[:, k * d : (k + 1) * d].float().norm())
        for k in range(3)
    ]


def test_one_scale_per_row_keeps_each_layers_precision_within_e4m3s_range() -> None:
    """Why the files keep one scale per token per tensor: layers 1x, 8x and 64x apart with
    outliers of 3000 in a row lose nothing against a scale per layer (every value stays
    within 2**-6 of its row's scale, where e4m3 keeps its 3 bits); a layer 10**5 times
    below the row's largest value would (the test shows the difference is real)."""
    x = _states(256, 3 * 64)
    x[::7, 5] = 0.5
    x[::7, 150] = 3000.0
    row, layer = _layer_errors(x, 1), _layer_errors(x, 3)
    assert all(e < 0.04 for e in row), row
    assert all(r <= g * 1.1 for r, g in zip(row, layer, strict=True)), (row, layer)
    x[:, :64] *= 1e-5
    row, layer = _layer_errors(x, 1), _layer_errors(x, 3)
    assert row[0] > 2 * layer[0], (row, layer)


def test_zero_rows_get_scale_one_and_come_back_zero() -> None:
    x = torch.zeros(4, 12, dtype=torch.bfloat16)
    x[2, :4] = 1.5
    q, s = fp8.quantize(x, 3)
    assert fp8.check(s) == ""
    assert float(s[0, 0]) == 1.0 and float(s[2, 1]) == 1.0
    assert torch.equal(fp8.dequantize(q, s), x)


def test_a_nan_or_inf_shows_in_the_scale_and_check_names_it() -> None:
    for bad in (float("nan"), float("inf")):
        x = _states(8, 24)
        x[3, 20] = bad
        _, s = fp8.quantize(x, 3)
        assert not bool(torch.isfinite(s[3, 2]))
        assert bool(torch.isfinite(s[:3]).all()) and bool(torch.isfinite(s[3, :2]).all())
        assert fp8.check(s) == "not finite"
    assert fp8.check(-torch.ones(2, 1)) == "not positive"
    assert fp8.check(torch.ones(2, 1, dtype=torch.float64)) == "dtype float64, want float32"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_the_commits_fused_quantization_equals_the_whole_tensor_one(dtype: torch.dtype) -> None:
    x = _states(33, 3 * 40, dtype=torch.float32).clamp(-6e4, 6e4).to(dtype)
    q, s = fp8.quantize(x, 3)
    values = torch.empty(33, 120, dtype=torch.uint8)
    scales = torch.empty(33, 3)
    for r in range(0, 33, 10):  # in chunks of rows, as the commit reads them
        fp8.quantize_rows_into(x[r : r + 10], values[r : r + 10], scales[r : r + 10], 3)
    assert torch.equal(values, q.view(torch.uint8))
    assert torch.equal(scales, s)


def test_dequantize_states_gives_bf16_for_any_stored_dtype_and_drops_the_scales() -> None:
    aux = _states(10, 3 * 16)
    hid = _states(10, 16, seed=1)
    qa, sa = fp8.quantize(aux, 3)
    qh, sh = fp8.quantize(hid)
    base = {"input_ids": torch.arange(10), "loss_mask": torch.ones(10, dtype=torch.int64)}
    stored = {
        **base,
        "hidden_state": qh[None],
        "aux_hidden_state": qa[None],
        "hidden_state_scale": sh[None],
        "aux_hidden_state_scale": sa[None],
    }
    out = fp8.dequantize_states(stored)
    assert set(out) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
    assert out["hidden_state"].dtype == torch.bfloat16 and out["hidden_state"].shape == (1, 10, 16)
    torch.testing.assert_close(
        out["aux_hidden_state"].float()[0], aux.float(), rtol=0.07, atol=float(sa.max()) / 512
    )
    cut = fp8.dequantize_states(stored, torch.float32, max_len=4)
    assert cut["aux_hidden_state"].shape == (1, 4, 48) and cut["input_ids"].shape == (10,)
    plain = {**base, "hidden_state": hid[None].float(), "aux_hidden_state": aux[None].float()}
    assert fp8.dequantize_states(plain)["hidden_state"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="without its hidden_state_scale"):
        fp8.dequantize_states({**base, "hidden_state": qh[None], "aux_hidden_state": qa[None]})


def test_groups_must_divide_the_row() -> None:
    with pytest.raises(ValueError, match="not divisible into 3"):
        fp8.quantize(torch.ones(2, 10), 3)
    q, s = fp8.quantize(torch.ones(2, 9), 3)
    with pytest.raises(ValueError, match="do not fit"):
        fp8.dequantize(q, s[:, :2])
