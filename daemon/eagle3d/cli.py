"""``eagle3d`` command line: one subcommand per module, each exposing ``register(subparsers)``.

Subcommand modules keep heavy imports (torch, transformers, sglang) inside their handlers,
so ``eagle3d --help`` and ``eagle3d unit`` stay fast.
"""

from __future__ import annotations

import argparse
import difflib
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


def _subparser(
    parser: argparse.ArgumentParser, command: str | None
) -> argparse.ArgumentParser | None:
    """The parser of subcommand ``command`` (None for none or an unknown one)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command:
            found: argparse.ArgumentParser | None = action.choices.get(command)
            return found
    return None


def _refuse_extras(parser: argparse.ArgumentParser, command: str | None, extras: list[str]) -> None:
    """Exit 2 with the subcommand's own usage, naming each unknown argument and, where one
    of the subcommand's options is close, what was probably meant."""
    target = _subparser(parser, command) or parser
    options = [o for a in target._actions for o in a.option_strings]
    words = []
    for i, extra in enumerate(extras):
        if not extra.startswith("-") and i and extras[i - 1].startswith("-"):
            continue  # the value of the unknown option just named
        said = f"unrecognized argument: {extra}"
        if extra.startswith("-"):
            close = difflib.get_close_matches(extra.split("=", 1)[0], options, n=1, cutoff=0.6)
            if close:
                said += f" (did you mean {close[0]}?)"
        words.append(said)
    target.error("; ".join(words))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        _refuse_extras(parser, getattr(args, "command", None), extras)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    code = func(args)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
