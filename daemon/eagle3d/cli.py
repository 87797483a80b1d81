"""``eagle3d`` command line: one subcommand per module, each exposing ``register(subparsers)``.

Subcommand modules keep heavy imports (torch, transformers, sglang) inside their handlers,
so ``eagle3d --help`` and ``eagle3d unit`` stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from eagle3d import __version__, exitcodes

#: Modules that add subcommands, in the order they appear in ``--help``.
COMMAND_MODULES = (
    "eagle3d.run.command",
    "eagle3d.tools.verify",
    "eagle3d.tools.plan",
    "eagle3d.tools.report",
    "eagle3d.tools.export",
    "eagle3d.tools.demo",
    "eagle3d.tools.tinymodel",
    "eagle3d.tools.sglang_launch",
    "eagle3d.tools.unit",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle3d",
        description="Crash-safe EAGLE-3 hidden-state extraction.",
        epilog=exitcodes.help_text(),
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
