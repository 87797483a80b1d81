"""The storage dtype (eagle3d.remote.storedtype): what ``auto`` resolves to, the flag and the key,
the casts at the producer and in the commit (fused into the splice), the fingerprint, the
journal and verify."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from eagle3d import config
from eagle3d.dumps.format import BadDump, Dump, read_dump, read_trailer
from eagle3d.remote import storedtype
from eagle3d.remote.dumpfile import write_dump
from eagle3d.store import directio, splice
from eagle3d.store.committer import Committed, Committer
from eagle3d.tools.verify import check_sample, verify
from eagle3proto import events as ev
from eagle3proto.codec import encode_frame
from eagle3proto.wire import FrameBuffer
from runkit import ENV, conversations, events, run, start, wait_for_saved, write_jsonl

H = 32
LAYERS = [2, 4, 5]
BF16, F16, F32 = (storedtype.FORMATS[k] for k in ("bfloat16", "float16", "float32"))

# -- what auto means ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg", "want"),
    [
        ({"dtype": "bfloat16"}, "bfloat16"),
        ({"dtype": "float16"}, "float16"),
        ({"torch_dtype": "float16"}, "float16"),  # the key before transformers 5
        ({"torch_dtype": "torch.bfloat16"}, "bfloat16"),
        ({"dtype": "float32"}, "bfloat16"),  # not a 16-bit dtype: bfloat16
        ({}, "bfloat16"),
        ({"dtype": "float32", "text_config": {"dtype": "float16"}}, "float16"),  # a VLM wrapper
    ],
)
def test_auto_is_the_models_own_16_bit_dtype_else_bfloat16(cfg: dict[str, Any], want: str) -> None:
    assert storedtype.resolve("auto", cfg).name == want


def test_an_explicit_value_wins_and_float32_only_when_asked() -> None:
    assert storedtype.resolve("float32", {"dtype": "bfloat16"}) == F32
    assert storedtype.resolve("bfloat16", {"dtype": "float16"}) == BF16
    with pytest.raises(ValueError, match="store_dtype: 'fp4' is not one of auto, bfloat16"):
        storedtype.resolve("fp4", {})


def test_flag_and_toml_key(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    config.add_job_arguments(p)
    base = ["--model", "/m", "--dataset", "/d", "--output", "/o"]
    assert config.from_args(p.parse_args(base)).store_dtype == "auto"
    assert config.from_args(p.parse_args([*base, "--store-dtype", "float32"])).store_dtype == (
        "float32"
    )
    job = tmp_path / "job.toml"
    job.write_text('model = "/m"\ndataset = "/d"\noutput = "/o"\nstore_dtype = "fp9"\n')
    with pytest.raises(config.ConfigError, match="store_dtype: 'fp9' is not one of"):
        config.from_args(p.parse_args(["--config", str(job)]))
    with pytest.raises(SystemExit):
        p.parse_args([*base, "--store-dtype", "int8"])


# -- the casts ---------------------------------------------------------------------------------


def _states(t: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    return torch.randn(t, 3 * H, generator=g).to(dtype), torch.randn(t, H, generator=g).to(dtype)


def _commit_file(out: Path, path: str, t: int, store: storedtype.StoreFormat) -> dict[str, Any]:
    (r,) = Committer(str(out), store=store).commit_files(
        [(0, list(range(t)), [1] * t, path)], H, LAYERS
    )
    assert isinstance(r, Committed), r
    return dict(torch.load(out / r.relpath, weights_only=True, mmap=True))


@pytest.mark.parametrize("store", [BF16, F16])
@pytest.mark.parametrize("t", [1, 300, 3000])  # 3000: more than one cast chunk per tensor
def test_the_commit_casts_a_float32_dump_within_its_read(
    t: int, store: storedtype.StoreFormat, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float32 dump is stored as the cast of its values (round to nearest even), by the
    splice path (the general one must not be taken) and byte for byte what the general
    path writes."""
    aux, hid = _states(t)
    path = write_dump(str(tmp_path), "r", torch.arange(t), aux, hid, LAYERS)
    monkeypatch.setattr(os, "urandom", lambda n: b"\x05" * n)
    mask = [1] * t
    staged = splice.stage(
        path, list(range(t)), mask, H, LAYERS, directio.DirectBuffer(), 1 << 30, store
    )
    assert staged is not None
    spliced = bytes(staged.view[: staged.written.nbytes])
    d = _commit_file(tmp_path / "out", path, t, store)
    want = getattr(torch, store.torch_dtype)
    assert d["aux_hidden_state"].dtype == d["hidden_state"].dtype == want
    assert torch.equal(d["aux_hidden_state"][0], aux.to(want))
    assert torch.equal(d["hidden_state"][0], hid.to(want))
    # The general path (a loaded dump) casts the same way into the same bytes.
    general = Committer(str(tmp_path / "general"), store=store)
    (r,) = general.commit_many([(0, list(range(t)), mask, read_dump(path))])
    assert isinstance(r, Committed)
    assert (tmp_path / "general" / r.relpath).read_bytes() == spliced


def _states_bytes(path: str) -> int:
    """The bytes of a v2 dump's two states records."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return sum(n for _, n in read_trailer(fd).plan().slots[2:4])
    finally:
        os.close(fd)


def test_a_producer_cast_and_a_commit_cast_store_the_same_bytes(tmp_path: Path) -> None:
    """Cast at the producer (a bf16 dump, half the bytes) or in the commit (a fp32 dump):
    the stored states are identical."""
    t = 200
    aux, hid = _states(t)
    fp32 = write_dump(str(tmp_path), "a", torch.arange(t), aux, hid, LAYERS)
    bf16 = write_dump(
        str(tmp_path),
        "b",
        torch.arange(t),
        storedtype.cast(aux, BF16),
        storedtype.cast(hid, BF16),
        LAYERS,
    )
    assert _states_bytes(bf16) * 2 == _states_bytes(fp32)
    a = _commit_file(tmp_path / "a", fp32, t, BF16)
    b = _commit_file(tmp_path / "b", bf16, t, BF16)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_a_dump_already_in_the_storage_dtype_is_moved_as_it_is(tmp_path: Path) -> None:
    t = 50
    aux, hid = _states(t, torch.bfloat16)
    path = write_dump(str(tmp_path), "r", torch.arange(t), aux, hid, LAYERS)
    d = _commit_file(tmp_path / "o", path, t, BF16)
    assert torch.equal(d["aux_hidden_state"][0], aux) and torch.equal(d["hidden_state"][0], hid)
    up = _commit_file(tmp_path / "up", path, t, F32)  # widening is exact
    assert up["hidden_state"].dtype == torch.float32
    assert torch.equal(up["hidden_state"][0], hid.float())


def test_a_float16_overflow_is_caught_on_what_is_stored(tmp_path: Path) -> None:
    """70000 is a finite float32 and an Inf in float16: the check runs after the cast."""
    t = 10
    aux, hid = _states(t)
    hid[3, 5] = 70000.0
    path = write_dump(str(tmp_path), "r", torch.arange(t), aux, hid, LAYERS)
    (r,) = Committer(str(tmp_path / "o"), store=F16).commit_files(
        [(0, list(range(t)), [1] * t, path)], H, LAYERS
    )
    assert isinstance(r, BadDump) and "hidden_state contains NaN or Inf" in str(r)
    (ok,) = Committer(str(tmp_path / "b"), store=BF16).commit_files(
        [(0, list(range(t)), [1] * t, path)], H, LAYERS
    )
    assert isinstance(ok, Committed)  # bfloat16 has float32's range


def test_without_a_storage_format_the_commit_keeps_the_dumps_dtype(tmp_path: Path) -> None:
    t = 20
    aux, hid = _states(t)
    path = write_dump(str(tmp_path), "r", torch.arange(t), aux, hid, LAYERS)
    (r,) = Committer(str(tmp_path / "o")).commit_files(
        [(0, list(range(t)), [1] * t, path)], H, LAYERS
    )
    assert isinstance(r, Committed)
    d = torch.load(tmp_path / "o" / r.relpath, weights_only=True)
    assert d["hidden_state"].dtype == torch.float32
    assert isinstance(read_dump(path), Dump)


# -- the HF worker casts before it writes ------------------------------------------------------

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(dict[str, Any])


def _worker_dump(model: Path, dumps: Path, *extra: str) -> tuple[dict[str, Any], str]:
    """One request through a real worker process; (its ready message, the dump's path)."""
    dumps.mkdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eagle3d.remote.hf_worker",
            "--model",
            str(model),
            "--dump-dir",
            str(dumps),
            "--aux-layers",
            "1,2,3",
            "--threads",
            "1",
            *extra,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=ENV,
    )
    assert proc.stdin is not None and proc.stdout is not None
    ids = [(5 * k) % 900 + 7 for k in range(90)]
    proc.stdin.write(encode_frame(_enc.encode({"op": "req", "rid": "r0", "ids": ids})))
    proc.stdin.flush()
    frames, ready, written = FrameBuffer(), None, False
    while not written and (chunk := os.read(proc.stdout.fileno(), 1 << 16)):
        for payload in frames.feed(chunk):
            msg = _dec.decode(payload)
            ready = ready or msg
            written = written or msg["op"] == "written"
    proc.stdin.close()
    assert proc.wait(60) == 0 and ready is not None and written
    return ready, str(dumps / "r0.e3dump")


def test_the_hf_worker_writes_its_dumps_in_the_storage_dtype(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Computed in float32 on the CPU, written in bfloat16: the cast of the same values,
    half the dump's bytes."""
    ready32, p32 = _worker_dump(tiny_model_dir, tmp_path / "a")
    ready16, p16 = _worker_dump(tiny_model_dir, tmp_path / "b", "--store-dtype", "bfloat16")
    assert (ready32["dtype"], ready32["store_dtype"]) == ("float32", "")
    assert (ready16["dtype"], ready16["store_dtype"]) == ("float32", "bfloat16")
    fd = os.open(p16, os.O_RDONLY)
    try:
        h = read_trailer(fd).header()
    finally:
        os.close(fd)
    assert h.meta["dtype"] == "bfloat16"
    assert {h.tensors[k][0] for k in ("aux_hidden_state", "hidden_state")} == {"BF16"}
    a, b = read_dump(p32), read_dump(p16)
    assert torch.equal(b.aux_hidden_state, a.aux_hidden_state.to(torch.bfloat16))
    assert torch.equal(b.hidden_state, a.hidden_state.to(torch.bfloat16))
    assert _states_bytes(p16) * 2 == _states_bytes(p32)


# -- the job: journal, fingerprint, verify -----------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", conversations(8))


def saved_idx(out: Path) -> set[int]:
    return {e.idx for e in events(out) if isinstance(e, ev.SampleSaved)}


def _started(out: Path) -> list[ev.RunStarted]:
    return [e for e in events(out) if isinstance(e, ev.RunStarted)]


def test_the_journal_carries_the_resolved_dtype_and_a_resume_with_another_is_refused(
    tiny_model_dir: Path, data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    r = run(tiny_model_dir, data, out)
    assert r.returncode == 0, r.stderr
    (first,) = _started(out)
    assert first.job.store_dtype == "bfloat16"  # the tiny model's config says float32
    report = verify(str(out))
    assert report.ok and report.shards[0].store_dtype == "bfloat16"
    assert "states bfloat16" in str(report)
    # The same dtype asked explicitly is the same job: a finished no-op, not a refusal.
    r = run(tiny_model_dir, data, out, "--store-dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    r = run(tiny_model_dir, data, out, "--store-dtype", "float32")
    assert r.returncode == 6, r.stderr
    assert "store_dtype: 'bfloat16' -> 'float32'" in r.stderr
    assert "refusing to resume" in r.stderr


def test_verify_checks_each_sample_against_its_sessions_dtype(
    tiny_model_dir: Path, data: Path, tmp_path: Path
) -> None:
    """A run stored in float32 (asked), stopped, then forced on in bfloat16 (an output from
    before the capture contract): each file is checked against the dtype of the session
    that saved it, and the report says both."""
    out = tmp_path / "out"
    # One sample per batch and a rest after each, so that the stop comes mid-run.
    slow = [
        "--store-dtype",
        "float32",
        "--batch-tokens",
        "64",
        "--workers",
        "1",
        "--concurrency",
        "1",
    ]
    first = start(tiny_model_dir, data, out, *slow, env={"EAGLE3D_FAULT": "worker_slow:400"})
    try:
        wait_for_saved(out, 2, first)
        first.send_signal(signal.SIGTERM)
        assert first.wait(60) == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert len(saved_idx(out)) < 8
    r = run(tiny_model_dir, data, out)
    assert r.returncode == 6 and "store_dtype: 'float32' -> 'bfloat16'" in r.stderr
    # The capture contract never lets the stored dtype change, even forced: what a file
    # means would change with it.
    r = run(tiny_model_dir, data, out, "--force-resume")
    assert r.returncode == 6 and "store_dtype 'float32'" in r.stderr, r.stderr
    # An output started before the contract existed has none: forced, it may mix dtypes,
    # and verify must then hold each file to its own session's.
    (out / ".eagle3d" / "capture.json").unlink()
    r = run(tiny_model_dir, data, out, "--force-resume")
    assert r.returncode == 0, r.stderr
    assert [s.job.store_dtype for s in _started(out)] == ["float32", "bfloat16"]
    saved = {e.idx: e for e in events(out) if isinstance(e, ev.SampleSaved)}
    dtypes = {
        i: torch.load(out / e.path, weights_only=True)["hidden_state"].dtype
        for i, e in saved.items()
    }
    assert set(dtypes.values()) == {torch.float32, torch.bfloat16}
    report = verify(str(out))
    assert report.ok, report.problems
    assert report.shards[0].store_dtype == "bfloat16, float32"
    # A file that is not in the dtype its session stored: named.
    idx = next(i for i, d in dtypes.items() if d == torch.float32)
    problem = check_sample(str(out), saved[idx], store_dtype="bfloat16")
    assert problem == f"sample {idx}: hidden_state is float32, the job stores bfloat16"
    as_json = json.loads(json.dumps(report.to_dict()))
    assert as_json["shards"][0]["store_dtype"] == "bfloat16, float32"


# -- the SGLang hook casts on the device, when its config says so ------------------------------


def _hooked_dumps(
    model_dir: Path, dumps: Path, store_dtype: str | None, final_norm: float = 1.0
) -> Dump:
    sys.path.insert(0, os.path.dirname(__file__))
    import sglang_standin as st
    from eagle3d.remote import sglang_hook as sh
    from eagle3d.remote import sglang_rid as sr

    model, _ = st.load_standin(str(model_dir))
    model.model.norm.hf.weight.data *= final_norm  # the last state's scale (an overflow)
    st.register_forward_hooks(model, [sh.hook_spec(str(dumps), None, 4, store_dtype)])
    (cap,) = [
        h for m in model.modules() for h in m._forward_hooks.values() if isinstance(h, sh.Capture)
    ]
    ids = [(3 * k) % 800 + 5 for k in range(40)]
    st.Scheduler(model).run([(sr.sglang_rid("s1", ids), ids)])
    assert cap.writer is not None
    cap.writer.drain()
    return read_dump(str(dumps / "s1.e3dump"))


def test_the_sglang_hook_casts_to_the_storage_dtype_its_config_names(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    plain = _hooked_dumps(tiny_model_dir, tmp_path / "a", None)
    cast = _hooked_dumps(tiny_model_dir, tmp_path / "b", "bfloat16")
    assert plain.hidden_state.dtype == torch.float32
    assert cast.aux_hidden_state.dtype == cast.hidden_state.dtype == torch.bfloat16
    assert torch.equal(cast.aux_hidden_state, plain.aux_hidden_state.to(torch.bfloat16))
    assert torch.equal(cast.hidden_state, plain.hidden_state.to(torch.bfloat16))


def test_the_sglang_hook_quantizes_fp8_on_the_states_device(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With ``store_dtype: fp8`` the hook quantizes where the states are, before the copy to
    the host: its dump holds the e4m3 values and scales the commit's own quantization gives
    (one function), says the states were finite (checked there too), and is committed as
    it is — mapped, nothing quantized or read by the daemon."""
    plain = _hooked_dumps(tiny_model_dir, tmp_path / "a", None)
    q = _hooked_dumps(tiny_model_dir, tmp_path / "b", "fp8")
    fp8 = storedtype.FORMATS["fp8"]
    for name in ("aux_hidden_state", "hidden_state"):
        values, scale = storedtype.to_stored(getattr(plain, name), fp8)
        got = getattr(q, name)
        assert got.dtype == torch.float8_e4m3fn
        assert torch.equal(got.view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(q.scales[name + "_scale"], scale)
    path = str(tmp_path / "b" / "s1.e3dump")
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_trailer(fd).finite
    finally:
        os.close(fd)
    before = splice.SEAM.snapshot().get("as_is", 0)
    c = Committer(str(tmp_path / "out"), store=fp8)
    ids = q.input_ids.tolist()
    hidden = plain.hidden_state.shape[-1]
    (r,) = c.commit_files([(0, ids, [1] * len(ids), path)], hidden, q.layers)
    assert isinstance(r, Committed), r
    assert splice.SEAM.snapshot().get("as_is", 0) - before == 2  # the mapped way, as it is
    saved = torch.load(tmp_path / "out" / r.relpath, weights_only=True)
    assert torch.equal(saved["hidden_state_scale"][0], q.scales["hidden_state_scale"])


def test_the_sglang_hooks_finite_check_sees_a_float16_overflow(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """States finite as computed (float32) but beyond float16's range once cast: the hook
    checks what it stores, so its dump says not finite and the commit words it instead of
    saving infinities."""
    d = _hooked_dumps(tiny_model_dir, tmp_path / "d", "float16", final_norm=1e6)
    assert bool(torch.isinf(d.hidden_state).any())
    path = str(tmp_path / "d" / "s1.e3dump")
    fd = os.open(path, os.O_RDONLY)
    try:
        assert not read_trailer(fd).finite
    finally:
        os.close(fd)
    c = Committer(str(tmp_path / "out"), store=storedtype.FORMATS["float16"])
    ids = d.input_ids.tolist()
    (r,) = c.commit_files([(0, ids, [1] * len(ids), path)], d.hidden_state.shape[-1], d.layers)
    assert isinstance(r, BadDump) and str(r) == "hidden_state contains NaN or Inf", r


def test_the_hook_refuses_an_unknown_storage_dtype_and_the_launcher_passes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from eagle3d.cli import main
    from eagle3d.remote import sglang_hook as sh

    with pytest.raises(sh.HookLoadError, match="store_dtype: 'fp3' is not one of"):
        sh.make_hook({"dump_dir": str(tmp_path), "store_dtype": "fp3"}, model=torch.nn.Linear(1, 1))
    assert "store_dtype" not in sh.hook_spec(str(tmp_path))["config"]
    assert (
        main(
            [
                "sglang-args",
                "--dump-dir",
                str(tmp_path),
                "--store-dtype",
                "bfloat16",
                "--format",
                "json",
            ]
        )
        == 0
    )
    args = json.loads(capsys.readouterr().out)["args"]
    (spec,) = json.loads(args[args.index("--forward-hooks") + 1])
    assert spec["config"]["store_dtype"] == "bfloat16"
