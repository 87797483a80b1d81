"""``eagle3-top --once``: the real console script against real journals, locks, sockets."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from eagle3proto import events as ev
from eagle3proto import locks, paths
from eagle3proto.journalread import list_segments
from eagle3top import sources
from monitor_helpers import (
    EAGLE3_TOP,
    FAKE_SSH,
    PY,
    event_source,
    hold_lock,
    run_events,
    stats,
    top,
    wait_for,
    write_journal,
)

pytestmark = pytest.mark.timeout(60)

KEYS = {
    "state",
    "total",
    "sent",
    "dumped",
    "saved",
    "failed",
    "rate_samples_s",
    "rate_tokens_s",
    "eta_s",
    "age_s",
    "disk",
    "gpus",
    "errors",
}


def once_json(out: str, *extra: str, env: dict[str, str] | None = None) -> tuple[dict, int]:
    p = top("--once", "--json", "--output", out, *extra, env=env)
    assert p.stdout, p.stderr
    return json.loads(p.stdout), p.returncode


def test_running_daemon_via_socket_is_ok(tmp_path) -> None:
    out = str(tmp_path)
    with event_source(out, "--total", "100000", "--rate", "300", "--bytes", "1000"):
        assert wait_for(lambda: once_json(out)[0]["saved"] > 5)
        doc, rc = once_json(out)
    assert doc.keys() >= KEYS
    assert (doc["state"], rc) == ("running", 0), doc["messages"]
    assert doc["shards"][0]["source"] == "socket" and doc["shards"][0]["alive"] is True
    assert isinstance(doc["saved"], int) and isinstance(doc["rate_samples_s"], float)
    assert doc["total"] == 100000
    assert doc["sent"] >= doc["dumped"] >= doc["saved"] > 0
    assert doc["disk"][0]["label"] == "output" and doc["disk"][0]["free_bytes"] > 0
    assert doc["gpus"] == []
    assert 0 <= doc["age_s"] < 5


def test_finished_run_is_ok_from_the_journal(tmp_path) -> None:
    t0 = time.time() - 100
    events = run_events(t0, total=3, saved=3)
    events.append(ev.RunFinished(ts=t0 + 4, saved=3, failed=0))
    write_journal(str(tmp_path), events)
    doc, rc = once_json(str(tmp_path))
    assert (doc["state"], rc) == ("finished", 0)
    assert (doc["saved"], doc["failed"], doc["total"], doc["eta_s"]) == (3, 0, 3, 0.0)
    assert doc["shards"][0]["source"] == "journal"
    assert 90 < doc["age_s"] < 200


@pytest.mark.parametrize(
    ("code", "state", "rc"), [(0, "stopped", 1), (3, "stopped", 2)], ids=["clean", "failed"]
)
def test_stopped_clean_is_warning_failed_run_is_critical(tmp_path, code, state, rc) -> None:
    t0 = time.time() - 50
    events = run_events(t0, total=10, saved=4)
    events.append(
        ev.RunStopped(ts=t0 + 5, reason="signal" if not code else "dataset", exit_code=code)
    )
    write_journal(str(tmp_path), events)
    doc, got = once_json(str(tmp_path))
    assert (doc["state"], got) == (state, rc)
    if code:
        assert "run failed (exit 3)" in doc["reason"]


def test_dead_daemon_with_work_left_is_down_and_critical(tmp_path) -> None:
    t0 = time.time() - 30
    write_journal(str(tmp_path), run_events(t0, total=10, saved=4))
    doc, rc = once_json(str(tmp_path))
    assert (doc["state"], rc) == ("down", 2)
    assert doc["shards"][0]["alive"] is False
    assert "6 samples left" in doc["reason"]


def test_live_lock_but_silent_journal_is_stalled(tmp_path) -> None:
    out = str(tmp_path)
    t0 = time.time() - 1000
    write_journal(out, run_events(t0, total=10, saved=4))
    with hold_lock(out):
        doc, rc = once_json(out)
    assert (doc["state"], rc) == ("stalled", 1)
    assert doc["shards"][0]["alive"] is True and doc["shards"][0]["source"] == "journal"


def test_nothing_found_is_unknown(tmp_path) -> None:
    doc, rc = once_json(str(tmp_path / "nothing"))
    assert (doc["state"], rc) == ("unknown", 3)
    p = top("--once", "--socket", str(tmp_path / "none.sock"))
    assert p.returncode == 3 and "UNKNOWN" in p.stdout


def test_torn_tail_gives_the_whole_record_prefix(tmp_path) -> None:
    out = str(tmp_path)
    t0 = time.time() - 20
    jdir = write_journal(out, run_events(t0, total=10, saved=5))
    seg = list_segments(jdir)[-1]
    size = os.path.getsize(seg)
    with open(seg, "r+b") as f:
        f.truncate(size - 7)  # a crash in the middle of the last frame (sample 4's save)
    doc, rc = once_json(out)
    assert (doc["state"], rc) == ("down", 2)
    assert doc["saved"] == 4
    assert doc["sent"] == 5  # sample 4 was sent; its save record is the torn one
    assert any("torn" in n for n in doc["shards"][0]["notes"])


def test_disk_full_is_critical_and_projected_short_is_warning(tmp_path) -> None:
    now = time.time()
    full, short = str(tmp_path / "full"), str(tmp_path / "short")
    for out, free in ((full, 1 << 20), (short, 500 * 10**9)):
        events = run_events(now - 30, total=1000, saved=20, step=1.0, bytes_each=10**9)
        events.append(stats(now - 1, free=free))
        write_journal(out, events)
    with hold_lock(full):
        doc, rc = once_json(full)
    assert rc == 2 and any("disk full" in m for m in doc["messages"])
    with hold_lock(short):
        doc, rc = once_json(short, env={})
    assert rc == 1, doc["messages"]
    d = doc["disk"][0]
    assert d["fits"] is False and d["projected_bytes"] == 980 * 10**9
    assert d["runs_out_in_s"] is not None and d["runs_out_in_s"] > 0


def test_recent_failures_are_a_warning(tmp_path) -> None:
    out = str(tmp_path)
    now = time.time()
    events = run_events(now - 10, total=100, saved=5, failed=2)
    write_journal(out, events)
    with hold_lock(out):
        doc, rc = once_json(out)
    assert rc == 1
    assert any("failures rising" in m for m in doc["messages"])
    assert [e["idx"] for e in doc["errors"]] == [5, 6]


def test_several_shards_give_rows_and_totals(tmp_path) -> None:
    out = str(tmp_path)
    t0 = time.time() - 100
    for i in range(2):
        shard = paths.Shard(i, 2)
        events = run_events(t0, total=5, saved=5 if i == 0 else 2)
        if i == 0:
            events.append(ev.RunFinished(ts=t0 + 6, saved=5))
        write_journal(out, events, shard)
    doc, rc = once_json(out)
    assert [s["label"] for s in doc["shards"]] == ["shard-0-of-2", "shard-1-of-2"]
    assert [s["state"] for s in doc["shards"]] == ["finished", "down"]
    assert (doc["saved"], doc["total"], doc["state"], rc) == (7, 10, "down", 2)
    doc1, _ = once_json(out, "--shard", "0/2")
    assert [s["label"] for s in doc1["shards"]] == ["shard-0-of-2"]


def test_text_output_has_no_colour_when_piped_and_help_documents_exit_codes(tmp_path) -> None:
    t0 = time.time() - 100
    write_journal(str(tmp_path), [*run_events(t0, 2, 2), ev.RunFinished(ts=t0 + 3, saved=2)])
    p = top("--once", "--output", str(tmp_path))
    assert p.returncode == 0
    assert "\x1b[" not in p.stdout
    assert "FINISHED" in p.stdout and "saved 2 / 2" in p.stdout
    h = top("--help")
    for line in ("0  OK", "1  WARNING", "2  CRITICAL", "3  UNKNOWN"):
        assert line in h.stdout
    assert top("--interval", "0.1", "--once").returncode == 2


#: What ``--once`` on this host has no use for: the TUI's and the daemon's libraries, and the
#: standard library's modules only a remote host, the daemon's writer or argparse's help
#: width needs (each is start time a health check pays on every call); ``typing_extensions``
#: (with ``inspect``) is what msgspec would load for itself (see ``eagle3top.boot``).
NOT_FOR_ONCE = (
    *("textual", "torch", "rich", "sglang", "asyncio"),
    *("dataclasses", "subprocess", "shlex", "threading", "shutil", "bz2", "lzma"),
    *("typing_extensions", "inspect"),
)


@pytest.mark.parametrize("fmt_name", ["json", "text"])
def test_once_imports_neither_textual_nor_torch(tmp_path, fmt_name: str) -> None:
    t0 = time.time() - 100
    write_journal(str(tmp_path), run_events(t0, 2, 1))
    code = (
        "import sys; from eagle3top.cli import main; rc = main(['--once', '--format', "
        f"{fmt_name!r}, '--output', {str(tmp_path)!r}]); heavy = sorted(m for m in "
        f"{NOT_FOR_ONCE!r} if m in sys.modules); print('HEAVY', heavy, file=sys.stderr); "
        "sys.exit(rc)"
    )
    p = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=False)
    assert "HEAVY []" in p.stderr, p.stderr
    assert p.returncode == 2  # down: the journal has work left and nobody holds the lock


def test_msgspec_loaded_lean_decodes_and_leaves_typing_extensions_importable() -> None:
    code = (
        "import sys, eagle3top.boot, msgspec; assert 'typing_extensions' not in sys.modules; "
        "from eagle3proto import wire; from eagle3proto.reducer import ShardState; "
        "s = wire.Snapshot(host='h', state=ShardState(pid=7, run='r')); "
        "[p] = wire.FrameBuffer().feed(wire.encode(s)); assert wire.decode_payload(p) == s; "
        "import typing_extensions, textual.app; print('OK', msgspec._utils._get_type_hints.__module__)"
    )
    p = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=False)
    assert p.stdout.split() == ["OK", "typing"], p.stderr


def test_remote_once_through_the_stream_relay(tmp_path) -> None:
    env = {"EAGLE3_TOP_SSH": FAKE_SSH, "EAGLE3_TOP_REMOTE": EAGLE3_TOP}
    t0 = time.time() - 100
    done = str(tmp_path / "done")
    write_journal(done, [*run_events(t0, 3, 3), ev.RunFinished(ts=t0 + 4, saved=3)])
    p = top("--once", "--json", "--output", done, "nodeA", env=env)
    doc = json.loads(p.stdout)
    assert (doc["state"], p.returncode) == ("finished", 0)
    assert doc["shards"][0]["label"] == "nodeA shard-0-of-1"
    assert doc["shards"][0]["source"] == "ssh/journal"
    live = str(tmp_path / "live")
    with event_source(live, "--total", "100000", "--rate", "300", "--bytes", "1000"):
        p = top("--once", "--json", "--output", live, "nodeB", env=env)
    doc = json.loads(p.stdout)
    assert (doc["state"], p.returncode) == ("running", 0), doc
    assert doc["shards"][0]["source"] == "ssh/socket" and doc["shards"][0]["alive"] is True
    bad = top(
        "--once",
        "--json",
        "--output",
        live,
        "nodeC",
        env={"EAGLE3_TOP_SSH": "false", "EAGLE3_TOP_REMOTE": EAGLE3_TOP},
    )
    assert bad.returncode == 3 and json.loads(bad.stdout)["state"] == "unknown"


def test_lock_probe_with_and_without_proc_locks(tmp_path) -> None:
    out = str(tmp_path)
    lock = paths.lock_path(out, paths.Shard(0, 1))
    assert sources.lock_held(lock) is False  # no file
    with hold_lock(out):
        assert sources.lock_held(lock) is True
        assert sources.lock_held(lock, proc_locks="/nonexistent") is True
    assert sources.lock_held(lock) is False
    assert sources.lock_held(lock, proc_locks="/nonexistent") is False


def test_an_early_lock_table_read_is_taken_once_and_only_while_fresh(tmp_path, monkeypatch) -> None:
    """``locks.read_early`` (begun at the monitor's import) answers the next ``holders``
    of ``/proc/locks`` only, once, and only while fresh; otherwise the table is read again."""
    out = str(tmp_path)
    lock = paths.lock_path(out, paths.Shard(0, 1))
    os.makedirs(os.path.dirname(lock))
    open(lock, "w").close()
    monkeypatch.setattr(locks, "EARLY_MAX_AGE_S", 60.0)
    locks.read_early()
    with locks._early_done:  # the read is over before the lock is taken
        pass
    with hold_lock(out):
        assert locks.holders(lock, proc_locks="/nonexistent") is None  # another table: not it
        assert locks.holders(lock) == []  # the early read's answer, from before the lock
        assert locks.holders(lock) == [os.getpid()]  # taken once: now read again
    monkeypatch.setattr(locks, "EARLY_MAX_AGE_S", 0.0)
    locks.read_early()
    with hold_lock(out):
        assert locks.holders(lock) == [os.getpid()]  # the early read is too old: read again


def test_socket_path_comes_from_the_newest_run_started(tmp_path) -> None:
    out = str(tmp_path)
    jdir = write_journal(out, [ev.RunStarted(ts=1.0, total=1, socket="/run/a.sock")])
    write_journal(out, [ev.RunStarted(ts=2.0, total=1, socket="/run/b.sock")])
    assert sources.newest_socket(jdir) == "/run/b.sock"
    t = sources.discover(out, None)[0]
    assert t.socket_candidates()[0] == "/run/b.sock"
    assert t.socket_candidates()[1] == paths.default_socket_path(
        os.path.abspath(out), paths.Shard(0, 1)
    )


def test_long_run_keeps_a_bounded_rate_window(tmp_path) -> None:
    """2,000 one-per-second saves: the history window stays 900 s and the rate is right."""
    from eagle3proto import reducer, views

    s = reducer.new_state()
    t0 = 1_000_000.0
    reducer.apply_all(s, [e for e in run_events(t0, 5000, 2000, step=1.0)])
    assert len(s.history) == reducer.HISTORY_SECONDS
    assert s.history[0].t == int(t0) + 2000 - reducer.HISTORY_SECONDS + 1
    v = views.view(s, t0 + 2000.5)
    assert v.rate_1m.samples_s == pytest.approx(1.0, rel=0.05)


def test_no_arguments_finds_daemons_by_their_runtime_sockets(tmp_path) -> None:
    """`eagle3-top` with no arguments (here, and on a remote host) finds running daemons."""
    runtime = tmp_path / "xdg"
    runtime.mkdir()
    out = str(tmp_path / "out")
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    old = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = str(runtime)  # the source takes the default socket path
    try:
        with event_source(out, "--total", "100000", "--rate", "300", "--bytes", "1000"):
            sock = paths.default_socket_path(os.path.abspath(out), paths.Shard(0, 1))
            assert sock.startswith(str(runtime / "eagle3d"))
            elsewhere = tmp_path / "cwd"
            elsewhere.mkdir()
            p = subprocess.run(
                [EAGLE3_TOP, "--once", "--json"],
                capture_output=True,
                text=True,
                cwd=elsewhere,
                env={**os.environ, **env},
                check=False,
            )
            doc = json.loads(p.stdout)
            assert (doc["state"], p.returncode) == ("running", 0), doc
            assert doc["shards"][0]["output"] == os.path.abspath(out)
            remote = top(
                "--once",
                "--json",
                "nodeR",
                env={**env, "EAGLE3_TOP_SSH": FAKE_SSH, "EAGLE3_TOP_REMOTE": EAGLE3_TOP},
            )
            assert json.loads(remote.stdout)["shards"][0]["source"] == "ssh/socket"
    finally:
        if old is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = old
    p = subprocess.run(
        [EAGLE3_TOP, "--once"],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env={**os.environ, **env},
        check=False,
    )
    assert p.returncode == 3  # the daemon is gone and nothing else is known
