"""What the capture hook checks at load time, so that a server that does not fit is refused
with a message naming what was expected, not met with wrong states later: SGLang's hooks API,
its ranks, its prefill CUDA graphs, its ForwardBatch, and the model's EAGLE-3 capture."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

# What the hook needs from ForwardBatch (sglang/srt/model_executor/forward_batch_info.py).
FORWARD_BATCH_FIELDS = (
    "forward_mode",
    "input_ids",
    "rids",
    "extend_seq_lens",
    "extend_start_loc",
    "extend_prefix_lens",
    "extend_seq_lens_cpu",
    "extend_prefix_lens_cpu",
)


class HookLoadError(RuntimeError):
    """The server is not set up the way the hook needs; the message says what was expected."""


# The forward side.


@dataclass(slots=True)
class Ranks:
    tp_rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    attn_dp_size: int = 1
    attn_cp_size: int = 1


def sglang_ranks() -> Ranks:
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:  # not inside an SGLang worker: a single process
        return Ranks()

    p = get_parallel()
    return Ranks(p.tp_rank, p.tp_size, p.pp_size, p.attn_dp_size, p.attn_cp_size)


def prefill_graph_backend() -> str | None:
    """The resolved prefill CUDA-graph backend of this server, or None when not published."""
    try:
        from sglang.srt.runtime_context import get_exec

        return str(get_exec().graph.cuda_graph_config.prefill.backend)
    except (ImportError, ValueError, RuntimeError, AttributeError):
        return None


def radix_cache_on() -> bool | None:
    """Whether this server's radix (prefix) cache is on, or None when not published."""
    try:
        from sglang.srt.runtime_context import get_memory

        return not bool(get_memory().disable_radix_cache)
    except (ImportError, ValueError, RuntimeError, AttributeError):
        return None


#: The hooks API the hook is written for (sglang 0.5.21, unchanged in 0.5.22 and 0.5.23).
HOOKS_API = (
    "register_forward_hooks(model, hook_specs) calling hook_factory(config) and "
    "module.register_forward_hook(hook) (post-forward hooks, no kwargs), with the locals "
    "model, name_to_module and spec"
)
#: Names whose appearance in register_forward_hooks means a newer hooks API (pre-hooks,
#: kwargs hooks) that calls hooks differently.
_NEWER_HOOKS_API = ("hook_type", "with_kwargs", "forward_pre", "register_forward_pre_hook")


def sglang_version() -> str:
    try:
        import sglang

        return str(getattr(sglang, "__version__", "?"))
    except ImportError:
        return "?"


def hooks_api_problem(register: Any) -> str | None:
    """What in SGLang's ``register_forward_hooks`` differs from :data:`HOOKS_API`, or None.

    Read from its code object: its parameters, the locals the hook reads from its frame, the
    method it registers with, and no trace of a newer API's hook types.
    """
    code = getattr(register, "__code__", None)
    if code is None:
        return "is not a Python function"
    params = code.co_varnames[: code.co_argcount]
    if tuple(params) != ("model", "hook_specs"):
        return f"takes {params}, not (model, hook_specs)"
    missing = [n for n in ("model", "name_to_module", "spec") if n not in code.co_varnames]
    if missing:
        return f"has no local {missing[0]!r} (the hook reads the model being hooked from it)"
    seen: set[str] = set()
    todo = [code]
    while todo:
        c = todo.pop()
        seen.update(c.co_names)
        seen.update(x for x in c.co_consts if isinstance(x, str))
        todo.extend(x for x in c.co_consts if hasattr(x, "co_names"))
    newer = [n for n in _NEWER_HOOKS_API if n in seen]
    if newer:
        return f"uses {newer} (a newer hooks API)"
    if "register_forward_hook" not in seen:
        return "does not call module.register_forward_hook"
    return None


def check_hooks_api() -> None:
    try:
        from sglang.srt.model_executor.hook_manager import register_forward_hooks
    except ImportError:
        return  # not inside SGLang (tests drive the hook with a stand-in)
    problem = hooks_api_problem(register_forward_hooks)
    if problem:
        raise HookLoadError(
            f"eagle3d hook: sglang {sglang_version()}'s register_forward_hooks {problem}; "
            f"the hook expects {HOOKS_API} (sglang 0.5.21 to 0.5.23)"
        )


def registration_context() -> tuple[Any, dict[str, Any], list[str]] | None:
    """(model, name_to_module, target patterns) from SGLang's ``register_forward_hooks`` frame.

    SGLang 0.5.21 passes the factory only its config; the model being hooked is a local of the
    caller. Reading it lets the hook fail at load time, not at the first request. The
    conformance test pins these local names to the installed SGLang.
    """
    frame = inspect.currentframe()
    try:
        f = frame.f_back if frame else None
        while f is not None:
            loc = f.f_locals
            if f.f_code.co_name == "register_forward_hooks" and "name_to_module" in loc:
                spec = loc.get("spec") or {}
                return loc["model"], loc["name_to_module"], list(spec.get("target_modules") or [])
            f = f.f_back
        return None
    finally:
        del frame


def check_forward_batch_class() -> None:
    try:
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    except ImportError:
        return  # not inside SGLang (tests drive the hook with a stand-in)
    import dataclasses

    names = {f.name for f in dataclasses.fields(ForwardBatch)}
    missing = [n for n in FORWARD_BATCH_FIELDS if n not in names]
    if missing:
        raise HookLoadError(
            f"eagle3d hook: sglang ForwardBatch lacks fields {missing}; expected "
            f"{list(FORWARD_BATCH_FIELDS)} (sglang {sglang_version()}; checked against 0.5.21 "
            "to 0.5.23)"
        )


def enable_capture(model: Any, aux_layers: list[int] | None) -> tuple[str, Any, list[int]]:
    """Turn on SGLang's own EAGLE-3 aux capture; return (name, module) of the capturing model."""
    if not hasattr(model, "set_eagle3_layers_to_capture"):
        raise HookLoadError(
            f"eagle3d hook: {type(model).__name__} has no set_eagle3_layers_to_capture(); "
            "the hook needs a model class SGLang can serve as an EAGLE-3 target "
            "(Llama, Qwen2/3, DeepSeek-V2/V3, Kimi-K2.5, ...)"
        )
    already = [n for n, m in model.named_modules() if getattr(m, "layers_to_capture", None)]
    if already:
        raise HookLoadError(
            f"eagle3d hook: {already[0]} already captures aux states (speculative decoding "
            "configured?); run the extraction server without a draft model"
        )
    model.set_eagle3_layers_to_capture(None)
    inner = [(n, m) for n, m in model.named_modules() if getattr(m, "layers_to_capture", None)]
    if len(inner) != 1:
        raise HookLoadError(
            "eagle3d hook: expected exactly one module with a non-empty layers_to_capture after "
            f"set_eagle3_layers_to_capture(); found {[n for n, _ in inner]}"
        )
    name, module = inner[0]
    default = [int(i) for i in module.layers_to_capture]  # [2, L//2, L-3], maybe with repeats
    layers = default if aux_layers is None else [int(i) for i in aux_layers]
    num = getattr(module, "end_layer", None) or len(getattr(module, "layers", []))
    if not layers or any(not 0 < i < num for i in layers):
        raise HookLoadError(
            f"eagle3d hook: aux layers {layers} must be layer ids in 1..{num - 1} "
            "(the state entering layer i; 0, the embeddings, is not capturable here)"
        )
    # The model captures each distinct layer once, in loop order; the writer re-expands them
    # into the requested order (repeats included, as Hugging Face's hidden_states[i] would).
    module.layers_to_capture = sorted(set(layers))
    return name, module, layers
