"""fp8 made where the states are, in a real SGLang 0.5.21 server on this CPU (issue #32).

``eagle3d serve-sglang --store-dtype fp8``: the hook quantizes each request's states in the
server's process, on their device, before the copy to the host (the function the daemon's
commit would use, so the same bytes), and checks them finite there: a dump arrives as the
sample file's fp8 archive with its scales, and ``eagle3d run --store-dtype fp8`` commits it
as it is. The saved states are within e4m3's rounding of an independent Hugging Face fp32
forward of the same weights.

    scripts/sglang_env && EAGLE3D_SGLANG_E2E=1 scripts/test tests/test_sglang_real_fp8.py
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import runkit
import sglang_real as sr
import torch
from eagle3d.dumps.format import read_dump, read_trailer
from eagle3d.remote.sglang_rid import sglang_rid
from eagle3d.store.reader import load_sample
from eagle3proto import paths

pytestmark = [*sr.needs_real_sglang, pytest.mark.timeout(900)]

# e4m3 keeps 3 mantissa bits: a value's rounding error is at most 2**-4 of it (6.25 %); a
# state's, over its 64 values, stays well within half of that.
FP8_REL = 4e-2


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("real-sglang-fp8")


@pytest.fixture(scope="module")
def model10(work: Path) -> Path:
    return sr.tiny_model(work)


@pytest.fixture(scope="module")
def server(model10: Path, work: Path) -> Iterator[sr.Server]:
    (work / "dumps").mkdir()
    s = sr.Server(model10, work / "dumps", work, store_dtype="fp8")
    s.start()
    yield s
    if s.proc is not None and s.proc.poll() is None:
        s.stop()


def test_the_servers_dump_is_quantized_and_checked_in_the_server(
    model10: Path, server: sr.Server
) -> None:
    """One request sent as the daemon sends it: its dump holds e4m3 states and their scales,
    says they are finite, and dequantizes to within fp8's rounding of a HF forward."""
    from transformers import AutoModelForCausalLM

    ids = [(5 * k) % 700 + 10 for k in range(90)]
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "rid": sglang_rid("fp8-one", ids),
        "extra_key": "fp8-one",
    }
    status, out = sr.http(server.url + "/generate", body)
    assert status == 200, out
    path = server.dump_dir / "fp8-one.e3dump"
    runkit.wait_for(path.exists, 30, "the hook's dump")
    d = read_dump(str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        trailer = read_trailer(fd)
    finally:
        os.close(fd)
    assert (trailer.dtype, trailer.finite) == ("float8_e4m3fn", True), trailer
    assert d.aux_hidden_state.dtype == d.hidden_state.dtype == torch.float8_e4m3fn
    model = AutoModelForCausalLM.from_pretrained(model10, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = {"aux_hidden_state": torch.cat([hs[i] for i in (2, 5, 7)], -1)[0]}
    want["hidden_state"] = hs[-1][0]
    for name, w in want.items():
        got = getattr(d, name).float() * d.scales[name + "_scale"]
        assert float((got - w).norm() / w.norm()) <= FP8_REL, name
    path.unlink()


def test_an_fp8_extraction_commits_the_servers_fp8_as_it_is(
    model10: Path, server: sr.Server, work: Path
) -> None:
    """``eagle3d run --store-dtype fp8`` against the server: every valid sample saved once,
    in fp8 with its scales, within fp8's rounding of the HF forward."""
    convs = sr.conversations(12, seed=5)
    data = work / "fp8.jsonl"
    valid, bad = sr.write_dataset(data, convs, bad_every=6)
    lines = data.read_text().splitlines()
    out = work / "fp8"
    extra = ["--store-dtype", "fp8", "--concurrency", "6"]
    r = runkit.run(model10, data, out, *server.client_args(), *extra, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runkit.assert_complete(out, valid, bad)
    raw = torch.load(out / paths.sample_relpath(min(valid)), weights_only=True)
    assert raw["aux_hidden_state"].dtype == torch.float8_e4m3fn
    assert raw["aux_hidden_state_scale"].dtype == torch.float32
    worst = _worst_against_hf(out, model10, {i: json.loads(lines[i]) for i in valid})
    assert 0 < worst <= FP8_REL, worst


def _worst_against_hf(out: Path, model_dir: Path, convs: dict[int, Any]) -> float:
    """The worst relative error of a saved sample's states (dequantized) against HF's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst = 0.0
    for idx, conv in sorted(convs.items()):
        d = load_sample(out / paths.sample_relpath(idx), torch.float32)
        ids, mask = sr.template_encoding(tok, conv["messages"])
        assert d["input_ids"].tolist() == ids and d["loss_mask"].tolist() == mask, idx
        with torch.no_grad():
            hs = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        for got, want in (
            (d["aux_hidden_state"], torch.cat([hs[i] for i in (2, 5, 7)], -1)),
            (d["hidden_state"], hs[-1]),
        ):
            worst = max(worst, float((got.float() - want).norm() / want.norm()))
    return worst
