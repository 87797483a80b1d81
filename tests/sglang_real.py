"""Helpers for the tests against a real, stock SGLang 0.5.21 server on this CPU.

The server runs from ``.venv-sglang`` (``scripts/sglang_env``; another Python with
``EAGLE3D_SGLANG_PYTHON``), the daemon and the reference forward from the test's own Python.
The tests run only with ``EAGLE3D_SGLANG_E2E=1`` (CI's SGLang stage sets it):

    scripts/sglang_env && EAGLE3D_SGLANG_E2E=1 scripts/test tests/test_sglang_real_*.py

Every server gets ``EAGLE3D_SGL_KERNEL_TRAP``: a call into the import-only ``sgl_kernel``
stand-in (or a lookup of a name it lacks) leaves a line there, and :meth:`Server.check_clean`
fails the test on it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import runkit

REPO = Path(__file__).resolve().parent.parent
SGLANG_PY = Path(os.environ.get("EAGLE3D_SGLANG_PYTHON", REPO / ".venv-sglang" / "bin" / "python"))
ENABLED = os.environ.get("EAGLE3D_SGLANG_E2E") == "1"

needs_real_sglang = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not ENABLED,
        reason="a real SGLang server: scripts/sglang_env, then EAGLE3D_SGLANG_E2E=1",
    ),
    pytest.mark.skipif(
        ENABLED and not SGLANG_PY.exists(),
        reason=f"{SGLANG_PY} missing: run scripts/sglang_env",
    ),
]

#: What SGLang needs on a CPU (docs/sglang.md, "A real SGLang on a CPU").
CPU_ARGS = ["--device", "cpu", "--max-total-tokens", "16384", "--host", "127.0.0.1"]
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}
# One OpenMP thread for a test's server: it shares the two cores with the daemon and the test,
# and spinning OpenMP threads on a contended core made forwards of a tiny model 100x slower.
TEST_THREADS = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(url: str, body: Any = None, timeout: float = 30.0) -> tuple[int, Any]:
    """GET (or POST ``body`` as JSON); (status, decoded JSON or text); (0, error) when down."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError as e:
        return 0, str(e)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


class Server:
    """A real SGLang server: ``eagle3d serve-sglang`` (supervised), or a bare
    ``python -m sglang.launch_server`` with ``eagle3d sglang-args``' arguments (``bare=True``,
    for settings serve-sglang refuses on purpose, such as the radix cache)."""

    def __init__(
        self,
        model: Path,
        dump_dir: Path,
        work: Path,
        *,
        dtype: str = "float32",
        extra: list[str] | None = None,
        bare: bool = False,
        hook: bool = True,
        drop_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        threads: int | None = TEST_THREADS,
        layers: list[int] | None = None,
        store_dtype: str | None = None,
    ) -> None:
        """``store_dtype``: the hook's (``serve-sglang --store-dtype``; not with ``bare``)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dump_dir = dump_dir
        self.log = work / f"sglang-{self.port}.log"
        self.trap = work / f"sgl-kernel-trap-{self.port}"
        user = ["--model-path", str(model), "--port", str(self.port), "--dtype", dtype]
        user += CPU_ARGS + list(extra or [])
        if bare:
            from eagle3d.tools.sglang_launch import FIXED_ARGS

            ours = sglang_args(dump_dir, model) if hook else list(FIXED_ARGS)
            ours = [a for a in ours if a not in drop_args]
            cmd = [str(SGLANG_PY), "-m", "sglang.launch_server", *user, *ours]
        else:
            cmd = [sys.executable, "-m", "eagle3d", "serve-sglang", "--python", str(SGLANG_PY)]
            cmd += ["--dump-dir", str(dump_dir)]
            cmd += ["--layers", ",".join(map(str, layers))] if layers else []
            cmd += ["--store-dtype", store_dtype] if store_dtype else []
            cmd += ["--", *user]
        self.cmd = cmd
        base = {k: v for k, v in os.environ.items() if k != "EAGLE3D_FAULT"}
        if threads is not None:
            base["OMP_NUM_THREADS"] = str(threads)
        self.env = {**base, **CPU_ENV, "EAGLE3D_SGL_KERNEL_TRAP": str(self.trap), **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def client_args(self) -> list[str]:
        """``eagle3d run``'s arguments for a job against this server and its dump area."""
        return ["--backend", "sglang", "--server", self.url, "--dump-dir", str(self.dump_dir)]

    def start(self, timeout: float = 240) -> Server:
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 240) -> None:
        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"SGLang exited ({self.proc.returncode}):\n{self.tail()}")
            return http(self.url + "/health", timeout=2)[0] == 200

        try:
            runkit.wait_for(ready, timeout, f"SGLang at {self.url}", step=0.5)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.tail()}") from None

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, n: int = 4000) -> str:
        lines = [ln for ln in self.text().splitlines() if "Ignore import error" not in ln]
        return "\n".join(lines)[-n:]

    def main_pids(self) -> list[int]:
        """The pids serve-sglang started SGLang's main process with, in order."""
        return [int(p) for p in re.findall(r"serve-sglang: started pid (\d+)", self.text())]

    def check_clean(self) -> None:
        """The sgl_kernel stand-in was never called nor asked for a name it lacks."""
        calls = self.trap.read_text() if self.trap.exists() else ""
        assert calls == "", f"the sgl_kernel stand-in was used:\n{calls}"
        assert "sgl_kernel stand-in called" not in self.text()

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM (serve-sglang stops SGLang in order); its exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()  # nothing may outlive a test

    def kill(self) -> None:
        """SIGKILL to the whole server: ours, and SGLang's own session under serve-sglang."""
        assert self.proc is not None
        for pgid in [self.proc.pid, *self.main_pids()]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        self.proc.wait(30)

    def pause(self, stopped: bool) -> None:
        """SIGSTOP / SIGCONT the SGLang processes (an idle SGLang scheduler polls a core)."""
        pgids = self.main_pids() or [self.proc.pid if self.proc else 0]
        for pgid in pgids[-1:]:
            os.killpg(pgid, signal.SIGSTOP if stopped else signal.SIGCONT)


def tiny_model(work: Path, layers: int = 10) -> Path:
    """The tiny Llama (hidden 64) these tests serve, built in ``work``."""
    from eagle3d.tools.tinymodel import build_tiny_model

    return Path(build_tiny_model(work / "model", layers=layers, hidden=64))


def sglang_args(dump_dir: Path, model: Path) -> list[str]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle3d",
            "sglang-args",
            "--dump-dir",
            str(dump_dir),
            "--model-path",
            str(model),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return shlex.split(out)


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A size-limited tmpfs at ``path`` (root only), unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


# --------------------------------------------------------------------------------------------
# datasets: multi-turn conversations with system prompts, several chunks long, and bad lines

WORDS = [
    "the",
    "model",
    "reads",
    "a",
    "long",
    "document",
    "about",
    "rivers",
    "and",
    "mountains",
    "then",
    "answers",
    "questions",
    "on",
    "weather",
    "history",
    "cooking",
    "music",
    "engines",
    "gardens",
    "stars",
    "numbers",
    "trains",
    "boats",
    "and",
    "birds",
]


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def conversations(n: int, seed: int = 0, long_every: int = 3) -> list[dict[str, Any]]:
    """``n`` conversations: 1-4 user/assistant turns, a system prompt in most, every
    ``long_every``-th one a few hundred tokens (several 64-token chunks)."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        msgs: list[dict[str, str]] = []
        if k % 4:
            msgs.append({"role": "system", "content": sentence(rng, rng.randint(3, 12))})
        words = 60 if k % long_every == 0 else 8
        for _ in range(rng.randint(1, 4)):
            msgs.append({"role": "user", "content": sentence(rng, rng.randint(2, words))})
            msgs.append({"role": "assistant", "content": sentence(rng, rng.randint(2, words))})
        out.append({"messages": msgs})
    return out


MALFORMED = [
    '{"messages": [{"role": "user", "content": "unterminated"',  # bad JSON
    json.dumps({"messages": [{"role": "narrator", "content": "an unknown role"}]}),
    json.dumps({"messages": []}),  # no turns
    json.dumps({"text": "no messages key"}),
]


def write_dataset(
    path: Path, convs: list[dict[str, Any]], bad_every: int = 0
) -> tuple[set[int], set[int]]:
    """The conversations as JSONL, a malformed line after every ``bad_every``-th one;
    returns (valid line ids, malformed line ids)."""
    lines: list[str] = []
    bad: set[int] = set()
    for k, c in enumerate(convs):
        lines.append(json.dumps(c))
        if bad_every and k % bad_every == bad_every - 1:
            bad.add(len(lines))
            lines.append(MALFORMED[len(bad) % len(MALFORMED)])
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return set(range(len(lines))) - bad, bad


def template_encoding(tok: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Ids and loss mask of one conversation written down from the tiny model's chat template
    (``<|bos|>`` then ``<|role|>content<|end|>`` per turn; the assistant's content and its
    ``<|end|>`` are trained on), independently of ``eagle3d.ingest.chat``. The role tokens are
    special tokens, so each content is tokenized on its own; the ids are also checked against
    the tokenizer's own ``apply_chat_template``."""
    ids = [tok.convert_tokens_to_ids("<|bos|>")]
    mask = [0]
    end = tok.convert_tokens_to_ids("<|end|>")
    for m in messages:
        body = tok.encode(m["content"], add_special_tokens=False)
        train = 1 if m["role"] == "assistant" else 0
        ids += [tok.convert_tokens_to_ids(f"<|{m['role']}|>"), *body, end]
        mask += [0] + [train] * (len(body) + 1)
    templ = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    templ = templ["input_ids"] if isinstance(templ, dict) or hasattr(templ, "keys") else templ
    assert list(templ) == ids, "the chat template and the hand-written encoding disagree"
    return ids, mask


def compare_with_hf(
    out: Path,
    model_dir: Path,
    convs: dict[int, dict[str, Any]],
    *,
    dtype: str = "float32",
    layers: list[int] | None = None,
) -> dict[str, float]:
    """Every saved sample: ids and loss mask equal :func:`template_encoding`; states equal an
    independent Hugging Face forward of the same weights. Returns the worst relative errors
    (``||got - want|| / ||want||`` per sample) of the aux and the final states."""
    import torch
    from eagle3proto import paths
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n = model.config.num_hidden_layers
    layers = layers or [2, n // 2, n - 3]
    worst = {"aux": 0.0, "final": 0.0}
    for idx, conv in sorted(convs.items()):
        d = torch.load(out / paths.sample_relpath(idx), weights_only=True)
        ids, mask = template_encoding(tok, conv["messages"])
        assert d["input_ids"].tolist() == ids, idx
        assert d["loss_mask"].tolist() == mask, idx
        with torch.no_grad():
            hs = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        want_aux = torch.cat([hs[i] for i in layers], -1)
        for key, got, want in (
            ("aux", d["aux_hidden_state"], want_aux),
            ("final", d["hidden_state"], hs[-1]),
        ):
            assert str(got.dtype) == f"torch.{dtype}", (idx, got.dtype)
            assert got.shape == want.shape, (idx, key, got.shape, want.shape)
            err = float((got.float() - want).norm() / want.norm())
            worst[key] = max(worst[key], err)
    return worst


def records(out: Path, kind: str | None = None) -> list[dict[str, Any]]:
    return runkit.records(out, kind)


def wait_log(path: Path, needle: str, timeout: float) -> None:
    runkit.wait_for(
        lambda: path.exists() and needle in path.read_text(errors="replace"),
        timeout,
        f"{needle!r} in {path}",
        step=0.2,
    )
