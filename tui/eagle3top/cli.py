"""``eagle3-top``: the command line. Heavy imports (Textual) happen only for the TUI."""

from __future__ import annotations

import argparse
import os
import sys
import time

from . import boot  # noqa: F401  (first: what every monitor start begins with)
from .report import EXIT_CODES_HELP
from .sources import remote_args, targets

FORMATS = ("text", "json", "prometheus")

DESCRIPTION = """\
Monitor eagle3d extraction runs: live from the daemon's socket, else from the journal
in OUTPUT/.eagle3d (a finished or dead run stays fully inspectable), or on remote HOSTs
over ssh (`ssh HOST eagle3-top --stream ...`, no port forwarding).
"""

EPILOG = (
    EXIT_CODES_HELP
    + """
sources, in order: --socket; the socket named by the newest run_started record in the
journal; the default socket path; else the journal itself, followed live. With neither
--output nor --socket: the journal in the current directory, else every daemon socket in
/run/eagle3d and $XDG_RUNTIME_DIR/eagle3d.
liveness: a socket that answers means up; otherwise the daemon's shard lock
(OUTPUT/.eagle3d/shard-I-of-N.lock) held in /proc/locks means up, not held means down.

environment: EAGLE3_TOP_SSH (ssh command, default "ssh -T -o BatchMode=yes
-o ConnectTimeout=10"), EAGLE3_TOP_REMOTE (remote program, default "eagle3-top"),
NO_COLOR / FORCE_COLOR (--once text), TEXTUAL_COLOR_SYSTEM (e.g. 256 over ssh).
keys: q quit, ? help, p pause, r reconnect now.
"""
)


def _formatter(prog: str) -> argparse.HelpFormatter:
    """argparse's formatter at the terminal's width, found without ``shutil`` (which argparse
    imports for it on every parse, and with it bz2 and lzma: start time ``--once`` pays)."""
    try:
        columns = int(os.environ.get("COLUMNS", "0")) or os.get_terminal_size(1).columns
    except (ValueError, OSError):
        columns = 0
    return argparse.RawDescriptionHelpFormatter(prog, width=(columns if columns > 0 else 80) - 2)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="eagle3-top",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=_formatter,
    )
    p.add_argument("hosts", nargs="*", metavar="HOST", help="remote hosts to attach to over ssh")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--output", "-o", metavar="DIR", help="the job's output directory")
    src.add_argument("--socket", "-s", metavar="PATH", help="the daemon's socket")
    p.add_argument("--shard", metavar="I/N", help="only this shard (default: all found)")
    p.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="S",
        help="refresh interval in seconds (default 1, at least 0.25)",
    )
    p.add_argument("--once", "-1", action="store_true", help="print one snapshot and exit")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="with --once: text (default; its first line is a monitoring-plugins status line"
        " with perfdata), json, or prometheus (the text exposition format)",
    )
    p.add_argument("--json", action="store_true", help="with --once: the same as --format json")
    p.add_argument(
        "--textfile",
        metavar="PATH",
        help="write the Prometheus exposition to PATH atomically (for node_exporter's"
        " textfile collector; implies --once, prints nothing unless --format is given)",
    )
    p.add_argument(
        "--stream",
        action="store_true",
        help="relay the socket (or journal) as frames on stdio (what ssh runs remotely)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.interval < 0.25:
        parser.error("--interval below 0.25 s costs CPU for nothing; use 0.25 or more")
    if args.json:
        if args.format not in (None, "json"):
            parser.error("--json is --format json; give one of them")
        args.format = "json"
    if args.textfile:
        args.once = True
        folder = os.path.dirname(os.path.abspath(args.textfile))
        if not os.path.isdir(folder):
            # Checked before anything is read: a wrong path is a setup error, not a verdict.
            print(
                f"eagle3-top: --textfile {args.textfile}: the folder {folder} does not exist"
                " (create it, or point --textfile at node_exporter's textfile directory)",
                file=sys.stderr,
            )
            return 3
    if args.format and not args.once:
        parser.error(f"--{'json' if args.json else 'format'} needs --once")
    if args.stream:
        if args.hosts:
            parser.error("--stream relays this host; it takes no HOST")
        from . import relay

        found = targets(args)
        if not found:
            from eagle3proto import wire

            sys.stdout.buffer.write(wire.encode(wire.Error(message="nothing to relay here")))
            return 3
        return relay.run(found[0])
    if args.once or not sys.stdout.isatty():
        return _once(args)
    from .app import run_app  # Textual is imported here and only here

    return run_app(args)


def _once(args: argparse.Namespace) -> int:
    from . import once, sources

    if args.hosts:
        rows = [sources.once_remote(h, remote_args(args)) for h in args.hosts]
    else:
        rows = [sources.once_local(t) for t in targets(args)]
    from eagle3proto import locks

    from .model import stamp_clocks

    stamp_clocks(rows, locks.boot_id(), locks.boottime())
    doc, report = once.build(rows, time.time())
    fmt_name = args.format or ("" if args.textfile else "text")
    if args.textfile or fmt_name == "prometheus":
        from . import prometheus

        text = prometheus.exposition(doc)
        if args.textfile:
            prometheus.write_textfile(args.textfile, text)
    if fmt_name == "prometheus":
        sys.stdout.write(text)
    elif fmt_name:
        sys.stdout.write(once.render(doc, report, fmt_name, sys.stdout))
    sys.stdout.flush()
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
