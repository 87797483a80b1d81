"""``eagle3d demo``: the whole product on the embedded default, offline, in about a minute.

Builds a tiny Llama (random weights, a tokenizer trained locally), takes the bundled dataset
of a few hundred conversations (three of its lines are malformed on purpose), runs the
extraction as a real daemon process, shows its progress the way the monitor sees it (from the
journal), then prints a summary and runs ``eagle3d verify``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from importlib import resources

from eagle3proto import paths, reducer, views
from eagle3proto.journalread import Follower

from eagle3d.serve.progress import ProgressLine


def _dataset() -> str:
    return str(resources.files("eagle3d").joinpath("data/demo.jsonl"))


def _eagle3_top() -> str | None:
    """The monitor installed beside this interpreter (a venv need not be on PATH)."""
    beside = os.path.join(os.path.dirname(sys.executable), "eagle3-top")
    return beside if os.access(beside, os.X_OK) else shutil.which("eagle3-top")


def run_demo(
    directory: str, *, layers: int, hidden: int, keep: bool, monitor: bool, quiet: bool
) -> int:
    """The demo, start to end: a tiny model, a dataset, a run, what it did, ``verify``.

    Long: the demo's script, in the order the user watches it happen (model, dataset, the
    run, its summary, verify, the monitor's ``--once``)."""
    from eagle3d.tools.tinymodel import build_tiny_model

    os.makedirs(directory, exist_ok=True)
    model = os.path.join(directory, "model")
    output = os.path.join(directory, "out")
    # A model built before tiny models carried their safetensors index is built again.
    if not os.path.exists(os.path.join(model, "model.safetensors.index.json")):
        print(f"building a tiny Llama ({layers} layers, hidden {hidden}) in {model} ...")
        build_tiny_model(model, layers=layers, hidden=hidden)
    if os.path.exists(output) and not keep:
        shutil.rmtree(output)
    dataset = _dataset()
    print(f"extracting hidden states: {dataset} -> {output}")
    cmd = [sys.executable, "-m", "eagle3d", "run", "--model", model, "--dataset", dataset]
    cmd += ["--output", output, "--max-length", "1024"]
    log_path = os.path.join(directory, "daemon.log")
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        top = None
        top_cmd = _eagle3_top()
        if monitor and sys.stdout.isatty() and top_cmd:
            top = subprocess.Popen([top_cmd, "--output", output])
        state = reducer.new_state()
        follower = Follower(paths.journal_dir(output, paths.Shard()))
        # One live line on a terminal; a line per state change and every 5 s in a pipe.
        line = ProgressLine.for_stream(sys.stdout, every=5.0) if not quiet and top is None else None
        while True:
            code = proc.poll()
            reducer.apply_all(state, follower.poll())
            if line is not None:
                line.update(state, time.time())
            if code is not None:
                break
            time.sleep(0.25)
        if line is not None:
            line.close(state, time.time())
        if top is not None:
            top.wait()
    elapsed = time.monotonic() - t0
    if code != 0:
        print(f"the daemon exited with {code}; its log: {log_path}", file=sys.stderr)
        with open(log_path) as f:
            sys.stderr.write(f.read()[-3000:])
        return code
    v = views.view(state, time.time())
    print(
        f"\ndone in {elapsed:.1f} s: {v.saved} saved, {v.failed} failed of {v.total}; "
        f"{v.tokens_saved:,} tokens, {v.bytes_saved / 1e6:.1f} MB "
        f"({v.tokens_saved / elapsed:,.0f} tok/s end to end, model load included)"
    )
    print(f"requests sent {v.requests} (retries {v.retries}); daemon log: {log_path}")
    failed = [e for e in state.errors if not e.retry]
    if failed:
        print("failed samples (reported from the journal, with their line numbers):")
        for e in failed:
            print(f"  sample {e.idx}: {e.error}: {e.message}")
    print(f"\n$ eagle3d verify --output {output}")
    from eagle3d.tools.verify import verify

    report = verify(output)
    print(report)
    top_once = _eagle3_top()
    if top_once:
        # The monitor's own one-shot view of the same output (it reads the journal).
        print(f"\n$ eagle3-top --once --output {output}")
        sys.stdout.flush()
        subprocess.run([top_once, "--once", "--output", output], check=False)
    print(
        f"\nlive monitor: eagle3-top --output {output}  (eagle3d demo --monitor shows it during the run)"
    )
    return report.exit_code


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="run the whole pipeline on a tiny local model and the bundled dataset",
        description="Build a tiny model, extract the bundled dataset, verify the output.",
    )
    p.add_argument("--dir", default=os.environ.get("EAGLE3D_DEMO_DIR", ".demo"))
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--keep", action="store_true", help="resume the previous demo output")
    p.add_argument("--monitor", action="store_true", help="show eagle3-top during the run")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(
        args.dir,
        layers=args.layers,
        hidden=args.hidden,
        keep=args.keep,
        monitor=args.monitor,
        quiet=args.quiet,
    )


__all__ = ["register", "run_demo"]
