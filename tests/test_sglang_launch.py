"""``eagle3d serve-sglang`` / ``sglang-args`` argument building (supervision: test_sglang_integration)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from eagle3d.cli import main
from eagle3d.remote.sglang_rid import FACTORY
from eagle3d.tools import sglang_launch as sl
from eagle3d.tools import sglang_supervise as sv


def spec_of(args: list[str]) -> dict[str, object]:
    (spec,) = json.loads(args[args.index("--forward-hooks") + 1])
    return spec  # type: ignore[no-any-return]


def test_extra_args_load_the_hook_and_disable_what_defeats_capture(tmp_path: Path) -> None:
    args = sl.extra_args(str(tmp_path / "d"), [3, 1, 3], max_pending=7)
    spec = spec_of(args)
    assert spec["hook_factory"] == FACTORY
    assert spec["config"] == {
        "dump_dir": str(tmp_path / "d"),
        "aux_layers": [3, 1, 3],
        "max_pending": 7,
    }
    assert {"--disable-radix-cache", "--disable-prefill-cuda-graph", "--enable-metrics"} <= set(
        args
    )
    assert "aux_layers" not in spec_of(sl.extra_args("rel/dir"))["config"]  # type: ignore[operator]
    assert spec_of(sl.extra_args("rel/dir"))["config"]["dump_dir"].startswith("/")  # type: ignore[index]


@pytest.mark.parametrize(
    "user, bad",
    [
        (["--tp", "8"], []),
        (["--enable-dp-attention"], ["--enable-dp-attention"]),
        (["--pp-size=2", "--forward-hooks", "[]"], ["--pp-size", "--forward-hooks"]),
        (["--cuda-graph-backend-prefill", "full"], ["--cuda-graph-backend-prefill"]),
    ],
)
def test_conflicting_user_arguments(user: list[str], bad: list[str]) -> None:
    assert [c.split(":")[0] for c in sl.conflicts(user)] == bad


@pytest.mark.parametrize(
    "user, url",
    [
        ([], "http://127.0.0.1:30000"),
        (["--host", "0.0.0.0", "--port", "8000"], "http://127.0.0.1:8000"),
        (["--host=10.0.0.2", "--port=1"], "http://10.0.0.2:1"),
    ],
)
def test_server_url(user: list[str], url: str) -> None:
    assert sl.server_url(user) == url


def test_sglang_args_prints_exactly_the_extra_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sglang-args", "--dump-dir", str(tmp_path), "--aux-layers", "1,2,3"]) == 0
    out = capsys.readouterr()
    assert shlex.split(out.out) == sl.extra_args(str(tmp_path), [1, 2, 3])
    assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false" in out.err
    assert main(["sglang-args", "--dump-dir", str(tmp_path), "--format", "json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js == {"args": sl.extra_args(str(tmp_path)), "env": sl.HEALTH_ENV}


def test_serve_dry_run_and_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = str(tmp_path / "dumps")
    assert (
        main(
            ["serve-sglang", "--dump-dir", d, "--dry-run", "--", "--model-path", "/m", "--tp", "8"]
        )
        == 0
    )
    line = capsys.readouterr().out.strip()
    env, *cmd = shlex.split(line)
    assert env == "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false"
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and cmd[3:7] == [
        "--model-path",
        "/m",
        "--tp",
        "8",
    ]
    assert cmd[7:] == sl.extra_args(d)
    assert (
        main(["serve-sglang", "--dump-dir", d, "--", "--model-path", "/m", "--enable-dp-attention"])
        == 2
    )
    assert "--enable-dp-attention" in capsys.readouterr().err
    assert main(["serve-sglang", "--dump-dir", d, "--", "--tp", "8"]) == 2
    assert "--model-path" in capsys.readouterr().err


def test_serve_returns_the_server_exit_status(tmp_path: Path) -> None:
    # a "server" that exits at once with status 3: supervise reports it
    rc = sv.supervise(
        [sys.executable, "-c", "import sys; sys.exit(3)"], {}, "http://127.0.0.1:9", poll=0.05
    )
    assert rc == 3
    r = subprocess.run(
        [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
        check=False,
    )
    assert r.returncode == -9
    assert (
        sv.supervise(
            [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
            {},
            "http://127.0.0.1:9",
            poll=0.05,
        )
        == 137
    )


def test_default_layers_from_a_local_model_directory(tmp_path: Path, tiny_model_dir: Path) -> None:
    n = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
    # The documented default: [2, L//2, L-3] where distinct, else [1, L//2, L-1] (4-6 layers).
    want = [2, n // 2, n - 3] if n >= 7 else [1, n // 2, n - 1]
    assert sl.default_layers(str(tiny_model_dir)) == want
    (tmp_path / "vl").mkdir()
    (tmp_path / "vl" / "config.json").write_text(
        json.dumps({"text_config": {"num_hidden_layers": 61}})
    )
    assert sl.default_layers(str(tmp_path / "vl")) == [2, 30, 58]  # Kimi-K2.5-style nesting
    assert sl.default_layers("moonshotai/Kimi-K2.5") is None and sl.default_layers(None) is None
    assert sl.model_path_of(["--tp", "8", "--model-path=/m"]) == "/m"


def test_serve_writes_the_model_default_layers_into_the_spec(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "serve-sglang",
                "--dump-dir",
                str(tmp_path),
                "--dry-run",
                "--",
                "--model-path",
                str(tiny_model_dir),
            ]
        )
        == 0
    )
    cmd = shlex.split(capsys.readouterr().out)[1:]
    assert spec_of(cmd)["config"]["aux_layers"] == sl.default_layers(str(tiny_model_dir))  # type: ignore[index]
    assert (
        main(
            [
                "sglang-args",
                "--dump-dir",
                str(tmp_path),
                "--model-path",
                str(tiny_model_dir),
                "--aux-layers",
                "1,2",
            ]
        )
        == 0
    )
    assert spec_of(shlex.split(capsys.readouterr().out))["config"]["aux_layers"] == [1, 2]  # type: ignore[index]


def test_restart_policy() -> None:
    p = sv.RestartPolicy(base=2, cap=10, stable=300, max_unready=3)
    assert p.died(ready=False, life_s=5) is None  # never ready: a configuration error
    p = sv.RestartPolicy(base=2, cap=10, stable=300, max_unready=3)
    assert [p.died(ready=True, life_s=30) for _ in range(4)] == [2, 4, 8, 10]
    assert p.died(ready=True, life_s=301) == 2  # a long healthy life resets the back-off
    assert p.died(ready=False, life_s=1) == 4 and p.died(ready=False, life_s=1) == 8
    assert p.died(ready=False, life_s=1) is None  # three restarts in a row never got ready
    assert p.restarts == 7


SERVER = """
import http.server, os, sys, threading, time
open(sys.argv[2], "a").write(f"{os.getpid()}\\n")
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
srv = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
time.sleep(0.6)
os._exit(1)  # a crash after it was ready
"""


def test_serve_restarts_a_server_that_died_after_it_was_ready_until_stopped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging
    import os
    import signal
    import socket
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lives = tmp_path / "lives"
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    cmd = [sys.executable, str(script), str(port), str(lives)]
    stopper = threading.Timer(4.0, os.kill, (os.getpid(), signal.SIGTERM))
    stopper.start()
    caplog.set_level(logging.INFO, "eagle3d.sglang")
    try:
        rc = sv.supervise(
            cmd,
            dict(os.environ),
            f"http://127.0.0.1:{port}",
            poll=0.05,
            policy=sv.RestartPolicy(base=0.1, cap=0.2),
        )
    finally:
        stopper.cancel()
    assert len(lives.read_text().split()) >= 3, caplog.text
    assert "restart 1 in 0 s" in caplog.text and "restart 2 in 0 s" in caplog.text
    assert "SIGTERM" in caplog.text
    assert rc in (0, 1, 128 + signal.SIGTERM)


def test_a_killed_serve_sglang_takes_its_server_with_it(tmp_path: Path) -> None:
    """SGLang runs in a session of its own; if serve-sglang dies by SIGKILL, the server gets
    SIGTERM (parent-death signal) rather than living on with its port and memory."""
    import os
    import signal
    import time

    pidfile = tmp_path / "server.pid"
    child = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    sup = (
        "import sys; from eagle3d.tools import sglang_supervise as sl; "
        f"sl.supervise([sys.executable, '-c', {child!r}], {{}}, 'http://127.0.0.1:9', poll=0.05)"
    )
    proc = subprocess.Popen([sys.executable, "-c", sup])
    try:
        deadline = time.monotonic() + 30
        while not pidfile.exists() or not pidfile.read_text():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        server = int(pidfile.read_text())
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while True:
            try:
                os.kill(server, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "the server outlived its supervisor"
            time.sleep(0.05)
    finally:
        proc.kill()
