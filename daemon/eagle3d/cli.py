"""``eagle3d`` command line: one subcommand per module, each exposing ``register(subparsers)``.

Subcommand modules keep heavy imports (torch, transformers, sglang) inside their handlers,
so ``eagle3d --help`` and ``eagle3d unit`` stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__

#: Modules that add subcommands, in the order they appear in ``--help``.
COMMAND_MODULES = (
    "eagle3d.runner",
    "eagle3d.verify",
    "eagle3d.plan",
    "eagle3d.export",
    "eagle3d.demo",
    "eagle3d.tinymodel",
    "eagle3d.sglang_launch",
    "eagle3d.unit",
)

EXIT_CODES = """\
exit codes of `eagle3d run`:
  0  finished, or stopped cleanly (rerun the same command to resume)
  1  internal error
  2  bad usage or configuration (unknown key, wrong type)
  3  model or dataset missing, unreadable, or not a dataset format eagle3d reads
  4  output not writable, or removed, moved or replaced during the run
  5  another daemon holds this shard of the output
  6  job fingerprint changed under a resumed job (--force-resume overrides)
  7  the output holds a job of another shard count (one layout per output)
  8  producer could not start
  9  finished, but every sample failed or more than --max-failed-fraction did
 10  the job does not fit on the output filesystem with --space-reserve (eagle3d plan
     says how much it needs; --no-space-check starts anyway)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle3d",
        description="Crash-safe EAGLE-3 hidden-state extraction.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"eagle3d {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue  # a command not built into this installation
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    code = func(args)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
