"""The capture hook loaded into a stock SGLang server (``--forward-hooks``), and the rid tie.

SGLang 0.5.21 resolves ``"hook_factory": "eagle3d.sglang_hook:make_hook"`` inside every
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

The tie between a dump and the daemon's request (unambiguous, both sides compute it): the
producer sends SGLang ``rid = "e3d.<send>.<T>.<digest>.<rid>"`` (see :func:`sglang_rid`), with
``T`` the number of ids and ``digest`` a BLAKE2b-64 of the ids as little-endian int64. The hook
only dumps requests with such a rid (warm-up and health-check requests are ignored), names the
dump after the daemon's ``rid``, knows from ``T`` when a chunked prefill is complete, and
refuses to write a dump whose ids do not hash to ``digest``.

Only TP rank 0 writes; the forward thread does only a device->host copy into pinned memory and
hands it to one background writer thread through a bounded queue (a full queue blocks the
forward: back-pressure, never data loss). Pipeline parallelism, attention data/context
parallelism are refused at load time (the aux states of other stages/ranks are not here).
"""

from __future__ import annotations

import array
import atexit
import errno
import hashlib
import inspect
import logging
import os
import queue
import re
import sys
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger("eagle3d.sglang_hook")

FACTORY = "eagle3d.sglang_hook:make_hook"
RID_PREFIX = "e3d"
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
# Module names the launcher targets: the inner model of Llama/Qwen/DeepSeek (``model``) and of
# wrappers such as KimiK25ForConditionalGeneration (``language_model.model``).
TARGET_MODULES = ["model", "*.model"]
_SAFE_RID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,199}$")
_EXTEND_MODES = ("EXTEND", "MIXED")


class HookLoadError(RuntimeError):
    """The server is not set up the way the hook needs; the message says what was expected."""


# --------------------------------------------------------------------------------------------
# The rid tie (imported by the producer too: no torch, no sglang here).


def ids_digest(ids: list[int]) -> str:
    """BLAKE2b-64 (hex) of the ids as little-endian int64."""
    a = array.array("q", ids)
    if sys.byteorder != "little":
        a.byteswap()
    return hashlib.blake2b(a.tobytes(), digest_size=8).hexdigest()


def sglang_rid(rid: str, ids: list[int], send: int = 1) -> str:
    """The SGLang request id for one send of the daemon request ``rid`` with these ids.

    ``send`` makes repeated sends of one request distinct (SGLang refuses a duplicate rid
    still in flight); the dump is named after ``rid`` whatever ``send`` is.
    """
    if not _SAFE_RID.match(rid):
        raise ValueError(f"request id {rid!r} is not usable as a dump file name")
    return f"{RID_PREFIX}.{send}.{len(ids)}.{ids_digest(ids)}.{rid}"


@dataclass(frozen=True, slots=True)
class Tag:
    """What :func:`parse_sglang_rid` recovers from an SGLang rid."""

    rid: str
    send: int
    length: int
    digest: str


def parse_sglang_rid(srid: object) -> Tag | None:
    """The tag of one of our requests, or None for any other request (warm-up, health, users)."""
    if not isinstance(srid, str) or not srid.startswith(RID_PREFIX + "."):
        return None
    parts = srid.split(".", 4)
    if len(parts) != 5:
        return None
    _, send, length, digest, rid = parts
    if not (send.isdigit() and length.isdigit() and len(digest) == 16 and _SAFE_RID.match(rid)):
        return None
    return Tag(rid, int(send), int(length), digest)


# --------------------------------------------------------------------------------------------
# Failure markers: how the hook tells the client *why* a dump it answered for is missing.
#
# A failed write leaves ``.<rid>.<REASON>.e3fail`` in the dump directory: an empty file (it
# needs an inode, no data block, so it can still be made on a full tmpfs) whose name carries the
# reason, an errno name such as ENOSPC, or LOST for a request whose states never reached the
# writer. The client (``eagle3d.producers.sglang``) turns it into a failure report naming that
# reason and removes it. The watcher ignores hidden names, so it is never taken for a dump.

FAIL_SUFFIX = ".e3fail"
_REASON = re.compile(r"^[A-Z][A-Z0-9_]{0,31}$")


def error_reason(e: BaseException) -> str:
    """ENOSPC, EACCES, ... for an OSError with an errno; the exception's class name otherwise."""
    if isinstance(e, OSError) and e.errno:
        return errno.errorcode.get(e.errno, f"E{e.errno}")
    return "ERROR"


def describe_error(e: BaseException) -> str:
    """``ENOSPC: No space left on device`` (the form the other producers report)."""
    if isinstance(e, OSError) and e.errno:
        return f"{error_reason(e)}: {e.strerror or e}"
    return f"{type(e).__name__}: {e}"


def failure_marker_name(rid: str, reason: str) -> str:
    if not _REASON.match(reason):
        reason = "ERROR"
    return f".{rid}.{reason}{FAIL_SUFFIX}"


def parse_failure_marker(name: str) -> tuple[str, str] | None:
    """(rid, reason) of a failure marker's file name, or None for any other name."""
    if not (name.startswith(".") and name.endswith(FAIL_SUFFIX)):
        return None
    rid, _, reason = name[1 : -len(FAIL_SUFFIX)].rpartition(".")
    if not (_SAFE_RID.match(rid) and _REASON.match(reason)):
        return None
    return rid, reason


# --------------------------------------------------------------------------------------------
# The writer side: host tensors in, dump files out (runs on the background thread).


@dataclass(slots=True)
class Segment:
    """One request's rows in a captured forward."""

    tag: Tag
    prefix: int  # tokens already in the KV cache before this forward
    offset: int  # first row in the host tensors
    length: int


@dataclass(slots=True)
class Batch:
    """One forward's capture, on its way to the writer."""

    segments: list[Segment]
    ids: torch.Tensor  # [n] int64, host
    aux: torch.Tensor  # [n, k*H], host
    hidden: torch.Tensor  # [n, H], host
    ready: Any = None  # a CUDA event to wait on, or None for host tensors


@dataclass(slots=True)
class _Partial:
    filled: int
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)


class DumpAssembler:
    """Turns segments into dumps; assembles chunked prefills; refuses partial states.

    Each request is handled on its own: a failure (a full dump area, say) loses that one dump,
    is logged with its errno and its request, and leaves a failure marker for the client; the
    other requests of the same forward, and other requests' unfinished chunked prefills, are
    untouched. Pure apart from the ``write`` callable (``eagle3d.dump.write_dump`` by default)
    and the markers, so it is tested directly.
    """

    def __init__(
        self,
        dump_dir: str,
        layers: list[int],
        *,
        write: Any = None,
        max_partials: int = 256,
        radix_cache: bool | None = None,
    ):
        from eagle3d.dump import write_dump

        self.dump_dir = dump_dir
        self.layers = list(layers)
        self.write = write or write_dump
        self.max_partials = max_partials
        # Whether the server's radix (prefix) cache is on, when known: with it off, cached
        # tokens at the start of a request can only be an earlier chunk this writer lost.
        self.radix_cache = radix_cache
        self.partials: OrderedDict[str, _Partial] = OrderedDict()
        # Requests whose unfinished chunked prefill was dropped, and why (bounded).
        self.lost: OrderedDict[str, str] = OrderedDict()
        self.written = 0
        self.refused = 0
        self.failed = 0

    def feed(self, batch: Batch) -> None:
        for s in batch.segments:
            sl = slice(s.offset, s.offset + s.length)
            try:
                self._feed_one(s, batch.ids[sl], batch.aux[sl], batch.hidden[sl])
            except Exception as e:  # one request's failure loses its dump, not the batch's
                self._fail(s.tag, e)

    def lose(self, batch: Batch, e: BaseException) -> None:
        """The whole batch never reached the assembler (its device copy failed, say)."""
        for s in batch.segments:
            self._fail(s.tag, e)

    def _key(self, tag: Tag) -> str:
        return f"{tag.send}.{tag.rid}"

    def _fail(self, tag: Tag, e: BaseException) -> None:
        self.failed += 1
        key = self._key(tag)
        if self.partials.pop(key, None) is not None:
            self._mark_lost(key, describe_error(e))
        log.error(
            "eagle3d: the dump of request %s (send %d) was lost: %s (in %s); the client is "
            "told and resends it",
            tag.rid,
            tag.send,
            describe_error(e),
            self.dump_dir,
            exc_info=not isinstance(e, OSError),
        )
        self._marker(tag.rid, error_reason(e))

    def _marker(self, rid: str, reason: str) -> None:
        try:
            fd = os.open(
                os.path.join(self.dump_dir, failure_marker_name(rid, reason)),
                os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC,
                0o644,
            )
            os.close(fd)
        except OSError as e:  # the client still finds the dump missing after its grace
            log.error("eagle3d: could not leave a failure marker for %s: %s", rid, e)

    def _mark_lost(self, key: str, why: str) -> None:
        self.lost[key] = why
        while len(self.lost) > 4 * self.max_partials:
            self.lost.popitem(last=False)

    def _feed_one(
        self, s: Segment, ids: torch.Tensor, aux: torch.Tensor, hid: torch.Tensor
    ) -> None:
        key = self._key(s.tag)
        if s.prefix == 0:
            self.partials.pop(key, None)
            self.lost.pop(key, None)
            part = _Partial(0)
        else:
            found = self.partials.pop(key, None)
            if found is None or found.filled != s.prefix:
                self._refuse_cached(s, key, found)
                return
            part = found
        part.parts.append((ids, aux, hid))
        part.filled += s.length
        if part.filled < s.tag.length:  # chunked prefill: wait for the remaining chunks
            self.partials[key] = part
            while len(self.partials) > self.max_partials:
                old, _ = self.partials.popitem(last=False)
                self._mark_lost(old, f"more than {self.max_partials} unfinished chunked prefills")
                log.error("eagle3d: dropped the unfinished chunked prefill of %s", old)
            return
        self._finish(s.tag, part)

    def _refuse_cached(self, s: Segment, key: str, found: _Partial | None) -> None:
        """A forward of ``s`` starting at token ``s.prefix`` whose earlier tokens we lack."""
        self.refused += 1
        lost = self.lost.pop(key, None)
        if lost is not None or found is not None or self.radix_cache is False:
            if lost is not None:
                why = f"its earlier chunk(s) were dropped: {lost}"
            elif found is not None:
                why = (
                    f"its earlier chunks cover {found.filled} tokens, this one starts at {s.prefix}"
                )
            else:
                why = "its earlier chunk(s) never reached the writer (the radix cache is off)"
            log.error(
                "eagle3d: lost chunk of request %s (chunk at token %d of %d): %s; no dump "
                "written, the client resends it",
                s.tag.rid,
                s.prefix,
                s.tag.length,
                why,
            )
            self._marker(s.tag.rid, "LOST")
            return
        log.error(
            "eagle3d: request %s arrived with %d tokens already cached (a prefix cache hit): "
            "its states for those tokens were not computed, no dump written. Run SGLang with "
            "--disable-radix-cache.",
            s.tag.rid,
            s.prefix,
        )

    def _finish(self, tag: Tag, part: _Partial) -> None:
        import torch

        ids, aux, hid = (
            torch.cat(t) if len(t) > 1 else t[0] for t in zip(*part.parts, strict=True)
        )
        got = ids_digest(ids.tolist())
        if part.filled != tag.length or got != tag.digest:
            self.refused += 1
            log.error(
                "eagle3d: request %s ran %d ids hashing to %s; the client sent %d ids hashing "
                "to %s: no dump written",
                tag.rid,
                part.filled,
                got,
                tag.length,
                tag.digest,
            )
            return
        from eagle3d import faults

        if faults.hit("hook_drop") is not None:
            log.warning("eagle3d: EAGLE3D_FAULT hook_drop: the dump of %s is dropped", tag.rid)
            return
        self.write(self.dump_dir, tag.rid, ids, aux, hid, self.layers)
        self.written += 1


class Writer:
    """One background thread draining a bounded queue of :class:`Batch` into an assembler."""

    def __init__(
        self, assembler: DumpAssembler, max_pending: int = 4, describe: Any = None
    ) -> None:
        self.assembler = assembler
        self.describe = describe  # () -> str: more for the closing log line
        self.queue: queue.Queue[Batch | None] = queue.Queue(maxsize=max(1, max_pending))
        self.errors = 0
        self.thread = threading.Thread(target=self._run, name="eagle3d-dump-writer", daemon=True)
        self.thread.start()
        # On a normal interpreter exit, finish what is queued (bounded) rather than lose dumps
        # of requests already answered.
        atexit.register(self._close_at_exit)

    def _close_at_exit(self) -> None:
        # A logging stream closed before us (a test runner's capture) must not print a
        # "Logging error" traceback for the closing line.
        raising, logging.raiseExceptions = logging.raiseExceptions, False
        try:
            self.close(30.0)
        finally:
            logging.raiseExceptions = raising

    def put(self, batch: Batch) -> None:
        self.queue.put(batch)  # blocks only when max_pending batches are waiting: back-pressure

    def close(self, timeout: float | None = None) -> None:
        if self.thread.is_alive():
            try:
                self.queue.put(None, timeout=timeout)
            except queue.Full:  # a writer stuck on a dead disk: give up, do not hang the exit
                log.error("eagle3d: dump writer stuck for %s s at exit; queued dumps lost", timeout)
                return
            self.thread.join(timeout)
            a = self.assembler
            log.info(
                "eagle3d: dump writer finished: %d written, %d lost, %d refused%s",
                a.written,
                a.failed,
                a.refused,
                f"; {self.describe()}" if self.describe else "",
            )

    def drain(self) -> None:
        """Wait until everything queued so far is written (tests, shutdown)."""
        self.queue.join()

    def _run(self) -> None:
        from eagle3d.threadnames import name_this_thread

        name_this_thread("e3d-dump-writer")  # what top -H shows among the server's threads
        while True:
            batch = self.queue.get()
            try:
                if batch is None:
                    return
                try:
                    if batch.ready is not None:
                        batch.ready.synchronize()
                except Exception as e:  # the device copy failed: every dump of the batch
                    self.errors += 1
                    self.assembler.lose(batch, e)
                    continue
                self.assembler.feed(batch)  # isolates each request's write itself
            except Exception:  # a bug in the assembler: lose this batch, never the server
                self.errors += 1
                log.exception("eagle3d: writing the dumps of a forward failed")
            finally:
                self.queue.task_done()


# --------------------------------------------------------------------------------------------
# The forward side.


@dataclass(slots=True)
class Ranks:
    tp_rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    attn_dp_size: int = 1
    attn_cp_size: int = 1


def _sglang_ranks() -> Ranks:
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:  # not inside an SGLang worker: a single process
        return Ranks()

    p = get_parallel()
    return Ranks(p.tp_rank, p.tp_size, p.pp_size, p.attn_dp_size, p.attn_cp_size)


def _prefill_graph_backend() -> str | None:
    """The resolved prefill CUDA-graph backend of this server, or None when not published."""
    try:
        from sglang.srt.runtime_context import get_exec

        return str(get_exec().graph.cuda_graph_config.prefill.backend)
    except (ImportError, ValueError, RuntimeError, AttributeError):
        return None


def _radix_cache_on() -> bool | None:
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


def _sglang_version() -> str:
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


def _check_hooks_api() -> None:
    try:
        from sglang.srt.model_executor.hook_manager import register_forward_hooks
    except ImportError:
        return  # not inside SGLang (tests drive the hook with a stand-in)
    problem = hooks_api_problem(register_forward_hooks)
    if problem:
        raise HookLoadError(
            f"eagle3d hook: sglang {_sglang_version()}'s register_forward_hooks {problem}; "
            f"the hook expects {HOOKS_API} (sglang 0.5.21 to 0.5.23)"
        )


def _registration_context() -> tuple[Any, dict[str, Any], list[str]] | None:
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


def _check_forward_batch_class() -> None:
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
            f"{list(FORWARD_BATCH_FIELDS)} (sglang {_sglang_version()}; checked against 0.5.21 "
            "to 0.5.23)"
        )


def _enable_capture(model: Any, aux_layers: list[int] | None) -> tuple[str, Any, list[int]]:
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
        self.store = store  # a StoreFormat: states cast to it on the device; None: as computed
        self.layers = layers
        self.captured = sorted(set(layers))
        self.order = [self.captured.index(i) for i in layers]
        self.inner = inner
        self.name = name
        self.writes = rank.tp_rank == 0
        self.assembler = DumpAssembler(dump_dir, layers, radix_cache=_radix_cache_on())
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
        picked = [fb.input_ids[rows], aux_t[rows], hidden[rows]]
        # Which of them are views of the model's own storage, which it may reuse after the
        # hook returns: a slice of ids or hidden. Indexing with a tensor, and the cat of the
        # aux states, made new tensors already (on CPU, a second copy would be wasted).
        borrowed = [contiguous, False, contiguous]
        if self.store is not None:  # before the copy: half the bytes over PCIe and in the dump
            from eagle3d.storedtype import cast

            for k in (1, 2):
                stored = cast(picked[k], self.store)
                borrowed[k] = borrowed[k] and stored is picked[k]  # a cast made a new tensor
                picked[k] = stored
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
        return Batch(segments, host[0], host[1], host[2], ready)


def make_hook(config: dict[str, Any], *, model: Any = None, ranks: Ranks | None = None) -> Capture:
    """SGLang hook factory (``--forward-hooks`` spec ``hook_factory``).

    ``config``: ``dump_dir`` (required), ``aux_layers`` (list of layer ids, default the
    model's EAGLE-3 default ``[2, L//2, L-3]``), ``max_pending`` (queued forwards, default 4),
    ``store_dtype`` (the job's storage dtype, :mod:`eagle3d.storedtype`; default: as computed).
    ``model``/``ranks`` are for callers other than SGLang's hook manager (tests).
    Raises :class:`HookLoadError` naming what it expected when the server does not fit.
    """
    dump_dir = config.get("dump_dir")
    if not dump_dir:
        raise HookLoadError("eagle3d hook: config needs 'dump_dir'")
    aux_layers = config.get("aux_layers")
    store = None
    if config.get("store_dtype"):
        from eagle3d.storedtype import get

        try:
            store = get(str(config["store_dtype"]))
        except ValueError as e:
            raise HookLoadError(f"eagle3d hook: {e}") from None
    patterns: list[str] = []
    names: dict[str, Any] = {}
    if model is None:
        _check_hooks_api()
        ctx = _registration_context()
        if ctx is None:
            raise HookLoadError(
                f"eagle3d hook: make_hook must be called by SGLang's register_forward_hooks "
                f"(sglang/srt/model_executor/hook_manager.py; this is sglang "
                f"{_sglang_version()}, the hook expects {HOOKS_API}) or given model="
            )
        model, names, patterns = ctx
    rank = ranks or _sglang_ranks()
    if rank.pp_size > 1 or rank.attn_dp_size > 1 or rank.attn_cp_size > 1:
        raise HookLoadError(
            f"eagle3d hook: pp_size={rank.pp_size}, attn_dp_size={rank.attn_dp_size}, "
            f"attn_cp_size={rank.attn_cp_size}; the hook supports tensor parallelism only "
            "(each must be 1: no --pp-size, --enable-dp-attention, --attn-cp-size)"
        )
    backend = _prefill_graph_backend()
    if backend is not None and backend != "disabled":
        raise HookLoadError(
            f"eagle3d hook: the prefill CUDA graph backend is {backend!r}; replayed graphs never "
            "call hooks. Start SGLang with --disable-prefill-cuda-graph"
        )
    _check_forward_batch_class()
    name, inner, layers = _enable_capture(model, aux_layers)
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
