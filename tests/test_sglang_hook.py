"""The SGLang capture hook, driven through a stand-in of SGLang's Llama forward (tests/sglang_standin.py).

Every dump is compared with an independent Hugging Face forward of the same ids and weights:
``output_hidden_states[i]`` for the aux layers and the last (post-norm) entry.
"""

from __future__ import annotations

import errno
import hashlib
import os
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import sglang_standin as st
from eagle3d.dumps.format import read_dump
from eagle3d.remote import sglang_checks as sc
from eagle3d.remote import sglang_hook as sh
from eagle3d.remote import sglang_rid as sr
from eagle3d.remote.dumpfile import rid_of


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path) -> tuple[st.LlamaForCausalLM, Any]:
    return st.load_standin(str(tiny_model_dir))


def fresh(models: Any) -> st.LlamaForCausalLM:
    """A stand-in with no hooks and capture off (the HF modules are shared, that is fine)."""
    _, hf = models
    return st.LlamaForCausalLM(hf).eval()


def capture_of(model: st.LlamaForCausalLM) -> sh.Capture:
    # (Hugging Face installs its own output-recording hooks on the shared submodules.)
    (hook,) = [
        h for m in model.modules() for h in m._forward_hooks.values() if isinstance(h, sh.Capture)
    ]
    return hook


def install(model: st.LlamaForCausalLM, dump_dir: Path, aux: list[int] | None = None) -> sh.Capture:
    st.register_forward_hooks(model, [sh.hook_spec(str(dump_dir), aux)])
    return capture_of(model)


def reference(hf: Any, ids: list[int], layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    hs = out.hidden_states
    return torch.cat([hs[i][0] for i in layers], dim=-1), hs[-1][0]


def prompts(n: int, lengths: list[int], seed: int = 0) -> list[tuple[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (f"s{k}-a1", torch.randint(3, 900, (lengths[k],), generator=g).tolist()) for k in range(n)
    ]


def send(reqs: list[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
    return [(sr.sglang_rid(rid, ids), ids) for rid, ids in reqs]


def check_dumps(
    dump_dir: Path, hf: Any, reqs: list[tuple[str, list[int]]], layers: list[int]
) -> None:
    names = sorted(rid_of(p) or "?" for p in os.listdir(dump_dir))
    assert names == sorted(rid for rid, _ in reqs)
    for rid, ids in reqs:
        d = read_dump(str(dump_dir / f"{rid}.e3dump"))
        assert d.rid == rid and d.layers == layers
        assert d.input_ids.tolist() == ids
        aux, hid = reference(hf, ids, layers)
        assert d.aux_hidden_state.shape == aux.shape and d.hidden_state.shape == hid.shape
        torch.testing.assert_close(d.aux_hidden_state, aux, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(d.hidden_state, hid, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# the rid tie


def test_rid_tie_round_trip_and_digest_is_blake2b_of_le_int64() -> None:
    ids = [1, 2, 70000, 5]
    srid = sr.sglang_rid("s17-a2", ids, send=3)
    tag = sr.parse_sglang_rid(srid)
    assert tag == sh.Tag("s17-a2", 3, 4, tag.digest if tag else "")
    want = hashlib.blake2b(struct.pack("<4q", *ids), digest_size=8).hexdigest()
    assert tag is not None and tag.digest == want
    assert sr.parse_sglang_rid(sr.sglang_rid("x.y", ids)).rid == "x.y"  # type: ignore[union-attr]
    assert sr.ids_digest([1, 2, 3]) != sr.ids_digest([1, 2, 4])


@pytest.mark.parametrize(
    "foreign",
    ["HEALTH_CHECK_1f2e", "warmup", "e3d.1.4.short.x", "e3d.x.4.0123456789abcdef.r", None, 7],
)
def test_foreign_rids_are_not_ours(foreign: object) -> None:
    assert sr.parse_sglang_rid(foreign) is None


@pytest.mark.parametrize("bad", ["../etc", ".hidden", "a/b", "", "a b"])
def test_unsafe_request_ids_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        sr.sglang_rid(bad, [1])


# ---------------------------------------------------------------------------------------------
# dumps equal Hugging Face


def test_packed_batch_of_different_lengths_equals_hf(models: Any, tmp_path: Path) -> None:
    model, hf = fresh(models), models[1]
    cap = install(model, tmp_path)
    n = hf.config.num_hidden_layers
    assert cap.layers == [2, n // 2, n - 3]  # SGLang's EAGLE-3 default, through the model itself
    reqs = prompts(4, [5, 17, 1, 31])
    sched = st.Scheduler(model)
    out = sched.run(send(reqs))
    cap.writer.drain()  # type: ignore[union-attr]
    check_dumps(tmp_path, hf, reqs, cap.layers)
    assert cap.forwards == 1 and len(out) == 4  # one packed extend forward
    # Among the server's threads, top -H shows ours by name (eagle3d.remote.threadnames).
    tid = cap.writer.thread.native_id  # type: ignore[union-attr]
    assert Path(f"/proc/self/task/{tid}/comm").read_text().strip() == "e3d-dump-writer"


def test_eight_layers_default_2_4_5_equals_hf(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    from eagle3d.tools.tinymodel import build_tiny_model

    model, hf = st.load_standin(build_tiny_model(tmp_path_factory.mktemp("tiny8"), layers=8))
    cap = install(model, tmp_path)
    assert cap.layers == [2, 4, 5] and model.model.layers_to_capture == [2, 4, 5]
    reqs = prompts(3, [33, 2, 14], seed=6)
    st.Scheduler(model, chunk=16).run(send(reqs))
    cap.writer.drain()  # type: ignore[union-attr]
    check_dumps(tmp_path, hf, reqs, [2, 4, 5])


def test_explicit_aux_layers_in_any_order(models: Any, tmp_path: Path) -> None:
    model, hf = fresh(models), models[1]
    cap = install(model, tmp_path, [3, 1, 3])
    assert model.model.layers_to_capture == [1, 3]
    reqs = prompts(3, [9, 4, 12], seed=1)
    st.Scheduler(model).run(send(reqs))
    cap.writer.drain()  # type: ignore[union-attr]
    check_dumps(tmp_path, hf, reqs, [3, 1, 3])


def test_chunked_prefill_is_assembled(models: Any, tmp_path: Path) -> None:
    model, hf = fresh(models), models[1]
    cap = install(model, tmp_path)
    reqs = prompts(3, [5, 23, 40], seed=2)
    st.Scheduler(model, chunk=7).run(send(reqs))
    cap.writer.drain()  # type: ignore[union-attr]
    assert cap.forwards > 5  # really chunked
    check_dumps(tmp_path, hf, reqs, cap.layers)


def test_padding_rows_and_foreign_requests_are_skipped(models: Any, tmp_path: Path) -> None:
    model, hf = fresh(models), models[1]
    cap = install(model, tmp_path)
    reqs = prompts(2, [6, 11], seed=3)
    mine = send(reqs)
    items = [
        ("warmup-0", [5, 6, 7], 0),
        (mine[0][0], mine[0][1], 0),
        ("HEALTH_CHECK_x", [0], 0),
        (mine[1][0], mine[1][1], 0),
    ]
    fb = st.make_batch(items, {}, pad=5)
    model(fb.input_ids, fb.positions, fb)
    cap.writer.drain()  # type: ignore[union-attr]
    check_dumps(tmp_path, hf, reqs, cap.layers)


def test_prefix_cache_hit_writes_no_dump(
    models: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, hf = fresh(models), models[1]
    cap = install(model, tmp_path)
    reqs = prompts(2, [10, 12], seed=4)
    sent = send(reqs)
    st.Scheduler(model).run(sent, cached={sent[0][0]: 4})
    cap.writer.drain()  # type: ignore[union-attr]
    check_dumps(tmp_path, hf, reqs[1:], cap.layers)
    assert cap.assembler.refused == 1
    assert "--disable-radix-cache" in caplog.text


def test_ids_not_matching_the_rid_write_no_dump(models: Any, tmp_path: Path) -> None:
    model = fresh(models)
    cap = install(model, tmp_path)
    srid = sr.sglang_rid("s1-a1", [5, 6, 7, 8])
    fb = st.make_batch([(srid, [5, 6, 7, 9], 0)], {})
    model(fb.input_ids, fb.positions, fb)
    cap.writer.drain()  # type: ignore[union-attr]
    assert os.listdir(tmp_path) == [] and cap.assembler.refused == 1


def test_decode_forwards_are_ignored(models: Any, tmp_path: Path) -> None:
    model = fresh(models)
    cap = install(model, tmp_path)
    ids = [5, 6, 7]
    fb = st.make_batch([(sr.sglang_rid("s1-a1", ids), ids, 0)], {}, mode=st.ForwardMode.DECODE)
    model(fb.input_ids, fb.positions, fb)
    cap.writer.drain()  # type: ignore[union-attr]
    assert os.listdir(tmp_path) == [] and cap.forwards == 0


def test_batches_without_our_rids_or_without_rids_are_skipped(models: Any, tmp_path: Path) -> None:
    model = fresh(models)
    cap = install(model, tmp_path)
    fb = st.make_batch([("warmup", [5, 6], 0), ("HEALTH_CHECK_1", [0], 0)], {})
    model(fb.input_ids, fb.positions, fb)
    fb = st.make_batch([("x", [5, 6], 0)], {})
    fb.rids = None  # type: ignore[assignment]
    model(fb.input_ids, fb.positions, fb)
    cap.writer.drain()  # type: ignore[union-attr]
    assert os.listdir(tmp_path) == [] and cap.forwards == 2


def test_inconsistent_forward_batch_fails_loudly(models: Any, tmp_path: Path) -> None:
    model = fresh(models)
    install(model, tmp_path)
    ids = [5, 6, 7]
    fb = st.make_batch([(sr.sglang_rid("s1-a1", ids), ids, 0)], {})
    fb.extend_prefix_lens_cpu = [0, 0]
    with pytest.raises(sh.HookLoadError, match="1 rids, 1 extend lengths and 2 prefix lengths"):
        model(fb.input_ids, fb.positions, fb)


def test_only_tp_rank_zero_writes(models: Any, tmp_path: Path) -> None:
    model = fresh(models)
    cap = sh.make_hook(
        {"dump_dir": str(tmp_path)}, model=model, ranks=sh.Ranks(tp_rank=1, tp_size=2)
    )
    model.model.register_forward_hook(cap)
    st.Scheduler(model).run(send(prompts(2, [4, 6])))
    assert cap.writer is None and cap.forwards == 1 and os.listdir(tmp_path) == []


def tagged(rid: str, ids: list[int]) -> sh.Tag:
    tag = sr.parse_sglang_rid(sr.sglang_rid(rid, ids))
    assert tag is not None
    return tag


def host_batch(items: list[tuple[sh.Tag, int, list[int]]]) -> sh.Batch:
    """One forward's capture: (tag, prefix, the ids of this forward) per request."""
    segs, off = [], 0
    for tag, prefix, ids in items:
        segs.append(sh.Segment(tag, prefix, off, len(ids)))
        off += len(ids)
    ids_t = torch.tensor([i for _, _, ids in items for i in ids])
    return sh.Batch(segs, ids_t, ids_t[:, None].float().repeat(1, 4), ids_t[:, None].float())


def failing_write(fail: set[str], calls: list[str]) -> Any:
    def write(d: str, rid: str, ids: torch.Tensor, *a: Any, **k: Any) -> None:
        calls.append(rid)
        if rid in fail:
            raise OSError(errno.ENOSPC, "No space left on device")

    return write


def markers(d: Path) -> list[tuple[str, str] | None]:
    return sorted(p for p in map(sr.parse_failure_marker, os.listdir(d)) if p)  # type: ignore[type-var]


def test_one_failed_write_loses_only_its_own_dump(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A full dump area fails one request's write: the rest of that forward is written, and
    another request's chunked prefill in the same forward goes on to its dump."""
    calls: list[str] = []
    a = sh.DumpAssembler(str(tmp_path), [1], write=failing_write({"r0"}, calls))
    long_ids = [7, 8, 9, 10, 11]
    chunked = tagged("r3", long_ids)
    a.feed(
        host_batch(
            [
                (tagged("r0", [1, 2]), 0, [1, 2]),
                (tagged("r1", [3, 4]), 0, [3, 4]),
                (chunked, 0, long_ids[:3]),
                (tagged("r2", [5, 6]), 0, [5, 6]),
            ]
        )
    )
    a.feed(host_batch([(chunked, 3, long_ids[3:])]))
    assert calls == ["r0", "r1", "r2", "r3"]
    assert (a.written, a.failed, a.refused) == (3, 1, 0)
    assert markers(tmp_path) == [("r0", "ENOSPC")]
    assert "r0" in caplog.text and "ENOSPC: No space left on device" in caplog.text
    assert "radix" not in caplog.text


def test_writer_survives_a_failed_write_and_a_failed_copy(tmp_path: Path) -> None:
    calls: list[str] = []
    w = sh.Writer(sh.DumpAssembler(str(tmp_path), [1], write=failing_write({"r0"}, calls)), 1)

    class BrokenEvent:
        def synchronize(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access")

    for k in range(3):
        ids = [k + 1, k + 2]
        b = host_batch([(tagged(f"r{k}", ids), 0, ids)])
        if k == 2:
            b.ready = BrokenEvent()
        w.put(b)
    w.drain()
    w.close(5)
    assert calls == ["r0", "r1"] and w.assembler.written == 1 and w.errors == 1
    assert markers(tmp_path) == [("r0", "ENOSPC"), ("r2", "ERROR")]


def test_a_lost_chunk_is_called_a_lost_chunk(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A chunked prefill whose earlier chunk was dropped is refused as a lost chunk, with the
    reason, and a marker tells the client; the radix cache is not blamed."""
    a = sh.DumpAssembler(str(tmp_path), [1], write=failing_write(set(), []), max_partials=1)
    x, y = tagged("x", [1, 2, 3, 4]), tagged("y", [5, 6, 7, 8])
    a.feed(host_batch([(x, 0, [1, 2])]))
    a.feed(host_batch([(y, 0, [5, 6])]))  # more than max_partials unfinished: x is dropped
    a.feed(host_batch([(x, 2, [3, 4]), (y, 2, [7, 8])]))
    assert (a.written, a.refused) == (1, 1)
    assert "lost chunk of request x" in caplog.text and "unfinished chunked" in caplog.text
    assert "radix" not in caplog.text.lower()
    assert markers(tmp_path) == [("x", "LOST")]


def test_a_chunked_prefill_carries_its_device_checks_and_scales_into_its_dump(
    tmp_path: Path,
) -> None:
    """The finite check made on the device and fp8's scales travel with each chunk: the dump
    is written with the scales of all its rows, in order, and called finite only when every
    chunk's rows were; a batch without them (None) leaves the check to the writer."""
    calls: list[tuple[str, Any, Any]] = []

    def write(
        d: str,
        rid: str,
        ids: Any,
        aux: Any,
        hid: Any,
        layers: Any,
        scales: Any = None,
        *,
        finite: Any = None,
    ) -> None:
        calls.append((rid, scales, finite))

    def checked(items: list[tuple[sh.Tag, int, list[int]]], ok: list[bool]) -> sh.Batch:
        b = host_batch(items)
        b.finite = torch.tensor(ok)
        b.aux_scale = b.ids[:, None].float() / 10
        b.hidden_scale = b.ids[:, None].float() / 100
        return b

    a = sh.DumpAssembler(str(tmp_path), [1], write=write)
    x, y = tagged("x", [1, 2, 3, 4]), tagged("y", [5, 6])
    a.feed(checked([(x, 0, [1, 2])], [True, True]))
    a.feed(checked([(x, 2, [3, 4]), (y, 0, [5, 6])], [True, False, True, True]))
    a.feed(host_batch([(tagged("z", [9]), 0, [9])]))
    (rx, sx, fx), (ry, sy, fy), (rz, sz, fz) = calls
    assert (rx, fx, ry, fy, rz, sz, fz) == ("x", False, "y", True, "z", None, None)
    assert sx[0].flatten().tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert sx[1].flatten().tolist() == pytest.approx([0.01, 0.02, 0.03, 0.04])
    assert sy[0].flatten().tolist() == pytest.approx([0.5, 0.6])


@pytest.mark.parametrize("radix", [None, True, False])
def test_cached_tokens_without_chunks_blame_the_radix_cache_only_when_it_may_be_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, radix: bool | None
) -> None:
    a = sh.DumpAssembler(str(tmp_path), [1], write=failing_write(set(), []), radix_cache=radix)
    a.feed(host_batch([(tagged("z", [1, 2, 3, 4]), 2, [3, 4])]))
    assert a.refused == 1 and a.written == 0
    if radix is False:
        assert "lost chunk of request z" in caplog.text and "radix cache is off" in caplog.text
        assert markers(tmp_path) == [("z", "LOST")]
    else:
        assert "prefix cache hit" in caplog.text and "--disable-radix-cache" in caplog.text
        assert markers(tmp_path) == []


def test_failure_marker_names() -> None:
    name = sr.failure_marker_name("run1-0-1-7-2", "ENOSPC")
    assert name == ".run1-0-1-7-2.ENOSPC.e3fail" and rid_of(name) is None  # never a dump
    assert sr.parse_failure_marker(name) == ("run1-0-1-7-2", "ENOSPC")
    assert sr.parse_failure_marker(sr.failure_marker_name("a.b", "not-a-reason")) == (
        "a.b",
        "ERROR",
    )
    for other in ("x.e3dump", ".x.e3dump.tmp", ".x.e3fail", "..ENOSPC.e3fail"):
        assert sr.parse_failure_marker(other) is None
    assert sr.describe_error(OSError(errno.EROFS, "Read-only file system")) == (
        "EROFS: Read-only file system"
    )


# ---------------------------------------------------------------------------------------------
# load-time failures name what was expected


def test_model_without_eagle3_capture_is_refused(tmp_path: Path) -> None:
    with pytest.raises(sh.HookLoadError, match="set_eagle3_layers_to_capture"):
        sh.make_hook({"dump_dir": str(tmp_path)}, model=torch.nn.Linear(2, 2), ranks=sh.Ranks())


@pytest.mark.parametrize(
    "ranks, match",
    [
        (sh.Ranks(pp_size=2), "pp_size=2"),
        (sh.Ranks(attn_dp_size=2), "attn_dp_size=2"),
        (sh.Ranks(attn_cp_size=2), "attn_cp_size=2"),
    ],
)
def test_unsupported_parallelism_is_refused(
    models: Any, tmp_path: Path, ranks: sh.Ranks, match: str
) -> None:
    with pytest.raises(sh.HookLoadError, match=match):
        sh.make_hook({"dump_dir": str(tmp_path)}, model=fresh(models), ranks=ranks)


@pytest.mark.parametrize("aux", [[0, 1, 2], [1, 2, 4], []])
def test_bad_aux_layers_are_refused(models: Any, tmp_path: Path, aux: list[int]) -> None:
    with pytest.raises(sh.HookLoadError, match="aux layers"):
        sh.make_hook(
            {"dump_dir": str(tmp_path), "aux_layers": aux}, model=fresh(models), ranks=sh.Ranks()
        )


def test_targets_missing_the_capturing_module_are_refused(models: Any, tmp_path: Path) -> None:
    spec = sh.hook_spec(str(tmp_path))
    spec["target_modules"] = ["model.layers.1"]
    with pytest.raises(
        sh.HookLoadError, match=r"does not include the capturing model module 'model'"
    ):
        st.register_forward_hooks(fresh(models), [spec])


def test_second_capture_on_a_speculative_server_is_refused(models: Any, tmp_path: Path) -> None:
    model = fresh(models)
    model.set_eagle3_layers_to_capture([1])
    with pytest.raises(sh.HookLoadError, match="already captures"):
        sh.make_hook({"dump_dir": str(tmp_path)}, model=model, ranks=sh.Ranks())


def test_factory_outside_sglang_needs_a_model(tmp_path: Path) -> None:
    with pytest.raises(sh.HookLoadError, match="register_forward_hooks"):
        sh.make_hook({"dump_dir": str(tmp_path)})
    with pytest.raises(sh.HookLoadError, match="dump_dir"):
        sh.make_hook({})


def test_wrong_calling_convention_fails_loudly(models: Any, tmp_path: Path) -> None:
    model = fresh(models)
    cap = sh.make_hook({"dump_dir": str(tmp_path)}, model=model, ranks=sh.Ranks())
    model.model.register_forward_hook(cap)
    fb = st.make_batch([("r", [1, 2], 0)], {})
    with pytest.raises(sh.HookLoadError, match="third positional argument"):
        model.model(fb.input_ids, fb.positions, forward_batch=fb)


def test_our_own_requests_decoding_in_a_mixed_forward_are_not_captured(
    models: Any, tmp_path: Path
) -> None:
    """With --enable-mixed-chunk (and the overlap scheduler) a MIXED forward carries the token
    one of our requests decodes after its prompt: prefix = the prompt's length. Its prompt is
    captured already; taking it for a chunk made a needless 'lost chunk' (seen on a real
    SGLang 0.5.21)."""
    from types import SimpleNamespace

    cap = install(fresh(models), tmp_path)
    done, new = [5, 6, 7], [8, 9]
    fb = SimpleNamespace(
        rids=[sr.sglang_rid("a", done), sr.sglang_rid("b", new), "user-1"],
        extend_seq_lens_cpu=[1, 2, 1],
        extend_prefix_lens_cpu=[3, 0, 40],
    )
    ((tag, prefix, start, n),) = cap._segments(fb)
    assert (tag.rid, prefix, start, n) == ("b", 0, 1, 2)


def _api_0521(model: Any, hook_specs: list[dict[str, Any]]) -> None:
    name_to_module = dict(model.named_modules())
    for spec in hook_specs:
        hook = spec["factory"](spec.get("config") or {})
        for module in name_to_module.values():
            module.register_forward_hook(hook)


def _api_newer(model: Any, hook_specs: list[dict[str, Any]]) -> None:
    name_to_module = dict(model.named_modules())
    for spec in hook_specs:
        hook = spec["factory"](spec.get("config") or {})
        kind = spec.get("hook_type", "forward")
        for module in name_to_module.values():
            if kind == "forward_pre":
                module.register_forward_pre_hook(hook, with_kwargs=True)
            else:
                module.register_forward_hook(hook, with_kwargs=True)


def _api_renamed(model: Any, specs: list[dict[str, Any]]) -> None:
    for s in specs:
        model.register_forward_hook(s)


def test_the_hooks_api_shape_is_detected() -> None:
    assert sc.hooks_api_problem(_api_0521) is None
    assert "newer hooks API" in (sc.hooks_api_problem(_api_newer) or "")
    assert "not (model, hook_specs)" in (sc.hooks_api_problem(_api_renamed) or "")
    assert sc.hooks_api_problem(len) == "is not a Python function"


def test_a_newer_hooks_api_is_refused_at_load_naming_the_version(
    models: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside an SGLang whose hook manager calls hooks differently, make_hook refuses before
    the first request, naming the version it met and the API it expects."""
    import types

    pkg = {
        "sglang": types.ModuleType("sglang"),
        "sglang.srt": types.ModuleType("sglang.srt"),
        "sglang.srt.model_executor": types.ModuleType("sglang.srt.model_executor"),
        "sglang.srt.model_executor.hook_manager": types.ModuleType("hook_manager"),
    }
    pkg["sglang"].__version__ = "0.9.0"  # type: ignore[attr-defined]
    pkg["sglang.srt.model_executor.hook_manager"].register_forward_hooks = _api_newer  # type: ignore[attr-defined]
    for name, mod in pkg.items():
        monkeypatch.setitem(sys.modules, name, mod)
    with pytest.raises(sh.HookLoadError) as e:
        sh.make_hook({"dump_dir": str(tmp_path)})
    msg = str(e.value)
    assert "sglang 0.9.0's register_forward_hooks uses" in msg and "newer hooks API" in msg
    assert "module.register_forward_hook(hook)" in msg and "0.5.21 to 0.5.23" in msg
