"""Any layer set through a real, stock SGLang 0.5.21 server on this CPU (issue #30).

``eagle3d serve-sglang --layers 1,3,5,6,7,9`` (a 6-layer set on a 10-layer tiny Llama, fp32)
and ``eagle3d run --recipe dflash --layers 1,3,5,6,7,9``: every sample's six layers and last
state equal an independent Hugging Face forward at the documented index (layer id i =
``output_hidden_states[i]``) within 1e-5, the capture contract says so, and ``eagle3d verify
--reference`` agrees.

    scripts/sglang_env && EAGLE3D_SGLANG_E2E=1 scripts/test tests/test_sglang_real_layers.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import runkit
import sglang_real as sr

pytestmark = [*sr.needs_real_sglang, pytest.mark.timeout(900)]

LAYERS = [1, 3, 5, 6, 7, 9]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("real-sglang-layers")


@pytest.fixture(scope="module")
def model10(work: Path) -> Path:
    return sr.tiny_model(work)


@pytest.fixture(scope="module")
def server(model10: Path, work: Path) -> Iterator[sr.Server]:
    (work / "dumps").mkdir()
    s = sr.Server(model10, work / "dumps", work, layers=LAYERS)
    s.start()
    yield s
    if s.proc is not None and s.proc.poll() is None:
        s.stop()


def test_six_layers_through_the_real_server_equal_hf(
    model10: Path, server: sr.Server, work: Path
) -> None:
    convs = sr.conversations(12, seed=3)
    data = work / "data.jsonl"
    valid, bad = sr.write_dataset(data, convs, 0)
    lines = data.read_text().splitlines()
    by_idx = {i: json.loads(lines[i]) for i in valid}
    out = work / "out"
    layers = ",".join(map(str, LAYERS))
    r = runkit.run(
        model10,
        data,
        out,
        "--backend",
        "sglang",
        "--server",
        server.url,
        "--dump-dir",
        str(server.dump_dir),
        "--store-dtype",
        "float32",
        "--recipe",
        "dflash",
        "--layers",
        layers,
        "--concurrency",
        "6",
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runkit.assert_complete(out, valid, bad)
    worst = sr.compare_with_hf(out, model10, by_idx, layers=LAYERS)
    assert worst["aux"] <= 1e-5 and worst["final"] <= 1e-5, worst
    c = json.loads((out / ".eagle3d" / "capture.json").read_text())
    assert (c["recipe"], c["layers"]) == ("dflash", LAYERS)
    v = subprocess.run(
        [sys.executable, "-m", "eagle3d", "verify", "-o", str(out), "--reference", "4"],
        capture_output=True,
        text=True,
        env=runkit.env_without_faults(),
        timeout=300,
    )
    assert v.returncode == 0, v.stdout + v.stderr
    assert "4 sample(s), 28 tensor(s)" in v.stdout
    server.check_clean()
