"""``eagle3d export`` (eagle3d.tools.export, eagle3d.tools.exporters): each format as its
trainer's reader reads it, exactly once, resumed after a kill at any of its steps, refused where it must be.

The trainers' own readers (SpecForge's, speculators', ModelOpt's) load these exports in
the downstream stage (tests/test_downstream_readers.py, in .venv-specforge); here the files
are read the way those readers read them (torch.load, safetensors, pyarrow)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
from eagle3d.reader import HiddenStates, load_sample
from eagle3d.store import catalog
from eagle3d.tools import export, exporters
from eagle3proto import codec, paths
from runkit import ENV, conversations, run, run_args, write_jsonl
from safetensors.torch import load_file


def eagle3d_export(out: Path, to: Path, fmt: str, env: dict[str, str] | None = None) -> Any:
    cmd = [sys.executable, "-m", "eagle3d", "export", "-o", str(out), "--to", str(to)]
    r = subprocess.run(
        [*cmd, "--format", fmt, "--json"],
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return r.returncode, (json.loads(r.stdout) if r.stdout.startswith("{") else r.stderr)


def manifest(to: Path) -> list[export.Done]:
    data = (to / export.STATE / "done.e3x").read_bytes()
    return [export._decode(p) for p in codec.scan(data).payloads]


def test_specforge_export_of_fp8_files_is_bf16_in_specforges_layout(
    stored_outputs: Any, tmp_path: Path
) -> None:
    src = stored_outputs["fp8"]
    rc, rep = eagle3d_export(src, tmp_path / "sf", "specforge")
    assert rc == 0 and rep["exported"] == rep["committed"] == 40, rep
    assert rep["linked"] == 0  # fp8 files are not SpecForge's bytes: written again
    files = sorted((tmp_path / "sf").rglob("*.ckpt"))  # as SpecForge finds them
    assert len(files) == 40
    by_idx = {int(f.stem.removeprefix("data_")): f for f in files}
    for item in HiddenStates(src):
        d = torch.load(by_idx[item["idx"]], mmap=True, weights_only=True)
        assert list(d) == ["input_ids", "loss_mask", "hidden_state", "aux_hidden_state"]
        assert d["hidden_state"].dtype == d["aux_hidden_state"].dtype == torch.bfloat16
        for k in d:
            assert torch.equal(d[k], item[k]), k


def test_specforge_export_of_bf16_files_links_the_bytes_as_they_are(
    stored_outputs: Any, tmp_path: Path
) -> None:
    src, to = stored_outputs["bfloat16"], tmp_path / "sf"
    rc, rep = eagle3d_export(src, to, "specforge")
    assert rc == 0 and rep["exported"] == rep["linked"] == rep["committed"] == 40, rep
    for e in catalog.read(str(src)).entries:
        a, b = (src / e.path).stat(), (to / e.path).stat()
        assert (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev)  # one inode: no bytes copied
    recs = {d.idx: d for d in manifest(to)}
    for e in catalog.read(str(src)).entries:
        assert (recs[e.idx].size, recs[e.idx].checksum) == (e.bytes, e.checksum)
    lock = to / export.STATE / "lock"
    assert lock.stat().st_mode & 0o777 == 0o600  # no other user can open it to hold it
    lock.chmod(0o644)  # as an older version made it
    rc, rep = eagle3d_export(src, to, "specforge")  # again: nothing to do
    assert rc == 0 and rep["exported"] == 0 and rep["already"] == 40, rep
    assert lock.stat().st_mode & 0o777 == 0o600


def test_modelopt_export_is_one_pt_per_conversation_as_its_reader_loads_it(
    stored_outputs: Any, tmp_path: Path
) -> None:
    src = stored_outputs["fp8"]
    rc, rep = eagle3d_export(src, tmp_path / "mo", "modelopt")
    assert rc == 0 and rep["exported"] == 40, rep
    files = sorted((tmp_path / "mo").rglob("*.pt"))  # as ModelOpt's main lists them
    assert len(files) == 40
    for item in HiddenStates(src):
        rel = f"{paths.rows_dir(item['idx'])}/{item['idx']:08d}.pt"
        d = torch.load(tmp_path / "mo" / rel, weights_only=True)
        assert d["conversation_id"] == f"{item['idx']:08d}"
        assert torch.equal(d["input_ids"], item["input_ids"])
        assert torch.equal(d["loss_mask"], item["loss_mask"])
        assert torch.equal(d["hidden_states"], item["hidden_state"][0])  # [T, H], post-norm
        assert torch.equal(d["aux_hidden_states"], item["aux_hidden_state"][0])  # [T, 3H]
        assert "hidden_states_prenorm" not in d


def test_speculators_export_holds_rows_states_and_token_counts(
    stored_outputs: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    src, to = stored_outputs["bfloat16"], tmp_path / "spec"
    rc, rep = eagle3d_export(src, to, "speculators")
    assert rc == 0 and rep["exported"] == 40, rep
    state = json.loads((to / "state.json").read_text())
    assert state["_format_type"] == "torch"
    assert state["_data_files"] == [{"filename": "data-00000-of-00001.arrow"}]
    with pa.memory_map(str(to / "data-00000-of-00001.arrow")) as f:
        table = pa.ipc.open_stream(f).read_all()
    assert table.column_names == ["input_ids", "loss_mask", "seq_len"]
    assert table.schema.field("input_ids").type == pa.list_(pa.int64())
    rows = {r.k: r.idx for r in manifest(to)}
    assert sorted(rows) == list(range(40))
    norm = load_file(str(tiny_model_dir / "model.safetensors"))["model.norm.weight"].float()
    eps = json.loads((tiny_model_dir / "config.json").read_text())["rms_norm_eps"]
    cat = catalog.read(str(src))
    source = {e.idx: cat.path(e) for e in cat.entries}
    freq: dict[int, int] = {}
    for k in range(40):
        item = load_sample(source[rows[k]])
        hs = load_file(str(to / "hidden_states" / f"hs_{k}.safetensors"))
        t, h = item["hidden_state"].shape[1:]
        assert torch.equal(hs["token_ids"], item["input_ids"])
        assert table["input_ids"][k].as_py() == item["input_ids"].tolist()
        assert table["loss_mask"][k].as_py() == item["loss_mask"].tolist()
        assert table["seq_len"][k].as_py() == t
        assert (
            hs["hidden_states"].shape == (t, 4, h) and hs["hidden_states"].dtype == torch.bfloat16
        )
        assert torch.equal(hs["hidden_states"][:, :3].flatten(1), item["aux_hidden_state"][0])
        # The trainer applies the target's final RMSNorm to the last layer itself.
        x = hs["hidden_states"][:, 3].float()
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm
        want = item["hidden_state"][0].float()
        assert float((y - want).norm() / want.norm()) < 0.01
        for i, m in zip(item["input_ids"].tolist(), item["loss_mask"].tolist(), strict=True):
            if m:
                freq[i] = freq.get(i, 0) + 1
    assert torch.load(to / "token_freq.pt", weights_only=True) == freq


@pytest.mark.parametrize(
    ("fmt", "point"),
    [("speculators", "export_after_rename:13"), ("modelopt", "export_before_sync:2")],
)
def test_an_export_killed_and_resumed_exports_every_sample_exactly_once(
    stored_outputs: Any, tmp_path: Path, fmt: str, point: str
) -> None:
    src, to = stored_outputs["fp8"], tmp_path / fmt
    rc, _ = eagle3d_export(src, to, fmt, {"EAGLE3D_FAULT": f"kill:{point}"})
    assert rc == 137
    first = manifest(to)
    assert 0 < len(first) < 40
    rc, rep = eagle3d_export(src, to, fmt)
    assert rc == 0, rep
    assert rep["already"] == len(first) and rep["exported"] == 40 - len(first), rep
    recs = manifest(to)
    assert len(recs) == 40 and len({r.idx for r in recs}) == 40  # never twice
    assert sorted(r.k for r in recs) == list(range(40))
    assert {r.idx for r in recs} == {e.idx for e in catalog.read(str(src)).entries}
    names = {r.name for r in recs}
    on_disk = {str(p.relative_to(to)) for p in to.rglob("*") if p.is_file()}
    assert names <= on_disk
    assert not [n for n in on_disk if n.endswith(".tmp")], on_disk
    for r in recs:  # every file is the one recorded
        from eagle3d.store.crc import file_checksum

        assert file_checksum(str(to / r.name)) == (r.size, r.checksum)
    rc, rep = eagle3d_export(src, to, fmt)  # a third run: nothing to do
    assert rc == 0 and rep["exported"] == 0 and rep["already"] == 40
    assert len(manifest(to)) == 40


def test_an_export_grows_with_its_job_and_keeps_its_rows(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Exported while the job was stopped partway, then again after it finished: the rest
    is added, the first rows keep their numbers."""
    data = write_jsonl(tmp_path / "d.jsonl", conversations(30, seed=3))
    out, to = tmp_path / "out", tmp_path / "spec"
    r = subprocess.run(
        run_args(tiny_model_dir, data, out, "--store-dtype", "fp8"),
        env={**ENV, "EAGLE3D_FAULT": "kill:after_rename:12"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 137, r.stderr[-2000:]
    rc, rep = eagle3d_export(out, to, "speculators")
    assert rc == 0 and not rep["source_finished"], rep
    first = {rec.idx: rec.k for rec in manifest(to)}
    assert 0 < len(first) < 30
    assert run(tiny_model_dir, data, out, "--store-dtype", "fp8").returncode == 0
    rc, rep = eagle3d_export(out, to, "speculators")
    assert rc == 0 and rep["source_finished"] and rep["already"] == len(first), rep
    recs = {rec.idx: rec.k for rec in manifest(to)}
    assert len(recs) == 30 and all(recs[i] == k for i, k in first.items())
    with pa.memory_map(str(to / "data-00000-of-00001.arrow")) as f:
        assert pa.ipc.open_stream(f).read_all().num_rows == 30


def test_refusals_and_damaged_sources(stored_outputs: Any, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(stored_outputs["bfloat16"], src)
    rc, rep = eagle3d_export(tmp_path / "nothing", tmp_path / "x", "modelopt")
    assert rc == 2 and "no eagle3d journal" in rep["refused"]
    victim = catalog.read(str(src)).entries[5]
    with open(src / victim.path, "r+b") as f:
        f.seek(100)
        f.write(b"\0" * 8)
    rc, rep = eagle3d_export(src, tmp_path / "mo", "modelopt")
    assert rc == 1 and rep["exported"] == 39, rep
    said = f"sample {victim.idx}: {victim.path} does not match the journal"
    assert rep["problems"] == [f"{said} (eagle3d verify says more)"]
    assert rep["not_exported"] == {"damaged": 1}, rep
    assert not (tmp_path / "mo" / f"{victim.idx:08d}.pt").exists()
    rc, rep = eagle3d_export(src, tmp_path / "mo", "specforge")
    assert rc == 2 and "holds a modelopt export" in rep["refused"], rep
    rc, rep = eagle3d_export(stored_outputs["fp8"], tmp_path / "mo", "modelopt")
    assert rc == 2 and "holds a modelopt export of" in rep["refused"], rep


def _export_cmd(src: Path, to: Path, fmt: str) -> list[str]:
    cmd = [sys.executable, "-m", "eagle3d", "export", "-o", str(src), "--to", str(to)]
    return [*cmd, "--format", fmt]


_LINE = re.compile(r"export: (\d+)/(\d+) samples \(\d+ %\), [\d.]+ [MG]B, [\d.,]+ samples/s, ")


def test_export_logs_progress_and_ends_with_a_summary(stored_outputs: Any, tmp_path: Path) -> None:
    """Issue 27, point 10: not on a terminal, a plain progress line every ~2 s (done / total,
    rate, ETA) and a summary at the end: time, samples, tokens, bytes, linked vs copied.
    ``export_slow`` stretches 40 tiny samples over ~6 s so that lines come between."""
    src = stored_outputs["bfloat16"]
    r = subprocess.run(
        _export_cmd(src, tmp_path / "mo", "modelopt"),
        env={**ENV, "EAGLE3D_FAULT": "export_slow:150"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [m for m in map(_LINE.match, r.stderr.splitlines()) if m]
    done = [int(m.group(1)) for m in lines]
    assert len(done) >= 3 and done == sorted(done) and done[0] == 0 and done[-1] == 40, r.stderr
    assert all(m.group(2) == "40" for m in lines)
    assert "ETA " in r.stderr and "\r" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1].endswith(" s") and "done in" in r.stderr.splitlines()[-1]
    tokens = sum(e.tokens for e in catalog.read(str(src)).entries)
    summary = next(x for x in r.stdout.splitlines() if x.startswith("summary: "))
    assert summary.startswith("summary: 40 sample(s) exported in "), summary
    assert f"{tokens:,} tokens" in summary and "(0 hard-linked, 40 copied)" in summary, summary
    assert " MB written" in summary and "0 already exported" in summary, summary
    # Again: nothing left; the summary says so, and where the samples went (linked) too.
    rc, rep = eagle3d_export(src, tmp_path / "sf", "specforge")
    assert rc == 0 and rep["linked"] == 40 and rep["copied"] == 0 and rep["tokens"] == tokens


def test_export_on_a_terminal_shows_one_live_line(stored_outputs: Any, tmp_path: Path) -> None:
    """On a terminal (a real pseudo-terminal as stderr): one line rewritten in place with a
    carriage return, ended before the summary, which is printed whole."""
    import os
    import pty  # noqa: F401 - os.openpty is the pty module's own primitive

    master, slave = os.openpty()
    proc = subprocess.Popen(
        _export_cmd(stored_outputs["fp8"], tmp_path / "sf", "specforge"),
        env={**ENV, "EAGLE3D_FAULT": "export_slow:100"},
        stdout=subprocess.PIPE,
        stderr=slave,
        stdin=subprocess.DEVNULL,
    )
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the last holder of the terminal's other end has exited
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    out = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 0, seen.decode(errors="replace")[-2000:]
    text = seen.decode()
    frames = text.split("\r")
    live = [f for f in frames if _LINE.match(f)]
    assert len(live) >= 3, text  # the same line, rewritten
    assert all(f.endswith("\x1b[K") for f in live[:-1]), live
    assert "\n" not in "".join(live[:-1]), live  # no new line between rewrites
    assert live[-1].startswith("export: 40/40 samples"), live[-1]
    # the live line ended (the terminal shows "\n" as "\r\n") before anything else
    assert text.endswith(live[-1] + "\r\n"), text[-300:]
    summary = [x for x in out.splitlines() if x.startswith("summary: ")]
    assert summary and "40 sample(s) exported in" in summary[0] and "40 copied" in summary[0]


def _spread_output(model: Path, tmp_path: Path) -> Path:
    """A synthetic job whose 100 samples lie in three row folders (ids 0, 41, ..., 4059:
    shard 0 of 41 of a 4,100-row dataset), more than one folder's 2,000."""
    import random

    r = random.Random(5)
    data = tmp_path / "d.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for _ in range(4100):
            ids = [r.randrange(1, 900) for _ in range(16)]
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 4 + [1] * 12}) + "\n")
    out = tmp_path / "out"
    argv = run_args(model, data, out, "--backend", "synthetic", "--shard", "0/41")
    p = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return out


def test_modelopt_export_beyond_a_folder_lands_in_row_folders_and_all_are_read(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = _spread_output(tiny_model_dir, tmp_path)
    to = tmp_path / "mo"
    rc, rep = eagle3d_export(out, to, "modelopt")
    assert rc == 0 and rep["exported"] == 100, rep
    assert sorted(p.name for p in to.iterdir() if not p.name.startswith(".")) == [
        "rows_0-2000",
        "rows_2000-4000",
        "rows_4000-6000",
    ]
    files = sorted(str(p) for p in to.rglob("*.pt"))  # as ModelOpt's main lists them
    assert len(files) == 100
    got = {torch.load(f, weights_only=True)["conversation_id"] for f in files}
    assert got == {f"{i:08d}" for i in range(0, 4100, 41)}


def test_an_old_flat_modelopt_export_resumes_in_its_own_layout(
    stored_outputs: Any, tmp_path: Path
) -> None:
    """An export begun flat (before row folders) keeps each exported file where it is."""
    src, to = stored_outputs["fp8"], tmp_path / "mo"
    rc, _ = eagle3d_export(src, to, "modelopt", {"EAGLE3D_FAULT": "kill:export_before_sync:2"})
    assert rc == 137
    first = manifest(to)
    flat = [export.Done(**{**_fields(r), "name": r.name.split("/")[-1]}) for r in first]
    for r, f in zip(first, flat, strict=True):
        (to / r.name).rename(to / f.name)
    state = to / export.STATE / "done.e3x"
    state.write_bytes(b"".join(codec.encode_frame(export._encode(f)) for f in flat))
    rc, rep = eagle3d_export(src, to, "modelopt")
    assert rc == 0 and rep["already"] == len(flat) and rep["exported"] == 40 - len(flat), rep
    assert len(list(to.rglob("*.pt"))) == 40  # no sample twice
    assert {f.name for f in flat} <= {p.name for p in to.glob("*.pt")}


def _compact(obj: object, k: int) -> bool:
    """``obj``'s per-sample state is arrays of numbers: none of its attributes is a Python
    container of ``k`` or more objects (a dict, list or set of entries or records)."""
    from array import array

    values = [getattr(obj, a) for a in getattr(obj, "__slots__", ())] + list(
        getattr(obj, "__dict__", {}).values()
    )
    for v in values:
        if isinstance(v, array | bytes | bytearray | str):
            continue
        if isinstance(v, dict | list | set | tuple) and len(v) >= k:
            return False
    return True


def test_the_exports_state_is_arrays_by_sample_id_not_objects(
    stored_outputs: Any, tmp_path: Path
) -> None:
    """Issue 29: what an export keeps per sample is a few numbers in arrays by sample id
    (the catalog's pass 1 and the manifest), not an entry or a record per sample, so its
    memory at a million samples is megabytes. Checked on the structures, for K = 40."""
    from array import array

    src, to = stored_outputs["fp8"], tmp_path / "mo"
    cat = catalog.scan(str(src))
    assert cat.index.committed() == 40
    assert _compact(cat, 40) and _compact(cat.index, 40)
    assert all(not s.saved and _compact(s, 40) for s in cat.shards)
    assert isinstance(cat.index.owners, array) and isinstance(cat.index.seqs, array)
    assert cat.index.owners.itemsize + cat.index.seqs.itemsize == 5
    rep = export.export(str(src), str(to), "modelopt")
    assert rep.exit_code == 0 and rep.exported == 40, rep
    m = export.Manifest(str(to / export.STATE))
    try:
        assert _compact(m, 40)
        assert all(isinstance(a, array) for a in (m.ks, m.sources, m.at))
        assert sum(a.itemsize for a in (m.ks, m.sources, m.at)) == 12
        entries = catalog.read(str(src)).entries
        assert sorted(m.row(e.idx) for e in entries) == list(range(40))
        assert all(m.record(m.row(e.idx)).idx == e.idx for e in entries)  # read back by row
    finally:
        m.close()
    # The entries pass 2 hands over are the full fold's, one each.
    seen: list[catalog.Entry] = []
    assert cat.each(seen.append) == 40
    assert sorted(seen, key=lambda e: e.idx) == catalog.read(str(src)).entries


def _fields(r: export.Done) -> dict[str, Any]:
    import msgspec

    return msgspec.structs.asdict(r)


def test_speculators_index_is_written_in_batches_from_the_manifest(
    stored_outputs: Any, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows read back from ``done.e3x`` one at a time (the manifest keeps no ids in
    memory), the index written 7 rows to a record batch: the same table as a whole."""
    src, to = stored_outputs["bfloat16"], tmp_path / "spec"
    monkeypatch.setattr(exporters, "INDEX_BATCH", 7)
    rep = export.export(str(src), str(to), "speculators", str(tiny_model_dir))
    assert rep.exit_code == 0 and rep.exported == 40, rep
    with pa.memory_map(str(to / "data-00000-of-00001.arrow")) as f:
        reader = pa.ipc.open_stream(f)
        batches = list(reader)
    assert [b.num_rows for b in batches] == [7] * 5 + [5]
    table = pa.Table.from_batches(batches)
    m = export.Manifest(str(to / export.STATE))
    try:
        assert _compact(m, 40)  # no record, ids or mask in memory
        rows = list(m.rows())
    finally:
        m.close()
    assert [r.k for r in rows] == list(range(40))
    by_k = {r.k: r for r in manifest(to)}
    freq: dict[int, int] = {}
    for k, r in enumerate(rows):
        assert (r.input_ids, r.loss_mask) == (by_k[k].ids, by_k[k].mask)
        ids = torch.frombuffer(bytearray(r.input_ids), dtype=torch.int64).tolist()
        mask = torch.frombuffer(bytearray(r.loss_mask), dtype=torch.int64).tolist()
        assert table["input_ids"][k].as_py() == ids and table["seq_len"][k].as_py() == len(ids)
        assert table["loss_mask"][k].as_py() == mask
        for i, v in zip(ids, mask, strict=True):
            if v:
                freq[i] = freq.get(i, 0) + 1
    assert torch.load(to / "token_freq.pt", weights_only=True) == freq
