"""The full daemon with ``--backend sglang`` against a local server speaking SGLang's HTTP API.

The server (tests/sglang_fake_server.py) runs the tiny model through the stand-in of SGLang's
Llama forward and writes dumps through the real capture hook, loaded from the arguments
``eagle3d sglang-args`` prints. It crashes mid-run and is restarted; the run must end with
every valid sample saved exactly once, equal to an independent Hugging Face forward.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import runkit
import sglang_real
import torch

HERE = Path(__file__).resolve().parent
FAKE = HERE / "sglang_fake_server.py"
SERVER_ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except OSError:
        return 0, ""


class Supervisor:
    """Starts the fake server; restarts it when it dies, ``crashes`` times with --exit-after."""

    def __init__(
        self, model: Path, port: int, extra: list[str], log: Path, crashes: int, exit_after: int
    ):
        self.cmd = [
            sys.executable,
            str(FAKE),
            "--model-path",
            str(model),
            "--port",
            str(port),
            *extra,
        ]
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.crashes = crashes
        self.exit_after = exit_after
        self.starts = 0
        self.exits: list[int] = []
        self.stopping = False
        self.proc = self._start()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _start(self) -> subprocess.Popen[bytes]:
        extra = ["--exit-after", str(self.exit_after)] if self.starts < self.crashes else []
        self.starts += 1
        with open(self.log, "ab") as logf:
            return subprocess.Popen(
                self.cmd + extra,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env={**os.environ, **SERVER_ENV},
            )

    def _watch(self) -> None:
        while not self.stopping:
            rc = self.proc.poll()
            if rc is not None and not self.stopping:
                self.exits.append(rc)
                time.sleep(1.0)  # the server is down a while: the client must wait, not fail
                self.proc = self._start()
            time.sleep(0.05)

    def wait_ready(self, timeout: float = 60) -> None:
        runkit.wait_for(
            lambda: get(self.url + "/health")[0] == 200, timeout, "the fake SGLang server"
        )

    def stop(self) -> None:
        self.stopping = True
        self.thread.join(5)
        self.proc.terminate()
        self.proc.wait(10)


def hf_check(out: Path, model_dir: Path, saved: set[int]) -> None:
    from eagle3proto import paths
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n = model.config.num_hidden_layers
    layers = [2, n // 2, n - 3] if n >= 7 else [1, n // 2, n - 1]  # the documented default
    for idx in sorted(saved):
        d = torch.load(out / paths.sample_relpath(idx), weights_only=True)
        with torch.no_grad():
            hs = model.model(
                input_ids=d["input_ids"][None], output_hidden_states=True
            ).hidden_states
        # The server's dumps are float32 (its hook is not told a storage dtype): the commit
        # casts them to the job's default, bfloat16.
        assert d["aux_hidden_state"].dtype == d["hidden_state"].dtype == torch.bfloat16
        aux = torch.cat([hs[i] for i in layers], -1)
        bf16 = {"rtol": 2**-8, "atol": 1e-5}
        torch.testing.assert_close(d["aux_hidden_state"].float(), aux, **bf16)
        torch.testing.assert_close(d["hidden_state"].float(), hs[-1], **bf16)


@pytest.mark.slow
def test_daemon_against_a_restarting_sglang_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    valid, malformed = runkit.dataset(data, 36)
    out = tmp_path / "out"
    dumps = Path(f"{out}.dumps")  # what runkit passes as --dump-dir
    extra = [*sglang_real.sglang_args(dumps, tiny_model_dir), "--chunked-prefill-size", "96"]
    sup = Supervisor(
        tiny_model_dir, free_port(), extra, tmp_path / "server.log", crashes=2, exit_after=10
    )
    try:
        sup.wait_ready()
        # --request-timeout above the server's down time: the daemon (runner.py) still counts
        # its own timeouts while the producer reports the server down
        r = runkit.run(
            tiny_model_dir,
            data,
            out,
            "--backend",
            "sglang",
            "--server",
            sup.url,
            "--concurrency",
            "6",
            "--request-timeout",
            "60",
            timeout=240,
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert sup.exits == [17, 17] and sup.starts == 3  # it really crashed twice mid-run
    finally:
        sup.stop()
    runkit.assert_complete(out, valid, malformed)
    states = [rec["state"] for rec in runkit.records(out, "producer")]
    assert states.count("down") >= 2 and states[-1] == "up", states
    hf_check(out, tiny_model_dir, valid)
    # The run's last stats record (just before run_finished) is read after a last poll: it
    # carries the final server's own /metrics, whatever the poll interval caught before.
    stats = runkit.records(out, "stats")
    assert stats[-1]["state"] == "finished", stats[-1]
    last = stats[-1].get("producer", {}).get("detail", {})
    assert "metrics_at" in last and last.get("prompt_tokens_total", 0) > 0, last


def _shim(tmp: Path) -> Path:
    """A ``sglang.launch_server`` module that runs the fake server (for ``serve-sglang``)."""
    pkg = tmp / "shim" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(
        "import runpy, sys\n"
        f"sys.argv[0] = {str(FAKE)!r}\n"
        f"runpy.run_path({str(FAKE)!r}, run_name='__main__')\n"
    )
    return tmp / "shim"


@pytest.mark.slow
def test_serve_sglang_supervises_polls_without_generating_and_forwards_sigterm(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    dumps = tmp_path / "out.dumps"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(_shim(tmp_path)), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", None)  # serve-sglang must set it
    cmd = [
        sys.executable,
        "-m",
        "eagle3d",
        "serve-sglang",
        "--dump-dir",
        str(dumps),
        "--",
        "--model-path",
        str(tiny_model_dir),
        "--port",
        str(port),
    ]
    with open(tmp_path / "serve.log", "wb") as logf:
        proc = subprocess.Popen(
            cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        runkit.wait_for(
            lambda: b"ready at" in (tmp_path / "serve.log").read_bytes(), 60, "serve-sglang ready"
        )
        data = tmp_path / "data.jsonl"
        valid, malformed = runkit.dataset(data, 10)
        r = runkit.run(
            tiny_model_dir,
            data,
            tmp_path / "out",
            "--backend",
            "sglang",
            "--server",
            url,
            timeout=120,
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        runkit.assert_complete(tmp_path / "out", valid, malformed)
        status, metrics = get(url + "/metrics")
        assert status == 200 and "eagle3d_fake:health_generations_total 0.0" in metrics
        info: dict[str, Any] = json.loads(get(url + "/server_info")[1])
        assert info["disable_radix_cache"] and info["disable_prefill_cuda_graph"]
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    assert rc == 128 + signal.SIGTERM  # the server died of the forwarded signal
    assert get(url + "/health")[0] == 0  # and is gone
