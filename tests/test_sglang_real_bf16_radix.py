"""A real SGLang 0.5.21 server in bfloat16 with its radix (prefix) cache on, on purpose.

``serve-sglang`` always disables the radix cache, so this server is a bare
``python -m sglang.launch_server`` with ``eagle3d sglang-args``' arguments less
``--disable-radix-cache``. It shows that a bf16 extraction is within bf16 tolerance of a
Hugging Face fp32 forward, that the client's per-request ``extra_key`` keeps the radix cache
from ever hitting on the daemon's requests (identical conversations included), and that a
real prefix-cache hit is refused by the hook as documented.

    scripts/sglang_env && EAGLE3D_SGLANG_E2E=1 scripts/test tests/test_sglang_real_bf16_radix.py
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import runkit
import sglang_real as sr
from eagle3d.dumps.format import read_dump
from eagle3d.remote.sglang_rid import sglang_rid

pytestmark = [*sr.needs_real_sglang, pytest.mark.timeout(900)]

# bf16 keeps 8 significant bits (a relative step of 2**-8 = 0.4 %); over 10 layers and a final
# norm the error of a whole state stays within a few of those steps.
BF16_REL = 2e-2


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("real-sglang-bf16")


@pytest.fixture(scope="module")
def model10(work: Path) -> Path:
    return sr.tiny_model(work)


@pytest.fixture(scope="module")
def server(model10: Path, work: Path) -> Iterator[sr.Server]:
    (work / "dumps").mkdir()
    s = sr.Server(
        model10,
        work / "dumps",
        work,
        dtype="bfloat16",
        bare=True,
        drop_args=("--disable-radix-cache",),
    )
    s.start()
    yield s
    s.stop()
    s.check_clean()


def test_bf16_extraction_is_within_bf16_tolerance_and_never_hits_the_radix_cache(
    model10: Path, server: sr.Server, work: Path
) -> None:
    convs = sr.conversations(16, seed=7)
    convs += convs[:8]  # identical prompts: a radix cache would serve them from cache
    data = work / "bf16.jsonl"
    valid, bad = sr.write_dataset(data, convs, bad_every=8)
    lines = data.read_text().splitlines()
    out = work / "bf16"
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
        "--concurrency",
        "8",
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "radix cache on" in r.stderr + r.stdout  # the client says the server is unfit-ish
    runkit.assert_complete(out, valid, bad)
    worst = sr.compare_with_hf(
        out, model10, {i: json.loads(lines[i]) for i in valid}, dtype="bfloat16"
    )
    assert 0 < worst["aux"] <= BF16_REL and 0 < worst["final"] <= BF16_REL, worst
    assert not [f for f in runkit.records(out, "sample_failed") if f["idx"] in valid]
    last = runkit.records(out, "stats")[-1]["producer"]["detail"]
    # sglang:cached_tokens_total has a sample only once a hit happened (the test below)
    assert last.get("cached_tokens_total", 0) == 0 and last["prompt_tokens_total"] > 0, last


def test_a_real_prefix_cache_hit_is_refused_by_the_hook(server: sr.Server) -> None:
    """Two requests sharing a 100-token prefix and one radix key: the second is served from
    the cache (``cached_tokens`` > 0), and the hook writes no dump for it and says why; with
    a key of its own, as the client always sends, the same request is computed and dumped."""
    prefix = [(7 * k) % 900 + 10 for k in range(100)]
    reqs = {
        "pfx-first": [*prefix, 11, 12, 13],
        "pfx-hit": [*prefix, 21, 22, 23, 24],
        "pfx-own-key": [*prefix, 21, 22, 23, 24],
    }
    metas = {}
    for rid, ids in reqs.items():
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "rid": sglang_rid(rid, ids),
            "extra_key": "own" if rid == "pfx-own-key" else "shared",
        }
        status, out = sr.http(server.url + "/generate", body)
        assert status == 200, out
        metas[rid] = out["meta_info"]
    assert metas["pfx-first"]["cached_tokens"] == 0
    assert metas["pfx-hit"]["cached_tokens"] >= 64, metas["pfx-hit"]
    assert metas["pfx-own-key"]["cached_tokens"] == 0
    sr.wait_log(server.log, "arrived with", 30)
    dumps = server.dump_dir
    runkit.wait_for(
        lambda: (dumps / "pfx-own-key.e3dump").exists(), 30, "the dump with its own key"
    )
    assert read_dump(str(dumps / "pfx-first.e3dump")).input_ids.tolist() == reqs["pfx-first"]
    assert not (dumps / "pfx-hit.e3dump").exists()
    assert "request pfx-hit arrived with" in server.text()
    assert "(a prefix cache hit)" in server.text() and "--disable-radix-cache" in server.text()
    for name in ("pfx-first.e3dump", "pfx-own-key.e3dump"):
        (dumps / name).unlink()
    metrics = sr.http(server.url + "/metrics")[1]
    hits = [ln for ln in metrics.splitlines() if ln.startswith("sglang:cached_tokens_total{")]
    assert hits and sum(float(ln.split()[-1]) for ln in hits) >= 64, hits
