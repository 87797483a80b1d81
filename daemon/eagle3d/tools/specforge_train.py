"""SpecForge 0.2.0's trainer on eagle3d's fp8 files: ``specforge train``, with the states
dequantized as they are read.

Run it where SpecForge is installed (eagle3d installed beside it; this module needs only
torch and :mod:`eagle3d.store.fp8`), with the arguments of ``specforge train``::

    python -m eagle3d.specforge_train train --config RUN.yaml [--role ...] [overrides ...]

SpecForge's offline reader hands each file's tensors to its EAGLE-3 normalizer as they are
stored: fp8 states would reach its bfloat16 target head as float8 and fail at the first
step. SpecForge 0.2.0 assembles its algorithms from an explicit registry
(``specforge.algorithms.registry.AlgorithmRegistry``), which its application API takes
(``resolve_run(cfg, registry)``; the resolved registration travels with the run), and its
launcher takes the command its worker processes run (``build_launch_plan(...,
worker_prefix=..., torchrun_prefix=...)``). That is the seam used here: the registry is
SpecForge's own built-in one, but for EAGLE-3's offline data providers, changed in two
places:

* the reader (SpecForge's ``OfflineManifestReader``, which lists the files itself) asks
  for the two scale tensors too, for the files that hold them: the ones the output's
  journal says were saved as fp8 (:mod:`eagle3d.store.catalog`), or, where a directory has no
  eagle3d journal (a copy), those whose archive holds six tensors (its zip directory, read
  at start: a few small reads per file);
* the normalizer first dequantizes such a file's states to bfloat16
  (:func:`eagle3d.store.fp8.dequantize_states`, only the first ``data.max_length`` tokens, which
  is all SpecForge keeps), then runs SpecForge's own normalizer. A file without scales
  (bfloat16) passes through both untouched.
Everything else is SpecForge's: the config, the file listing, the feature store, the
collator, the vocabulary mapping, the trainer, checkpoints and resume. Multi-process runs
launch this module in every worker (torchrun ``--no-python`` with it as the command), so
each rank reads the same way.

What the dequantization costs a training step is the states' bytes once more (fp8 in,
bfloat16 out, as the collator's copy would have made anyway); the files stay half the size.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

from eagle3d.store import fp8

#: The algorithms whose offline files carry eagle3d's layout (EAGLE-3's four tensors).
ALGORITHMS = ("eagle3",)


class Dequantizing:
    """A SpecForge offline normalizer that sees fp8 states dequantized to bfloat16.

    A class rather than a closure: SpecForge's loader workers may receive it pickled."""

    def __init__(self, inner: Callable[[Any], Any], max_len: int) -> None:
        self.inner = inner
        self.max_len = max_len

    def __call__(self, raw: Any) -> Any:
        if isinstance(raw, dict) and any(k.endswith(fp8.SCALE_SUFFIX) for k in raw):
            import torch

            raw = fp8.dequantize_states(raw, torch.bfloat16, self.max_len)
        return self.inner(raw)


class ScaledReader:
    """SpecForge's offline reader, asking for the scale tensors of the files that hold
    them (see the module's docstring); everything else is the wrapped reader's."""

    def __init__(self, inner: Any, hidden_states_path: str) -> None:
        self.inner = inner
        self.hidden_states_path = hidden_states_path

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __iter__(self) -> Any:
        return iter(self.read())

    def read(self, limit: int | None = None) -> list[Any]:
        refs = list(self.inner.read(limit))
        paths = [r.feature_store_uri.removeprefix("file://") for r in refs]
        scaled = scaled_files(self.hidden_states_path, paths)
        extra = {k + fp8.SCALE_SUFFIX: k + fp8.SCALE_SUFFIX for k in fp8.STATES}
        return [
            dataclasses.replace(r, feature_keys={**r.feature_keys, **extra}) if p in scaled else r
            for r, p in zip(refs, paths, strict=True)
        ]


def scaled_files(directory: str, files: list[str]) -> set[str]:
    """The ``files`` (absolute paths under ``directory``) that hold fp8 states with scales:
    as the journal of the eagle3d output at ``directory`` says, else by their archives."""
    try:
        from eagle3d.store import catalog

        cat = catalog.read(directory)
    except (ImportError, OSError):
        return {f for f in files if _archive_tensors(f) == 6}
    return {os.path.abspath(cat.path(e)) for e in cat.entries if e.store_dtype == "fp8"} & set(
        files
    )


def _archive_tensors(path: str) -> int:
    """How many tensors a ``torch.save`` archive holds (its ``data/N`` records), from its
    zip directory alone."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            return sum(1 for n in z.namelist() if n.rsplit("/", 2)[-2:-1] == ["data"])
    except (OSError, zipfile.BadZipFile):
        return 0


class _ReaderFactory:
    """``build_reader`` of an offline provider, wrapped in :class:`ScaledReader`."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner

    def __call__(self, hidden_states_path: str, *args: Any, **kwargs: Any) -> Any:
        reader = self.inner(hidden_states_path, *args, **kwargs)
        return ScaledReader(reader, hidden_states_path)


class _NormalizerFactory:
    """``build_normalizer`` of an offline provider, wrapped in :class:`Dequantizing`."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner

    def __call__(self, max_len: int, *args: Any, **kwargs: Any) -> Any:
        return Dequantizing(self.inner(max_len, *args, **kwargs), max_len)


def registry() -> Any:
    """SpecForge's built-in algorithm registry, with EAGLE-3's offline normalizers reading
    fp8 files (see the module's docstring)."""
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.algorithms.registry import AlgorithmRegistration, AlgorithmRegistry

    regs = []
    for reg in builtin_algorithm_registry():
        if reg.name in ALGORITHMS:
            providers = reg.providers
            offline = tuple(
                dataclasses.replace(
                    p,
                    build_reader=_ReaderFactory(p.build_reader),
                    build_normalizer=_NormalizerFactory(p.build_normalizer),
                )
                for p in providers.offline
            )
            reg = AlgorithmRegistration(reg.spec, dataclasses.replace(providers, offline=offline))
        regs.append(reg)
    return AlgorithmRegistry(regs)


def _parser() -> Any:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m eagle3d.specforge_train",
        description="specforge train, reading eagle3d's fp8 files (dequantized to bfloat16)",
    )
    sub = p.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="as `specforge train`")
    train.add_argument("-c", "--config", required=True, help="YAML or JSON run config")
    train.add_argument(
        "--role", choices=("auto", "all", "producer", "consumer", "both"), default="auto"
    )
    train.add_argument("--node-rank", type=int, default=None)
    train.add_argument("--plan", action="store_true", help="print the process plan only")
    train.add_argument("overrides", nargs="*", help="dotted overrides, as specforge takes")
    return p


def main(argv: list[str] | None = None) -> int:
    """``specforge train``'s own sequence (``specforge.cli.main``), with :func:`registry`
    and this module as the workers' command."""
    from specforge import cli
    from specforge.application import bind_run, resolve_run
    from specforge.config import load_config
    from specforge.launch_plan import build_launch_plan, run_commands

    args = _parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    resolved = resolve_run(cfg, registry())
    plan = build_launch_plan(
        resolved.config,
        algorithm=resolved.algorithm,
        config_path=args.config,
        overrides=args.overrides,
        requested_role=args.role,
        node_rank=args.node_rank,
        worker_prefix=(sys.executable, "-m", "eagle3d.specforge_train"),
        torchrun_prefix=(sys.executable, "-m", "torch.distributed.run", "--no-python"),
    )
    if args.plan:
        print(plan.render())
        return 0
    if plan.kind != "worker":
        return int(run_commands(plan))
    for key, value in plan.worker_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    role_config = cli._config_for_role(resolved.config, plan.role)
    try:
        with cli._worker_signal_unwind():
            cli._train(bind_run(role_config, resolved.algorithm))
    except cli._WorkerTermination as received:
        return 128 + int(received.signum)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
