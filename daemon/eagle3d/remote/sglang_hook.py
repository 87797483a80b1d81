"""The capture hook loaded into a stock SGLang server (``--forward-hooks``), and the rid tie.

SGLang 0.5.21 resolves ``"hook_factory": "eagle3d.remote.sglang_hook:make_hook"`` inside every
scheduler/TP worker process, calls ``make_hook(config)`` once per spec and registers the
returned callable with ``module.register_forward_hook`` on every module whose name matches the
spec's ``target_modules`` (``sglang/srt/model_executor/hook_manager.py``). That happens after
CUDA-graph capture, so hooks fire on eager forwards only (the launcher disables the prefill
CUDA graph; decode graphs are irrelevant: we ask for one output token).

How the states are obtained. Decoder-layer calling conventions differ between model families
in 0.5.21 (Llama/Qwen2 pass ``(hidden, residual)`` pairs between layers; Qwen3 and DeepSeek keep
the residual in a per-batch residual stream and capture inside the layer boundary, with TP
reductions that may be deferred into the next layer). Rebuilding "hidden + residual" from
layer outputs would be right for some and silently wrong for others. So the hook switches on
SGLang's *own* EAGLE-3 capture -- ``set_eagle3_layers_to_capture`` on the model, then
``layers_to_capture`` set to our aux layers (the model appends the residual-stream state
*entering* each listed layer) -- and reads, from a post-hook on the inner model module
(``model`` for Llama/Qwen/DeepSeek, ``language_model.model`` for Kimi-K2.5), its output
``(final post-norm hidden [N, H], aux states)``. The forward batch is the inner model's third
positional argument in all of them.

The tie between a dump and the daemon's request is :mod:`eagle3d.remote.sglang_rid`; the
writer, :mod:`eagle3d.remote.sglang_writer`; the load-time checks,
:mod:`eagle3d.remote.sglang_checks`.

Only TP rank 0 writes; the forward thread does only a device->host copy into pinned memory and
hands it to one background writer thread through a bounded queue (a full queue blocks the
forward: back-pressure, never data loss). Pipeline parallelism, attention data/context
parallelism are refused at load time (the aux states of other stages/ranks are not here).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from typing import Any

from eagle3d.remote.sglang_checks import (
    HOOKS_API,
    HookLoadError,
    Ranks,
    check_forward_batch_class,
    check_hooks_api,
    enable_capture,
    prefill_graph_backend,
    radix_cache_on,
    registration_context,
    sglang_ranks,
    sglang_version,
)
from eagle3d.remote.sglang_rid import FACTORY, Tag, parse_sglang_rid
from eagle3d.remote.sglang_writer import Batch, DumpAssembler, Segment, Writer

log = logging.getLogger("eagle3d.remote.sglang_hook")

# Module names the launcher targets: the inner model of Llama/Qwen/DeepSeek (``model``) and of
# wrappers such as KimiK25ForConditionalGeneration (``language_model.model``).
TARGET_MODULES = ["model", "*.model"]
_EXTEND_MODES = ("EXTEND", "MIXED")


class Capture:
    """Per-process state shared by the hook: which module, which layers, the writer."""

    def __init__(
        self,
        dump_dir: str,
        layers: list[int],
        inner: Any,
        name: str,
        rank: Ranks,
        max_pending: int,
        store: Any = None,
    ):
        self.dump_dir = dump_dir
        self.store = store  # a StoreFormat: states stored so on the device; None: as computed
        self.layers = layers
        self.captured = sorted(set(layers))
        self.order = [self.captured.index(i) for i in layers]
        self.inner = inner
        self.name = name
        self.writes = rank.tp_rank == 0
        self.assembler = DumpAssembler(dump_dir, layers, radix_cache=radix_cache_on())
        self.modes: Counter[str] = Counter()  # captured forwards by mode
        self.writer = Writer(self.assembler, max_pending, self._describe) if self.writes else None
        self.forwards = 0
        self.most_requests = 0  # of ours in one forward
        self.chunk_beside_new = 0  # forwards packing a continued chunk with a new request

    def _describe(self) -> str:
        modes = ", ".join(f"{m} {n}" for m, n in sorted(self.modes.items())) or "none"
        return (
            f"forwards {modes}; at most {self.most_requests} of our requests in one, "
            f"{self.chunk_beside_new} with a continued chunk beside a new request"
        )

    def __call__(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        if module is not self.inner:
            return None  # a broad target pattern also matched some other module
        fb = args[2] if len(args) > 2 else None
        mode = getattr(getattr(fb, "forward_mode", None), "name", None)
        if mode is None:
            raise HookLoadError(
                f"eagle3d hook: {self.name}.forward's third positional argument is not a "
                f"ForwardBatch (got {type(fb).__name__}); expected forward(input_ids, positions, "
                "forward_batch, ...) as in sglang 0.5.21"
            )
        if mode not in _EXTEND_MODES:
            return None
        if not (isinstance(output, tuple) and len(output) == 2):
            raise HookLoadError(
                f"eagle3d hook: {self.name} returned {type(output).__name__}, expected "
                "(hidden_states, aux_hidden_states): SGLang's aux capture is not active"
            )
        hidden, aux = output
        if isinstance(aux, list | tuple):
            if len(aux) != len(self.captured):
                raise HookLoadError(
                    f"eagle3d hook: {self.name} captured {len(aux)} aux states, expected "
                    f"{len(self.captured)} (layers {self.captured}); two-batch overlap or "
                    "pipeline parallelism skip the capture"
                )
        elif getattr(aux, "shape", (0,))[-1] != len(self.captured) * hidden.shape[-1]:
            raise HookLoadError(
                f"eagle3d hook: {self.name} returned packed aux states of shape "
                f"{tuple(aux.shape)}, expected [N, {len(self.captured)} * {hidden.shape[-1]}]"
            )
        self.forwards += 1
        self.modes[mode] += 1
        if self.writer is None:
            return None
        segments = self._segments(fb)
        if segments:
            self.most_requests = max(self.most_requests, len(segments))
            starts = {p == 0 for _, p, _, _ in segments}
            self.chunk_beside_new += starts == {True, False}
            self.writer.put(self._to_host(fb, hidden, aux, segments))
        return None

    def _segments(self, fb: Any) -> list[tuple[Tag, int, int, int]]:
        rids = list(fb.rids or [])
        tags = [parse_sglang_rid(r) for r in rids]
        if not any(tags):
            return []  # warm-up, health checks, other users: nothing to copy
        lens = fb.extend_seq_lens_cpu
        prefixes = fb.extend_prefix_lens_cpu
        if lens is None:
            lens = fb.extend_seq_lens.tolist()
        if prefixes is None:
            prefixes = fb.extend_prefix_lens.tolist()
        if not len(rids) == len(lens) == len(prefixes):
            raise HookLoadError(
                f"eagle3d hook: forward batch has {len(rids)} rids, {len(lens)} extend lengths "
                f"and {len(prefixes)} prefix lengths; expected one of each per request"
            )
        out = []
        start = 0
        for tag, n, p in zip(tags, lens, prefixes, strict=True):
            # A segment starting at or past the prompt's end is one of our requests decoding
            # (a MIXED forward, with the overlap scheduler even after its one token): its
            # prompt's states are already captured.
            if tag is not None and int(p) < tag.length:
                out.append((tag, int(p), start, int(n)))
            start += int(n)  # tokens are laid out request after request
        return out

    def _to_host(
        self, fb: Any, hidden: Any, aux: Any, segs: list[tuple[Tag, int, int, int]]
    ) -> Batch:
        import torch

        total = segs[-1][2] + segs[-1][3]
        contiguous = sum(s[3] for s in segs) == total and segs[0][2] == 0
        if contiguous:
            rows: Any = slice(0, total)
        else:  # foreign requests in the batch: copy only ours
            rows = torch.cat([torch.arange(o, o + n) for _, _, o, n in segs]).to(hidden.device)
        parts = (
            list(aux)
            if not isinstance(aux, torch.Tensor)
            else list(aux.chunk(len(self.captured), dim=-1))
        )
        aux_t = torch.cat([parts[k] for k in self.order], dim=-1)
        from eagle3d.remote.storedtype import to_stored_checked

        hid_t = hidden[rows]
        # In the stored format where the states are (fewer bytes over PCIe and in the
        # dump), and checked finite there as stored, so that the writer never passes over
        # them on the host (a NaN sends the dump the daemon's checks, which word it).
        (aux_q, aux_s, ok_a), (hid_q, hid_s, ok_h) = (
            to_stored_checked(x, self.store) for x in (aux_t[rows], hid_t)
        )
        scales = [x for x in (aux_s, hid_s) if x is not None]
        picked = [fb.input_ids[rows], aux_q, hid_q, ok_a & ok_h, *scales]
        # Which of them are views of the model's own storage, which it may reuse after the
        # hook returns: a slice of ids or hidden kept as computed. Indexing with a tensor,
        # the cat of the aux states and a cast made new tensors already (on CPU, a second
        # copy would be wasted).
        borrowed = [contiguous, False, contiguous and hid_q is hid_t, False]
        borrowed += [False] * len(scales)
        cuda = hidden.is_cuda
        host = []
        for t, view in zip(picked, borrowed, strict=True):
            if cuda:
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
            else:
                h = t.clone() if view else t
            host.append(h)
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record()
        segments = []
        off = 0
        for tag, p, _, n in segs:
            segments.append(Segment(tag, p, off, n))
            off += n
        ids, aux_h, hid_h, ok, *scaled = host
        return Batch(segments, ids, aux_h, hid_h, ready, ok, *scaled)


def make_hook(config: dict[str, Any], *, model: Any = None, ranks: Ranks | None = None) -> Capture:
    """SGLang hook factory (``--forward-hooks`` spec ``hook_factory``).

    ``config``: ``dump_dir`` (required), ``aux_layers`` (list of layer ids, default the
    model's EAGLE-3 default ``[2, L//2, L-3]``), ``max_pending`` (queued forwards, default 4),
    ``store_dtype`` (the job's storage dtype, :mod:`eagle3d.remote.storedtype`; default: as computed).
    ``model``/``ranks`` are for callers other than SGLang's hook manager (tests).
    Raises :class:`HookLoadError` naming what it expected when the server does not fit.
    """
    dump_dir = config.get("dump_dir")
    if not dump_dir:
        raise HookLoadError("eagle3d hook: config needs 'dump_dir'")
    aux_layers = config.get("aux_layers")
    store = None
    if config.get("store_dtype"):
        from eagle3d.remote.storedtype import get

        try:
            store = get(str(config["store_dtype"]))
        except ValueError as e:
            raise HookLoadError(f"eagle3d hook: {e}") from None
    patterns: list[str] = []
    names: dict[str, Any] = {}
    if model is None:
        check_hooks_api()
        ctx = registration_context()
        if ctx is None:
            raise HookLoadError(
                f"eagle3d hook: make_hook must be called by SGLang's register_forward_hooks "
                f"(sglang/srt/model_executor/hook_manager.py; this is sglang "
                f"{sglang_version()}, the hook expects {HOOKS_API}) or given model="
            )
        model, names, patterns = ctx
    rank = ranks or sglang_ranks()
    if rank.pp_size > 1 or rank.attn_dp_size > 1 or rank.attn_cp_size > 1:
        raise HookLoadError(
            f"eagle3d hook: pp_size={rank.pp_size}, attn_dp_size={rank.attn_dp_size}, "
            f"attn_cp_size={rank.attn_cp_size}; the hook supports tensor parallelism only "
            "(each must be 1: no --pp-size, --enable-dp-attention, --attn-cp-size)"
        )
    backend = prefill_graph_backend()
    if backend is not None and backend != "disabled":
        raise HookLoadError(
            f"eagle3d hook: the prefill CUDA graph backend is {backend!r}; replayed graphs never "
            "call hooks. Start SGLang with --disable-prefill-cuda-graph"
        )
    check_forward_batch_class()
    name, inner, layers = enable_capture(model, aux_layers)
    if names:
        import fnmatch

        matched = [n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)]
        if name not in matched:
            raise HookLoadError(
                f"eagle3d hook: target_modules {patterns} match {matched[:8]}, which does not "
                f"include the capturing model module {name!r}; expected target_modules "
                f"{TARGET_MODULES} to reach it"
            )
    os.makedirs(dump_dir, exist_ok=True)
    cap = Capture(dump_dir, layers, inner, name, rank, int(config.get("max_pending", 4)), store)
    log.info(
        "eagle3d hook: capturing layers %s + final norm from %s on tp rank %d/%d, %s",
        layers,
        name,
        rank.tp_rank,
        rank.tp_size,
        f"dumps to {dump_dir}" if cap.writes else "not writing (tp rank != 0)",
    )
    return cap


def hook_spec(
    dump_dir: str,
    aux_layers: list[int] | None = None,
    max_pending: int = 4,
    store_dtype: str | None = None,
) -> dict[str, Any]:
    """The ``--forward-hooks`` entry for the hook (the launcher serialises a list of these)."""
    config: dict[str, Any] = {"dump_dir": dump_dir, "max_pending": max_pending}
    if aux_layers is not None:
        config["aux_layers"] = list(aux_layers)
    if store_dtype:
        config["store_dtype"] = store_dtype
    return {
        "name": "eagle3d-capture",
        "target_modules": list(TARGET_MODULES),
        "hook_factory": FACTORY,
        "config": config,
    }
