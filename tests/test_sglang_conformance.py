"""Conformance of the launcher, the hook and the client with the real SGLang packages.

Runs only inside ``.venv-sglang`` (``scripts/sglang_env``), once per release of the version
matrix (docs/sglang.md): 0.5.21, installed there, and the installed sources of 0.5.22 and
0.5.23 put first on the path (both pin torch 2.14.1, which cannot run here, so their Python
runs on 0.5.21's dependencies)::

    .venv-sglang/bin/python -m pytest tests/test_sglang_conformance.py
    PYTHONPATH=.venv-sglang/sglang-src/0.5.23 EAGLE3D_SGLANG_VERSION=0.5.23 \
        .venv-sglang/bin/python -m pytest tests/test_sglang_conformance.py

SGLang's model, forward-batch and io modules are checked from their source with ``ast`` (they
import CUDA-only kernels at module level); everything that imports (ServerArgs, the hook manager,
the runtime context, the environment flags, the CUDA-graph config) is used for real.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sglang = pytest.importorskip(
    "sglang",
    reason="needs the real SGLang package: run scripts/sglang_env, then "
    ".venv-sglang/bin/python -m pytest tests/test_sglang_conformance.py",
)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

import sglang_standin as st  # noqa: E402
from eagle3d import sglang_hook as sh  # noqa: E402
from eagle3d.dump import read_dump  # noqa: E402
from eagle3d.sglang_launch import CONFLICTS, FIXED_ARGS, HEALTH_ENV, extra_args  # noqa: E402

MATRIX = ("0.5.21", "0.5.22", "0.5.23")
VERSION = os.environ.get("EAGLE3D_SGLANG_VERSION", "0.5.21")
SRC = Path(sglang.__file__).parent / "srt"


def test_the_version_under_test() -> None:
    assert VERSION in MATRIX and sglang.__version__ == VERSION, (
        sglang.__version__,
        sglang.__file__,
    )


# ---------------------------------------------------------------------------------------------
# ServerArgs


def parse(argv: list[str]) -> Any:
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(argv)


def test_server_args_accept_exactly_the_launcher_arguments(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    extra = extra_args(str(tmp_path), [1, 2, 3], max_pending=6)
    sa = parse(["--model-path", str(tiny_model_dir), "--tp", "8", *extra])
    assert sa.forward_hooks == [sh.hook_spec(str(tmp_path), [1, 2, 3], 6)]
    assert sa.disable_radix_cache is True
    assert sa.disable_prefill_cuda_graph is True
    assert sa.enable_metrics is True
    assert sa.tp_size == 8
    base = parse(["--model-path", str(tiny_model_dir)])  # each flag changes what it should
    assert (
        base.forward_hooks,
        base.disable_radix_cache,
        base.disable_prefill_cuda_graph,
        base.enable_metrics,
    ) == (None, False, False, False)
    assert set(FIXED_ARGS) <= set(extra)


def test_a_flag_sglang_does_not_know_is_rejected(tiny_model_dir: Path) -> None:
    with pytest.raises(SystemExit):  # so the test above would catch a renamed flag
        parse(["--model-path", str(tiny_model_dir), "--disable-prefill-cuda-graphs"])


def test_conflicting_flags_the_launcher_refuses_are_real_sglang_flags(tiny_model_dir: Path) -> None:
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    known = set(parser._option_string_actions)
    missing = [f for f in CONFLICTS if f not in known]
    assert missing == [], f"launcher refuses flags SGLang {VERSION} does not have: {missing}"


def test_prefill_graph_flag_resolves_to_the_backend_the_hook_checks() -> None:
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, PhaseConfig

    assert Backend.DISABLED == "disabled" and Phase.PREFILL == "prefill"
    assert "backend" in {f.name for f in dataclasses.fields(PhaseConfig)}
    src = (SRC / "arg_groups" / "cuda_graph_hook.py").read_text()
    assert (
        'if cfg.disable_prefill_cuda_graph:\n        _set(Phase.PREFILL, "backend", Backend.DISABLED)'
        in src
    )


def test_health_endpoint_without_generation() -> None:
    from sglang.srt.environ import envs

    (name,) = HEALTH_ENV
    assert hasattr(envs, name) and getattr(envs, name).get() is True  # default: /health generates
    http = (SRC / "entrypoints" / "http_server.py").read_text()
    assert (
        f'not envs.{name}.get()\n        and request.url.path == "/health"\n    ):\n        return Response(status_code=200)'
        in http
    )
    for route in ('@app.get("/server_info")', '@app.get("/get_server_info")', '"/generate"'):
        assert route in http
    metrics = (SRC / "observability" / "metrics_collector.py").read_text()
    for m in ("sglang:prompt_tokens_total", "sglang:num_running_reqs", "sglang:num_queue_reqs"):
        assert f'name="{m}"' in metrics


# ---------------------------------------------------------------------------------------------
# the hook manager


def test_hook_manager_resolves_our_factory_and_keeps_the_locals_we_read() -> None:
    from sglang.srt.model_executor import hook_manager

    assert hook_manager.resolve_callable(sh.FACTORY) is sh.make_hook
    names = hook_manager.register_forward_hooks.__code__.co_varnames
    assert {"model", "name_to_module", "spec"} <= set(names)


def test_the_hooks_api_is_the_shape_the_hook_expects() -> None:
    """What the hook checks at load (and refuses with a message naming the version)."""
    from sglang.srt.model_executor import hook_manager

    assert sh.hooks_api_problem(hook_manager.register_forward_hooks) is None
    # registered after CUDA-graph capture, from the observability config
    setup = (SRC / "model_executor" / "model_runner_components" / "cuda_graph_setup.py").read_text()
    assert "register_forward_hooks(model_runner.model, get_observability().forward_hooks)" in setup


def test_real_hook_manager_installs_the_hook_and_dumps_equal_hf(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from sglang.srt.model_executor.hook_manager import register_forward_hooks
    from sglang.srt.runtime_context import get_parallel

    model, hf = st.load_standin(str(tiny_model_dir))
    with get_parallel().override(tp_rank=0, tp_size=1, pp_size=1, attn_dp_size=1, attn_cp_size=1):
        register_forward_hooks(model, [sh.hook_spec(str(tmp_path))])
    (cap,) = [h for h in model.model._forward_hooks.values() if isinstance(h, sh.Capture)]
    g = torch.Generator().manual_seed(5)
    reqs = [
        (f"s{k}", torch.randint(3, 900, (n,), generator=g).tolist())
        for k, n in enumerate([7, 3, 19])
    ]
    st.Scheduler(model, chunk=8).run([(sh.sglang_rid(r, ids), ids) for r, ids in reqs])
    cap.writer.drain()  # type: ignore[union-attr]
    for rid, ids in reqs:
        d = read_dump(str(tmp_path / f"{rid}.e3dump"))
        with torch.no_grad():
            hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        torch.testing.assert_close(
            d.aux_hidden_state, torch.cat([hs[i][0] for i in cap.layers], -1), rtol=1e-4, atol=1e-5
        )
        torch.testing.assert_close(d.hidden_state, hs[-1][0], rtol=1e-4, atol=1e-5)


def test_real_hook_manager_surfaces_a_load_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    from sglang.srt.model_executor.hook_manager import register_forward_hooks
    from sglang.srt.runtime_context import get_parallel

    model, _ = st.load_standin(str(tiny_model_dir))
    with (
        get_parallel().override(tp_rank=0, tp_size=2, pp_size=2, attn_dp_size=1, attn_cp_size=1),
        pytest.raises(sh.HookLoadError, match="pp_size=2"),
    ):
        register_forward_hooks(model, [sh.hook_spec(str(tmp_path))])


# ---------------------------------------------------------------------------------------------
# model and forward-batch code of this version (read from source: these modules need CUDA deps)


def classes(path: Path) -> dict[str, ast.ClassDef]:
    tree = ast.parse(path.read_text())
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}


def method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    for n in cls.body:
        if isinstance(n, ast.FunctionDef) and n.name == name:
            return n
    raise AssertionError(f"{cls.name}.{name} not found")


def self_attr(node: ast.AST, attr: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == attr
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def test_forward_batch_fields_and_modes() -> None:
    cls = classes(SRC / "model_executor" / "forward_batch_info.py")
    fields = {
        n.target.id
        for n in cls["ForwardBatch"].body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    missing = [f for f in sh.FORWARD_BATCH_FIELDS if f not in fields]
    assert missing == [], f"ForwardBatch of sglang {VERSION} lacks {missing}"
    modes = {
        t.id
        for n in cls["ForwardMode"].body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    assert {"EXTEND", "MIXED", "DECODE"} <= modes


def test_generate_request_fields_the_client_sends() -> None:
    cls = classes(SRC / "managers" / "io_struct.py")["GenerateReqInput"]
    fields = {
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    assert {"input_ids", "sampling_params", "rid", "extra_key"} <= fields


MODELS = [
    ("llama.py", "LlamaForCausalLM", "LlamaModel"),
    ("qwen2.py", "Qwen2ForCausalLM", "Qwen2Model"),
    ("qwen3.py", "Qwen3ForCausalLM", "Qwen3Model"),
    ("deepseek_v2.py", "DeepseekV2ForCausalLM", "DeepseekV2Model"),
]


@pytest.mark.parametrize("file, outer, inner", MODELS, ids=[m[1] for m in MODELS])
def test_model_code_has_what_the_hook_relies_on(file: str, outer: str, inner: str) -> None:
    cls = classes(SRC / "models" / file)
    o = cls[outer]
    s = method(o, "set_eagle3_layers_to_capture")
    assigned = [t for n in ast.walk(s) if isinstance(n, ast.Assign) for t in n.targets]
    assert any(self_attr(t, "capture_aux_hidden_states") for t in assigned)
    assert any(
        isinstance(t, ast.Attribute)
        and t.attr == "layers_to_capture"
        and self_attr(t.value, "model")
        for t in assigned
    )
    # the inner model is the attribute `model` (named "model" in named_modules) ...
    assert any(
        self_attr(t, "model") for n in ast.walk(o) if isinstance(n, ast.Assign) for t in n.targets
    )
    # ... and is called with the forward batch as its third positional argument
    calls = [
        n
        for n in ast.walk(method(o, "forward"))
        if isinstance(n, ast.Call) and self_attr(n.func, "model")
    ]
    assert calls and all(
        len(c.args) >= 3 and isinstance(c.args[2], ast.Name) and c.args[2].id == "forward_batch"
        for c in calls
    )
    i = cls[inner]
    f = method(i, "forward")
    assert [a.arg for a in f.args.args[:4]] == ["self", "input_ids", "positions", "forward_batch"]
    # it appends the state entering layer i for i in layers_to_capture, and returns (hidden, aux)
    body = list(ast.walk(f))
    assert any(
        isinstance(n, ast.Compare)
        and isinstance(n.ops[0], ast.In)
        and self_attr(n.comparators[0], "layers_to_capture")
        for n in body
    )
    assert any(
        isinstance(n, ast.Tuple)
        and len(n.elts) == 2
        and ast.unparse(n.elts[0]) == "hidden_states"
        # a list of [N, H] states, or DeepSeek's packed [N, k*H] (aux_hidden_states.finalize())
        and ast.unparse(n.elts[1]).startswith("aux_hidden_states")
        for n in body
    )


def test_kimi_k25_delegates_to_a_deepseek_language_model() -> None:
    kimi = classes(SRC / "models" / "kimi_k25.py")["KimiK25ForConditionalGeneration"]
    src = ast.unparse(method(kimi, "set_eagle3_layers_to_capture"))
    assert "self.language_model.set_eagle3_layers_to_capture" in src
    assigns = [
        n
        for n in ast.walk(kimi)
        if isinstance(n, ast.Assign) and any(self_attr(t, "language_model") for t in n.targets)
    ]
    assert any(
        "DeepseekV3ForCausalLM" in ast.unparse(n.value) for n in assigns
    )  # -> "language_model.model"
    ds = classes(SRC / "models" / "deepseek_v2.py")["DeepseekV3ForCausalLM"]
    assert "DeepseekV2ForCausalLM" in [ast.unparse(b) for b in ds.bases]
    import fnmatch

    assert any(fnmatch.fnmatch("language_model.model", p) for p in sh.TARGET_MODULES)
