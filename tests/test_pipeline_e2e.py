"""End to end: the real daemon, the real tiny model, a real JSONL, checked against an
independent Hugging Face forward."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from eagle3proto import events as ev
from eagle3proto import paths
from runkit import (
    ENV,
    conversations,
    events,
    log_of,
    run,
    start,
    thread_names,
    wait_for_saved,
    write_jsonl,
)

BAD = {
    3: '{"messages": [{"role": "user", "content": "hi"}',  # bad JSON
    7: json.dumps({"conversations": []}),  # no turns
    11: json.dumps({"messages": [{"role": "wizard", "content": "x"}]}),  # unknown role
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rows: list[object] = list(conversations(40))
    for line, text in BAD.items():
        rows[line] = text
    return write_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", rows)


@pytest.fixture(scope="module")
def finished(tiny_model_dir: Path, dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run") / "out"
    r = run(tiny_model_dir, dataset, out, "--batch-tokens", "1024")
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def test_every_valid_line_yields_exactly_one_file(finished: Path) -> None:
    evs = events(finished)
    saved = [e for e in evs if isinstance(e, ev.SampleSaved)]
    assert sorted(e.idx for e in saved) == [i for i in range(40) if i not in BAD]
    on_disk = sorted(p.name for p in (finished / "rows_0-2000").iterdir())
    assert on_disk == sorted(f"data_{i}.ckpt" for i in range(40) if i not in BAD)
    assert evs[-1].kind == "run_finished"


def test_malformed_lines_reported_with_line_numbers(finished: Path) -> None:
    failed = {e.idx: e for e in events(finished) if isinstance(e, ev.SampleFailed)}
    assert set(failed) == set(BAD)
    for idx, e in failed.items():
        assert not e.retry
        assert f"line {idx + 1} " in e.message
    assert failed[3].error == "bad_json"
    assert failed[7].error == "no_turns"
    assert failed[11].error == "unknown_role" and "wizard" in failed[11].message


def test_hidden_states_equal_an_independent_hf_forward(
    finished: Path, tiny_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    n = model.config.num_hidden_layers
    # The documented default (README): SGLang's [2, L//2, L-3] where distinct, else
    # [1, L//2, L-1]; written out here, not taken from eagle3d's own code.
    layers = [2, n // 2, n - 3] if n >= 7 else [1, n // 2, n - 1]
    checked = 0
    for e in events(finished):
        if not isinstance(e, ev.SampleSaved):
            continue
        d = torch.load(finished / e.path, weights_only=True)
        ids = d["input_ids"]
        with torch.no_grad():
            hs = model.model(input_ids=ids[None], output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i] for i in layers], dim=-1)
        assert d["aux_hidden_state"].shape == aux.shape
        assert d["hidden_state"].shape == hs[-1].shape
        # Stored in the default storage dtype, bfloat16 (the tiny model's config says
        # float32, which is no 16-bit dtype), from a float32 forward: within bf16 rounding.
        assert d["aux_hidden_state"].dtype == d["hidden_state"].dtype == torch.bfloat16
        bf16 = {"rtol": 2**-8, "atol": 1e-5}
        torch.testing.assert_close(d["aux_hidden_state"].float(), aux, **bf16)
        torch.testing.assert_close(d["hidden_state"].float(), hs[-1], **bf16)
        checked += 1
    assert checked == 40 - len(BAD)


def _expected_mask(tok: object, ids: list[int]) -> list[int]:
    # Independent of eagle3d.ingest.chat: in the tiny template an assistant turn is
    # <|assistant|> content <|end|>; the model produces the content and the <|end|>.
    assistant = tok.convert_tokens_to_ids("<|assistant|>")  # type: ignore[attr-defined]
    end = tok.convert_tokens_to_ids("<|end|>")  # type: ignore[attr-defined]
    mask, inside = [], False
    for t in ids:
        if t == assistant:
            mask.append(0)
            inside = True
        elif inside:
            mask.append(1)
            inside = t != end
        else:
            mask.append(0)
    return mask


def test_loss_mask_marks_exactly_the_assistant_tokens(
    finished: Path, tiny_tokenizer: object
) -> None:
    for e in events(finished):
        if isinstance(e, ev.SampleSaved):
            d = torch.load(finished / e.path, weights_only=True)
            ids = d["input_ids"].tolist()
            assert d["loss_mask"].tolist() == _expected_mask(tiny_tokenizer, ids), e.idx
            assert sum(d["loss_mask"].tolist()) > 0


def test_verify_passes_and_rerun_is_a_noop(
    finished: Path, tiny_model_dir: Path, dataset: Path
) -> None:
    v = subprocess.run(
        [sys.executable, "-m", "eagle3d", "verify", "--output", str(finished), "--json"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert v.returncode == 0, v.stdout + v.stderr
    doc = json.loads(v.stdout)
    assert doc["ok"] and doc["saved"] == 37 and doc["failed"] == 3
    before = len(events(finished))
    r = run(tiny_model_dir, dataset, finished)
    assert r.returncode == 0
    assert "already finished" in r.stderr
    assert len(events(finished)) == before  # a no-op writes nothing


def test_verify_detects_a_corrupted_sample(finished: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(finished, copy)
    victim = copy / paths.sample_relpath(0)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    (copy / paths.sample_relpath(1)).unlink()
    v = subprocess.run(
        [sys.executable, "-m", "eagle3d", "verify", "--output", str(copy)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert v.returncode == 1
    assert "sample 0" in v.stdout and "checksum" in v.stdout
    assert "sample 1" in v.stdout and "missing" in v.stdout


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_stop_mid_run_then_resume(sig: int, tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", conversations(80, seed=sig))
    out = tmp_path / "out"
    proc = start(tiny_model_dir, data, out, "--batch-tokens", "256", "--concurrency", "4")
    wait_for_saved(out, 10, proc)
    proc.send_signal(sig)
    code = proc.wait(timeout=60)
    first = events(out)
    saved_first = {e.idx for e in first if isinstance(e, ev.SampleSaved)}
    assert 10 <= len(saved_first) < 80
    if sig == signal.SIGTERM:
        assert code == 0, log_of(out)
        assert first[-1].kind == "run_stopped"
    r = run(tiny_model_dir, data, out)
    assert r.returncode == 0, r.stderr
    evs = events(out)
    saved = [e.idx for e in evs if isinstance(e, ev.SampleSaved)]
    assert sorted(saved) == list(range(80))  # none missing, none twice
    starts = [e for e in evs if isinstance(e, ev.RunStarted)]
    assert [s.session for s in starts] == [1, 2]
    assert starts[1].already_saved == len(saved_first)
    v = subprocess.run(
        [sys.executable, "-m", "eagle3d", "verify", "--output", str(out)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert v.returncode == 0, v.stdout


def test_two_shards_run_concurrently_into_one_output(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", conversations(30, seed=3))
    out = tmp_path / "out"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "eagle3d",
                "run",
                "--model",
                str(tiny_model_dir),
                "--dataset",
                str(data),
                "--output",
                str(out),
                "--shard",
                f"{i}/2",
                "--dump-dir",
                str(tmp_path / f"dumps{i}"),
            ],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stdout.read() if p.stdout else ""
    for i in range(2):
        saved = [e.idx for e in events(out, paths.Shard(i, 2)) if isinstance(e, ev.SampleSaved)]
        assert sorted(saved) == list(range(i, 30, 2))
    v = subprocess.run(
        [sys.executable, "-m", "eagle3d", "verify", "--output", str(out), "--json"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    doc = json.loads(v.stdout)
    assert v.returncode == 0 and doc["saved"] == 30 and len(doc["shards"]) == 2


def test_second_daemon_on_the_same_shard_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", conversations(60))
    out = tmp_path / "out"
    # The worker rests 1 s after each batch, so the first daemon is surely still running
    # when the second has started up (unslowed, it once finished all 60 first).
    slow = {"EAGLE3D_FAULT": "worker_slow:1000"}
    first = start(
        tiny_model_dir, data, out, "--batch-tokens", "256", "--concurrency", "2", env=slow
    )
    try:
        wait_for_saved(out, 1, first)
        second = run(tiny_model_dir, data, out)
        assert first.poll() is None, "the first daemon ended before the second started"
        assert second.returncode == 5
        assert "another eagle3d" in second.stderr and "shard-0-of-1.lock" in second.stderr
    finally:
        first.terminate()
        first.wait(timeout=60)


def test_the_daemons_threads_carry_their_roles_for_top_and_ps(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    import time

    data = write_jsonl(tmp_path / "d.jsonl", conversations(20))
    out = tmp_path / "out"
    proc = start(
        tiny_model_dir,
        data,
        out,
        "--batch-tokens",
        "256",
        "--concurrency",
        "2",
        env={"EAGLE3D_FAULT": "worker_slow:1000"},
    )
    want = {
        "feeder",
        "journal-flush",
        "commit_0",
        "dump-reaper",
        "dump-inotify",
    }
    names: set[str] = set()
    try:
        wait_for_saved(out, 1, proc)
        deadline = time.monotonic() + 30
        while not want <= names and time.monotonic() < deadline:
            time.sleep(0.2)  # commit threads start with the first commit, named at a tick
            names = thread_names(proc.pid)
        assert proc.poll() is None, names
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert want <= names, names


def test_sigterm_during_model_load_stops_cleanly(tiny_model_dir: Path, tmp_path: Path) -> None:
    import time

    from eagle3proto.journalread import iter_events

    data = write_jsonl(tmp_path / "d.jsonl", conversations(20))
    out = tmp_path / "out"
    proc = start(tiny_model_dir, data, out)
    jdir = paths.journal_dir(str(out), paths.Shard())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait for run_started: the worker is loading now
        evs = iter_events(jdir)[0] if Path(jdir).is_dir() else []
        if any(isinstance(e, ev.RunStarted) for e in evs):
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    evs = events(out)
    assert not any(isinstance(e, ev.SampleSent) for e in evs)  # the signal beat the producer
    assert isinstance(evs[-1], ev.RunStopped) and "while starting" in evs[-1].reason
    r = run(tiny_model_dir, data, out)
    assert r.returncode == 0, r.stderr
    assert sorted(e.idx for e in events(out) if isinstance(e, ev.SampleSaved)) == list(range(20))
