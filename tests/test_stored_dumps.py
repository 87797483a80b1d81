"""Dumps already in the stored format (issue #32): the producers cast and quantize where the
states are (:func:`eagle3d.remote.storedtype.to_stored`, on the GPU before the copy to the
host; here the same code on a CPU device), and the commit moves such a dump's bytes as they
are, without a second cast (the splice's seam counts what it converts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from eagle3d.dumps.format import BadDump, read_dump, read_trailer
from eagle3d.remote import storedtype
from eagle3d.remote.dumpfile import write_dump
from eagle3d.remote.hostcopy import HostCopy
from eagle3d.store import fp8, splice
from eagle3d.store.committer import Committed, Committer
from eagle3proto.codec import encode_frame
from eagle3proto.wire import FrameBuffer
from runkit import ENV

H = 32
LAYERS = [2, 4, 5]
FP8, BF16 = storedtype.FORMATS["fp8"], storedtype.FORMATS["bfloat16"]


def _states(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 states with an outlier channel (as real models' rows have) and a zero row."""
    g = torch.Generator().manual_seed(t)
    aux = torch.randn(t, 3 * H, generator=g)
    aux[:, 7] *= 300.0
    hid = torch.randn(t, H, generator=g)
    hid[0] = 0.0
    return aux.to(torch.bfloat16), hid.to(torch.bfloat16)


def _commit(out: Path, path: str, t: int, store: Any, use_splice: bool = True) -> dict[str, Any]:
    c = Committer(str(out), store=store, splice=use_splice)
    (r,) = c.commit_files([(0, list(range(t)), [1] * t, path)], H, LAYERS)
    assert isinstance(r, Committed), r
    return dict(torch.load(out / r.relpath, weights_only=True))


def _stored_dump(d: Path, rid: str, aux: torch.Tensor, hid: torch.Tensor, fmt: Any) -> str:
    """A dump as a producer writes it in the stored format (the worker's own code)."""
    (qa, sa), (qh, sh) = storedtype.to_stored(aux, fmt), storedtype.to_stored(hid, fmt)
    scales = (sa, sh) if sa is not None and sh is not None else None
    return write_dump(str(d), rid, torch.arange(aux.shape[0]), qa, qh, LAYERS, scales)


@pytest.mark.parametrize("t", [1, 300, 2500])  # 2500: several quantize chunks per tensor
def test_device_side_quantization_gives_the_bytes_of_the_commits_own(
    t: int, tmp_path: Path
) -> None:
    """fp8 quantized by the producer (to_stored) or by the commit from a bf16 dump (today's
    path, fused into the splice's read): the same values and scales, byte for byte, and
    within fp8's documented error of the states."""
    aux, hid = _states(t)
    bf16 = write_dump(str(tmp_path), "a", torch.arange(t), aux, hid, LAYERS)
    stored = _stored_dump(tmp_path, "b", aux, hid, FP8)
    if t > 100:  # per token: ids and mask 16 + states 4H + scales 8 bytes, against 16 + 8H
        assert os.path.getsize(stored) < 0.6 * os.path.getsize(bf16)
    before = splice.SEAM.snapshot()
    by_commit = _commit(tmp_path / "a-out", bf16, t, FP8)
    by_producer = _commit(tmp_path / "b-out", stored, t, FP8)
    after = splice.SEAM.snapshot()
    assert after.get("quantized", 0) - before.get("quantized", 0) == 2  # the bf16 dump's
    assert after.get("as_is", 0) - before.get("as_is", 0) == 2  # the stored one's (2 states)
    assert set(by_commit) == set(by_producer) == set(FP8.keys)
    for k in FP8.keys:
        a, b = by_commit[k], by_producer[k]
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), k
    for name, x in (("aux_hidden_state", aux), ("hidden_state", hid)):
        q, s = by_producer[name][0], by_producer[name + "_scale"][0]
        err = (fp8.dequantize(q, s, torch.float32) - x.float()).abs()
        assert bool((err <= fp8.bound(x, s)).all()), name


def test_device_side_cast_gives_the_bytes_of_the_commits_own(tmp_path: Path) -> None:
    """A float32 state cast by the producer (to_stored) or by the commit: the same file
    contents, and the stored dump is moved as it is (no cast in the commit)."""
    t = 400
    g = torch.Generator().manual_seed(3)
    aux, hid = torch.randn(t, 3 * H, generator=g), torch.randn(t, H, generator=g)
    fp32 = write_dump(str(tmp_path), "a", torch.arange(t), aux, hid, LAYERS)
    stored = _stored_dump(tmp_path, "b", aux, hid, BF16)
    before = splice.SEAM.snapshot()
    a = _commit(tmp_path / "a-out", fp32, t, BF16)
    mid = splice.SEAM.snapshot()
    b = _commit(tmp_path / "b-out", stored, t, BF16)
    after = splice.SEAM.snapshot()
    assert mid.get("cast", 0) - before.get("cast", 0) == 2  # both states of the fp32 dump
    assert after.get("cast", 0) == mid.get("cast", 0)  # none for the stored dump
    assert after.get("as_is", 0) - mid.get("as_is", 0) == 2
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_a_stored_fp8_dump_is_committed_as_it_is_by_either_path(tmp_path: Path) -> None:
    """The file holds the dump's own e4m3 bytes and scales; the general path (no splice)
    writes the same tensors without quantizing again."""
    t = 120
    aux, hid = _states(t)
    path = _stored_dump(tmp_path, "r", aux, hid, FP8)
    dump = read_dump(path)
    assert dump.hidden_state.dtype == torch.float8_e4m3fn and len(dump.scales) == 2
    before = splice.SEAM.snapshot()
    fast = _commit(tmp_path / "fast", path, t, FP8)
    general = _commit(tmp_path / "general", path, t, FP8, use_splice=False)
    assert splice.SEAM.snapshot().get("quantized", 0) == before.get("quantized", 0)
    for name in ("aux_hidden_state", "hidden_state"):
        raw = getattr(dump, name)
        assert torch.equal(fast[name][0].view(torch.uint8), raw.view(torch.uint8))
        assert torch.equal(fast[name + "_scale"][0], dump.scales[name + "_scale"])
    for k in FP8.keys:
        assert torch.equal(fast[k].view(torch.uint8), general[k].view(torch.uint8)), k
    # A bfloat16 job takes the same dump dequantized (the general path words nothing).
    bf = _commit(tmp_path / "bf16", path, t, BF16)
    assert bf["hidden_state"].dtype == torch.bfloat16
    assert torch.equal(
        bf["hidden_state"][0], fp8.dequantize(dump.hidden_state, dump.scales["hidden_state_scale"])
    )


@pytest.mark.parametrize(
    ("spoil", "why"),
    [("nan", "NaN or Inf"), ("zero_scale", "not positive and finite")],
)
def test_a_stored_fp8_dump_with_a_bad_value_or_scale_is_refused(
    spoil: str, why: str, tmp_path: Path
) -> None:
    t = 16
    aux, hid = _states(t)
    (qa, sa), (qh, sh) = storedtype.to_stored(aux, FP8), storedtype.to_stored(hid, FP8)
    if spoil == "nan":
        qh.view(torch.uint8)[3, 5] = 0xFF  # e4m3fn's negative NaN
    else:
        sa[2, 0] = 0.0
    path = write_dump(str(tmp_path), "r", torch.arange(t), qa, qh, LAYERS, (sa, sh))
    (r,) = Committer(str(tmp_path / "o"), store=FP8).commit_files(
        [(0, list(range(t)), [1] * t, path)], H, LAYERS
    )
    assert isinstance(r, BadDump) and why in str(r), r


def test_the_host_copy_on_a_cpu_device_hands_the_tensors_over_as_they_are() -> None:
    """The worker's copy path on a CPU device: no copy, nothing to wait for."""
    host = HostCopy("cpu")
    a, b = torch.ones(3, 4), torch.zeros(2)
    pending = host.start([a, b])
    got = pending.wait()
    assert got[0] is a and got[1] is b and host.copies == 0


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(dict[str, Any])


def _worker_dump(model: Path, dumps: Path, *extra: str) -> str:
    """One request through a real worker process; the dump's path."""
    dumps.mkdir()
    cmd = [sys.executable, "-m", "eagle3d.remote.hf_worker", "--model", str(model)]
    cmd += ["--dump-dir", str(dumps), "--aux-layers", "1,2,3", "--threads", "1", *extra]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=ENV)
    assert proc.stdin is not None and proc.stdout is not None
    ids = [(5 * k) % 900 + 7 for k in range(90)]
    proc.stdin.write(encode_frame(_enc.encode({"op": "req", "rid": "r0", "ids": ids})))
    proc.stdin.flush()
    frames, written = FrameBuffer(), False
    while not written and (chunk := os.read(proc.stdout.fileno(), 1 << 16)):
        for payload in frames.feed(chunk):
            written = written or _dec.decode(payload)["op"] == "written"
    proc.stdin.close()
    assert proc.wait(60) == 0 and written
    return str(dumps / "r0.e3dump")


def test_the_hf_worker_writes_fp8_dumps_in_the_stored_format(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The worker (CPU device, computing in float32) quantizes before it writes: e4m3
    states and their scales, the bytes to_stored makes of its float32 states."""
    p32 = _worker_dump(tiny_model_dir, tmp_path / "a")
    p8 = _worker_dump(tiny_model_dir, tmp_path / "b", "--store-dtype", "fp8")
    fd = os.open(p8, os.O_RDONLY)
    try:
        h = read_trailer(fd).header()
    finally:
        os.close(fd)
    assert {h.tensors[k][0] for k in ("aux_hidden_state", "hidden_state")} == {"F8_E4M3"}
    assert {h.tensors[k + "_scale"][0] for k in ("aux_hidden_state", "hidden_state")} == {"F32"}
    a, b = read_dump(p32), read_dump(p8)
    for name in ("aux_hidden_state", "hidden_state"):
        q, s = storedtype.to_stored(getattr(a, name), FP8)
        assert torch.equal(getattr(b, name).view(torch.uint8), q.view(torch.uint8)), name
        assert s is not None and torch.equal(b.scales[name + "_scale"], s), name
