"""An import-only stand-in for ``sgl_kernel``, installed as ``sgl_kernel`` into ``.venv-sglang``.

Why it exists: on the CPU path (``SGLANG_USE_CPU_ENGINE=1 --device cpu``, no AMX, so every
layer runs its ``forward_native``) SGLang 0.5.21 *imports* exactly the seven names below from
``sgl_kernel`` and calls none of them. The real CPU kernel is not on the package registry (only
CUDA wheels of ``sglang-kernel``), takes ~25 min to build from the upstream tree, and targets
AVX-512/AMX (an illegal instruction on an AVX2-only processor). So the test environment gets
this package instead (``scripts/sglang_env`` copies this file to ``sgl_kernel/__init__.py``).

Rules, so that it can never hide a real dependency:

* any other name is an ImportError (``from sgl_kernel import other`` fails at import), so an
  SGLang that needs more shows up at once; the lookup is also recorded (below), in case the
  caller catches the ImportError and quietly takes another path;
* calling one of the seven raises and says so on stderr;
* when ``EAGLE3D_SGL_KERNEL_TRAP`` names a file, each call appends ``called <name> <pid>`` and
  each lookup of another name ``missing <name> <pid>`` to it: the real-server tests fail on
  any line there.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

__version__ = "0.0.0+eagle3d-import-only-standin"

NAMES = (
    "copy_all_layer_kv_cache_cpu",  # sglang/kernels/ops/kvcache/cache_move.py
    "assign_req_to_token_pool_cpu",  # sglang/srt/mem_cache/allocation.py
    # speculative decoding only:
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
)


def _record(what: str, name: str) -> None:
    trap = os.environ.get("EAGLE3D_SGL_KERNEL_TRAP")
    if trap:
        with open(trap, "a", encoding="utf-8") as f:
            f.write(f"{what} {name} {os.getpid()}\n")


class StandinCalled(RuntimeError):
    """A kernel of the import-only stand-in was called: the test environment lacks it."""


def _trap(name: str) -> Any:
    def kernel(*_args: Any, **_kwargs: Any) -> NoReturn:
        msg = (
            f"sgl_kernel stand-in called: {name}() (pid {os.getpid()}); this SGLang code path "
            "needs the real CPU sgl_kernel, which the eagle3d test environment does not have"
        )
        print(msg, file=sys.stderr, flush=True)
        _record("called", name)
        raise StandinCalled(msg)

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


for _name in NAMES:
    globals()[_name] = _trap(_name)

__all__ = list(NAMES)


def __getattr__(name: str) -> NoReturn:
    # `from sgl_kernel import x` turns this AttributeError into an ImportError.
    if not name.startswith("__"):  # the import system probes dunders such as __path__
        _record("missing", name)
    raise AttributeError(
        f"sgl_kernel stand-in (eagle3d test environment) has no {name!r}: it provides only "
        f"{list(NAMES)}. This SGLang needs more of the real kernel; see scripts/sglang_env."
    )
